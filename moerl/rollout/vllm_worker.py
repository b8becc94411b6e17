"""The vLLM side of moerl's weight sync: a worker extension (``LLM(worker_extension_cls=...)``) whose methods run in
vLLM's worker process through ``collective_rpc``.

Tensors do not travel in the RPC arguments (vLLM's multiprocess RPC does not pickle them); the trainer writes each
bucket into a file-backed shared buffer (``moerl.rollout.shm``) and the RPC carries its layout. The worker stages the
buckets as views and, at commit, loads them all at once between two generation calls.

The commit loads through the model's own ``load_weights`` (vLLM's name mapping and weight loaders, once per tensor)
and then re-runs the post-load processing (the CPU kernels' weight packing) of the layers it touched, instead of
vLLM's general in-place ``reload_weights``, which restores every layer of the model to its checkpoint form, runs
each loader twice (once to count) and copies every processed tensor back (a sync 1.4-1.9x slower, measured). A
linear layer whose CPU kernel packed its weight away keeps a checkpoint-shaped weight between syncs to load into.
"""

from __future__ import annotations

import torch

from moerl.rollout.shm import BufferCache

# vLLM 0.32's GPT-OSS loader copies unquantized expert tensors straight into the parameters instead of through their
# weight loaders (vLLM's own in-place reload, which intercepts the loaders, silently keeps the old experts); moerl
# copies them itself: checkpoint suffix -> (vLLM parameter suffix, whether the checkpoint holds it transposed)
_DIRECT = {
    ".mlp.experts.gate_up_proj": (".mlp.experts.routed_experts.w13_weight", True),
    ".mlp.experts.gate_up_proj_bias": (".mlp.experts.routed_experts.w13_bias", False),
    ".mlp.experts.down_proj": (".mlp.experts.routed_experts.w2_weight", True),
    ".mlp.experts.down_proj_bias": (".mlp.experts.routed_experts.w2_bias", False),
}


def _copy_into(params: dict, name: str, tensor: torch.Tensor) -> None:
    if name not in params or params[name].shape != tensor.shape:
        have = tuple(params[name].shape) if name in params else "no such parameter"
        raise ValueError(f"moerl weight sync: {name}: got {tuple(tensor.shape)}, the vLLM model has {have}")
    params[name].copy_(tensor)


def _repack_experts(experts, layer: torch.nn.Module, spare: dict) -> None:
    """Pack a CPU MoE layer's freshly loaded expert weights into its kernel's grouped-GEMM layout: vLLM's CPU pack
    op writing into a buffer of the same shape kept from the last sync, which then becomes the weight (the old one
    the next buffer), instead of the kernel's post-load step, which allocates both weights anew each time. Kernels
    of another kind, and layers whose intermediate size vLLM pads, take that step."""
    pack = getattr(torch.ops._C, "prepack_moe_weight", None)
    kinds = {c.__name__ for c in type(experts).__mro__}
    moe = getattr(experts, "moe_config", None)
    if (
        pack is None
        or "CPUUnquantizedExperts" not in kinds
        or getattr(experts, "_use_zentorch", False)
        or moe is None
        or experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition
    ):
        experts.process_weights_after_loading(layer)
        return
    for name in ("w13_weight", "w2_weight"):
        weight = getattr(layer, name)
        key = (tuple(weight.shape), weight.dtype)
        out = spare.pop(key, None)
        out = torch.empty_like(weight.data) if out is None else out
        pack(weight.data, out, experts.isa)
        spare[key], weight.data = weight.data, out


class _Loader:
    """Loads checkpoint-format tensors into a vLLM model already loaded once, and re-packs what they touched."""

    def __init__(self, model: torch.nn.Module):
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.model, self.weights, self.spare = model, {}, {}
        # linear layers whose CPU kernel emptied their weight: their checkpoint-form weight, as vLLM recorded it when
        # it built the model (which its own in-place reload relies on too)
        self.emptied = {}
        for name, m in model.named_modules():
            w = m._parameters.get("weight")
            # (the CPU GEMM's packed copy; or MLA's kv_b_proj, whose weight AMX's MLA keeps packed in the attention)
            packed_away = hasattr(m, "cpu_linear") or getattr(m, "_cpu_skip_gemm_dispatch", False)
            if w is not None and w.numel() == 0 and packed_away:
                meta = get_layerwise_info(m).restore_metadata[0].get("weight")
                if meta is None:
                    raise RuntimeError(
                        f"moerl weight sync: vLLM packed away the weight of {name} ({type(m).__name__}) and holds no "
                        "record of its checkpoint form to load a new one into"
                    )
                self.emptied[m] = meta

    def _weight(self, m: torch.nn.Module) -> torch.nn.Parameter:
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        if m not in self.weights:  # kept between syncs: allocated once
            self.weights[m] = restore_layer_refs(materialize_meta_tensor(self.emptied[m]), m)
        return self.weights[m]

    def load(self, named: list[tuple[str, torch.Tensor]]) -> set[int]:
        """Load ``named`` through the model's loaders; returns the storages (data pointers) written."""
        empty = {m: m._parameters["weight"] for m in self.emptied}
        for m in self.emptied:
            m._parameters["weight"] = self._weight(m)
        try:
            loaded = self.model.load_weights(iter(named))
        except BaseException:
            for m, w in empty.items():
                m._parameters["weight"] = w
            raise
        params = dict(self.model.named_parameters(remove_duplicate=False))
        touched = {params[n].data_ptr() for n in loaded if n in params}
        for m, w in empty.items():  # layers not loaded keep their packed kernel and empty weight
            if self.weights[m].data_ptr() not in touched:
                m._parameters["weight"] = w
        return touched

    def process(self, touched: set[int]) -> None:
        """Re-run the post-load processing of every layer holding a written storage (``touched``: data pointers;
        tied weights included). A MoE layer's experts are re-packed when their weights were written: the loaders
        wrote checkpoint-layout values over the kernel's packed ones."""
        for m in self.model.modules():
            method = getattr(m, "quant_method", None)
            if method is None:
                continue
            if hasattr(method, "moe_kernel"):
                weights = (m._parameters.get(n) for n in ("w13_weight", "w2_weight"))
                if method.moe_kernel is not None and any(w is not None and w.data_ptr() in touched for w in weights):
                    _repack_experts(method.moe_kernel.fused_experts, m, self.spare)
                continue
            own = [p for p in m._parameters.values() if p is not None and p.numel()]
            if any(p.data_ptr() in touched for p in own):
                method.process_weights_after_loading(m)
        # attention layers that derive weights of their own from a projection's (MLA's W_UK / W_UV from kv_b_proj,
        # packed for AMX on such CPUs), as vLLM's loader does after the other modules
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        for m in self.model.modules():
            kv_b = getattr(m, "kv_b_proj", None)
            if kv_b is None or not is_deferred_attention_layer(m):
                continue
            w = kv_b._parameters.get("weight")
            if w is not None and w.numel() and w.data_ptr() in touched:
                m.process_weights_after_loading(w.dtype)


class MoerlWorkerExtension:
    """Methods mixed into vLLM's worker class (no ``__init__``: vLLM builds the worker)."""

    def moerl_stage(self, msg: dict) -> int:
        """Hold one bucket of HF-named tensors (views of the shared buffer) until ``moerl_commit``."""
        if not hasattr(self, "_moerl_reader"):
            self._moerl_reader, self._moerl_staged = BufferCache(), []
        buf = self._moerl_reader.get(msg["buffer"], msg["nbytes"])
        self._moerl_staged += list(buf.read(msg["tensors"], copy=False).items())
        return len(self._moerl_staged)

    def moerl_discard(self) -> None:
        self._moerl_staged = []

    def moerl_commit(self) -> int:
        """Load every staged tensor into the model at once and re-pack the layers they touched; returns how many."""
        staged, self._moerl_staged = getattr(self, "_moerl_staged", []), []
        model = self.model_runner.get_model()
        direct = _DIRECT if type(model).__name__.startswith("GptOss") else {}
        through_vllm = [(n, t) for n, t in staged if not n.endswith(tuple(direct))]
        with torch.no_grad():
            loader = getattr(self, "_moerl_loader", None) or _Loader(model)
            self._moerl_loader = loader
            touched = loader.load(through_vllm)
            params = dict(model.named_parameters()) if direct else {}
            for name, tensor in staged:
                for suffix, (target, transpose) in direct.items():
                    if name.endswith(suffix):
                        target = name.removesuffix(suffix) + target
                        _copy_into(params, target, tensor.mT if transpose else tensor)
                        touched.add(params[target].data_ptr())
            loader.process(touched)
        return len(staged)

    def moerl_record_routes(self) -> int:
        """Start recording each token's chosen experts (``moerl.rollout.vllm_routes``); returns the MoE layers."""
        from moerl.rollout import vllm_routes

        if vllm_routes.RECORDER is None:
            vllm_routes.RECORDER = vllm_routes.RouteRecorder(self.model_runner)
        return len(vllm_routes.RECORDER.routers)

    def moerl_take_routes(self) -> dict[str, list]:
        """The rows recorded since the last call, per request (``RouteRecorder.take``)."""
        from moerl.rollout import vllm_routes

        return vllm_routes.RECORDER.take()

    def moerl_gates(self) -> list[str]:
        """The module names of the model's MoE gates, in order."""
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

        return [n for n, m in self.model_runner.get_model().named_modules() if isinstance(m, GateLinear)]

    def moerl_gate(self, name: str, hidden: list | None = None) -> list:
        """The gate module ``name`` as vLLM computes it: its logits for ``hidden`` ([T, H] values, bias included), or
        with ``hidden`` None its effective weight, read through the gate's own bias-free GEMM on the identity (exact
        in fp32, and it works where the CPU build packed the weight away and left the parameter empty)."""
        gate = self.model_runner.get_model().get_submodule(name)
        with torch.no_grad():
            if hidden is None:
                eye = torch.eye(gate.input_size, dtype=next(gate.parameters()).dtype)
                out = gate.quant_method.apply(gate, eye, None).t()
            else:
                out = gate(torch.tensor(hidden, dtype=torch.float32).to(torch.bfloat16))
                out = out[0] if isinstance(out, tuple) else out
        return [str(out.dtype), list(out.shape), out.float().reshape(-1).tolist()]

    def moerl_names(self) -> list[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters()]

    def moerl_read(self, names: list[str]) -> dict[str, list]:
        """The model's parameters ``names`` (vLLM names) as (dtype, shape, flat values) for tests and checks."""
        params = dict(self.model_runner.get_model().named_parameters())
        out = {}
        for n in names:
            t = params[n].detach().float().cpu()
            out[n] = [str(params[n].dtype), list(t.shape), t.reshape(-1).tolist()]
        return out
