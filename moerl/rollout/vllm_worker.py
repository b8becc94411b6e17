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
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
            # vLLM 0.32 runs the fused experts' own post-load hook only on the first load (it prepacks the CPU MoE
            # weights into the grouped-GEMM layout); after a reload the experts hold checkpoint-layout values, so
            # the hook must run again or the MoE layers compute with scrambled weights
            for module in model.modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is not None:
                    kernel.fused_experts.process_weights_after_loading(module)
        return len(staged)

    def moerl_gate(self, layer: int, hidden: list | None = None) -> list:
        """MoE layer ``layer``'s router as vLLM computes it: its logits for ``hidden`` ([T, H] values), or with
        ``hidden`` None its effective weight, read through the gate's own GEMM on the identity (exact in fp32, and
        it works where the CPU build packed the weight away and left the parameter empty)."""
        gate = self.model_runner.get_model().model.layers[layer].mlp.gate
        x = torch.eye(gate.input_size) if hidden is None else torch.tensor(hidden, dtype=torch.float32)
        with torch.no_grad():
            out = gate(x.to(next(gate.parameters()).dtype if hidden is None else torch.bfloat16))
        out = out[0] if isinstance(out, tuple) else out
        out = out.t() if hidden is None else out
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
