"""The vLLM side of moerl's weight sync: a worker extension (``LLM(worker_extension_cls=...)``) whose methods run in
vLLM's worker process through ``collective_rpc``.

Tensors do not travel in the RPC arguments (vLLM's multiprocess RPC does not pickle them); the trainer writes each
bucket into a file-backed shared buffer (``moerl.rollout.shm``) and the RPC carries its layout. The worker stages the
buckets as views and, at commit, reloads them all at once through vLLM's own ``reload_weights`` (which runs the
layers' post-load processing again, e.g. the CPU MoE kernels' weight packing), between two generation calls.
"""

from __future__ import annotations

import torch

from moerl.rollout.shm import BufferCache

# vLLM 0.32's GPT-OSS loader copies unquantized expert tensors straight into the parameters instead of through their
# weight loaders, which is all the in-place reload intercepts: a reload silently keeps the old experts. moerl copies
# them itself: checkpoint suffix -> (vLLM parameter suffix, whether the checkpoint holds it transposed)
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
        """Load every staged tensor into the model at once (vLLM's in-place reload); returns how many."""
        staged, self._moerl_staged = getattr(self, "_moerl_staged", []), []
        model = self.model_runner.get_model()
        direct = _DIRECT if type(model).__name__.startswith("GptOss") else {}
        through_vllm = [(n, t) for n, t in staged if not n.endswith(tuple(direct))]
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(through_vllm), is_checkpoint_format=True)
            params = dict(model.named_parameters())
            for name, tensor in staged:
                for suffix, (target, transpose) in direct.items():
                    if name.endswith(suffix):
                        _copy_into(params, name.removesuffix(suffix) + target, tensor.mT if transpose else tensor)
            # vLLM 0.32 prepacks an unquantized MoE layer's CPU weights into its grouped-GEMM layout on the first
            # load only; after a reload the experts hold checkpoint-layout values (scrambled outputs) until the
            # kernel's own post-load step runs again, for the layers whose experts were reloaded
            loaded = {n for n, _ in staged}
            for name, module in model.named_modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                prefix = name.removesuffix(".routed_experts") + "."
                if kernel is not None and any(n.startswith(prefix) for n in loaded):
                    kernel.fused_experts.process_weights_after_loading(module)
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
