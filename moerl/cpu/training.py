"""CPU training's fused ops: RMSNorm, and the attention's q / k norms with RoPE, as autograd functions over the C
kernels (``kernels.c``), where torch's CPU composites take a dozen small ops forward and more backward: at small
shapes their per-op overhead, not the arithmetic, is the cost. A trainer's CPU model takes them by module swaps
(``install_training``: ``FusedRMSNorm``, ``FusedAttention``); the model's own modules run torch's ops.

The forward runs torch's own ops without recording them (the trainer's logprobs keep their bits: the C forward
kernels round fp32 differently); the backward is one kernel call, in fp32, each gradient rounded once to its dtype
(torch's bf16 autograd rounds after each op). Used for plain CPU tensors with autograd on, outside a compiled graph
(inductor fuses the torch ops itself) and where the kernels build, and by a plan tracing the CPU's paths (its fake
tensors: what the ops keep for the backward); elsewhere (CUDA, DTensors, a plan of a GPU run) the torch ops run.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from moerl.cpu.kernels import KINDS, kernel
from moerl.device import gpu_planned
from moerl.model.attention import Attention
from moerl.model.norms import RMSNorm
from moerl.model.rope import apply_rope
from moerl.model.swap import replace_module, swapped


def fuses(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the fused training ops: plain CPU tensors (a Parameter is one; DTensors and
    functional tensors are not) of a kernel dtype, autograd on, not compiling, the kernels built. A plan tracing the
    CPU's paths (``moerl plan``) takes them on its fake tensors too: it counts what they keep for the backward."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    plain = all((type(t) in (torch.Tensor, torch.nn.Parameter) or _planned(t)) for t in tensors)
    cpu = all(t.device.type == "cpu" and t.dtype in KINDS for t in tensors)
    return plain and cpu and kernel() is not None


def _planned(t: torch.Tensor) -> bool:
    """A plan's fake tensor where the plan traces the CPU's paths (not CUDA's: ``gpu_paths``)."""
    return isinstance(t, FakeTensor) and not gpu_planned()


def _parts(weight: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    """Each thread's share of a weight's grad (fp32, zeroed), or None where none is needed."""
    return torch.zeros(torch.get_num_threads(), weight.shape[0]) if weight is not None and need else None


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


class RmsNormFn(torch.autograd.Function):
    """``F.rms_norm(x, (d,), weight, eps)`` over x's last dim d, its backward by ``moerl_rms_norm_backward``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        if isinstance(x, FakeTensor):  # a plan's trace: the grads' shapes
            return torch.empty_like(x), torch.empty_like(weight) if ctx.needs_input_grad[1] else None, None
        g = g.to(x.dtype).contiguous()
        dx = torch.empty_like(x)
        parts = _parts(weight, ctx.needs_input_grad[1])
        kernel().moerl_rms_norm_backward(
            _ptr(x),
            _ptr(weight),
            _ptr(g),
            _ptr(dx),
            _ptr(parts),
            ctypes.c_int64(x.numel() // x.shape[-1]),
            ctypes.c_int(x.shape[-1]),
            ctypes.c_float(ctx.eps),
            ctypes.c_int(KINDS[x.dtype]),
            ctypes.c_int(KINDS[weight.dtype]),
            ctypes.c_int(torch.get_num_threads()),
        )
        return dx, (parts.sum(0).to(weight.dtype) if parts is not None else None), None


class NormRopeFn(torch.autograd.Function):
    """Queries q [..., Hq, D] and keys k [..., Hk, D], each head RMSNorm-ed by q_weight / k_weight [D] (both None: no
    norms), then rotated (rotate-half RoPE) by cos / sin [..., D] as ``apply_rope`` rotates them; the backward of it
    all by ``moerl_norm_rope_backward``. Returns the new (q, k)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps: float, cos, sin):
        d = q.shape[-1]
        rows = (*q.shape[:-2], d)  # cos / sin may broadcast over the batch: the kernel reads a row for each token
        q, k, cos, sin = q.contiguous(), k.contiguous(), cos.expand(rows).contiguous(), sin.expand(rows).contiguous()
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = eps
        if q_weight is not None:
            q, k = F.rms_norm(q, (d,), q_weight, eps), F.rms_norm(k, (d,), k_weight, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    @staticmethod
    def backward(ctx, gq: torch.Tensor, gk: torch.Tensor):
        q, k, qw, kw, cos, sin = ctx.saved_tensors
        if isinstance(q, FakeTensor):  # a plan's trace: the grads' shapes
            grads = [
                torch.empty_like(w) if w is not None and need else None
                for w, need in ((qw, ctx.needs_input_grad[2]), (kw, ctx.needs_input_grad[3]))
            ]
            return torch.empty_like(q), torch.empty_like(k), *grads, None, None, None
        gq, gk = gq.to(q.dtype).contiguous(), gk.to(k.dtype).contiguous()
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
        dqw, dkw = _parts(qw, ctx.needs_input_grad[2]), _parts(kw, ctx.needs_input_grad[3])
        kernel().moerl_norm_rope_backward(
            _ptr(q),
            _ptr(k),
            _ptr(gq),
            _ptr(gk),
            _ptr(dq),
            _ptr(dk),
            ctypes.c_int64(q.numel() // (hq * d)),
            *(ctypes.c_int(v) for v in (hq, hk, d)),
            _ptr(qw),
            _ptr(kw),
            ctypes.c_float(ctx.eps),
            _ptr(cos),
            _ptr(sin),
            ctypes.c_int(KINDS[q.dtype]),
            ctypes.c_int(KINDS[qw.dtype] if qw is not None else 0),
            _ptr(dqw),
            _ptr(dkw),
            ctypes.c_int(torch.get_num_threads()),
        )
        dqw, dkw = (p.sum(0).to(w.dtype) if p is not None else None for p, w in ((dqw, qw), (dkw, kw)))
        return dq, dk, dqw, dkw, None, None, None


def rope_in_one_call(attn: Attention) -> bool:
    """Whether ``attn`` norms q / k per head (or not at all) before a full rotate-half RoPE of an even head size: what
    the norm + RoPE kernels compute, whatever the dtype."""
    plain = attn.qk_norm in ("head", "none") and not attn.qk_norm_after_rope and not attn.interleave
    return plain and attn.rope_dim == attn.head_dim and attn.head_dim % 2 == 0


def plain_rope(attn: Attention, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """``rope_in_one_call`` with q / k / cos of one kernel dtype."""
    return rope_in_one_call(attn) and q.dtype == k.dtype == cos.dtype and q.dtype in KINDS


class FusedRMSNorm(RMSNorm):
    """``RMSNorm`` whose backward on plain CPU tensors is one kernel call (``RmsNormFn``); its forward is torch's."""

    stands_for = RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fuses(x, self.weight):
            return RmsNormFn.apply(x, self.weight, self.eps)
        return super().forward(x)


class FusedAttention(Attention):
    """``Attention`` whose per-head q / k norms with RoPE take their backward on plain CPU tensors as one kernel call
    (``NormRopeFn``); its forward is torch's."""

    stands_for = Attention

    def _norm_and_rotate(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        if plain_rope(self, q, k, cos) and fuses(q, k, cos, sin):
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm == "head" else (None, None)
            if qw is None or (fuses(qw, kw) and qw.dtype == kw.dtype):  # the kernel takes one weight dtype
                return NormRopeFn.apply(q, k, qw, kw, self.q_norm.eps if qw is not None else 0.0, cos, sin)
        return super()._norm_and_rotate(q, k, cos, sin)


TRAINING_SWAPS = {RMSNorm: FusedRMSNorm, Attention: FusedAttention}


def install_training(model: torch.nn.Module) -> None:
    """Swap in the fused training ops on a trainer's model (its RMSNorms, q / k norms included, and attention), where
    the kernels build. Each runs torch's ops wherever ``fuses`` says no (CUDA, DTensors, no autograd), so installing
    them on a model that later moves or shards changes nothing there."""
    if kernel() is None:
        return
    for name, module in list(model.named_modules()):
        cls = TRAINING_SWAPS.get(type(module))
        if cls is not None:
            replace_module(model, name, swapped(module, cls))
