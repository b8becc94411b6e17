"""CPU training's fused ops: RMSNorm, and the attention's q / k norms with RoPE, as autograd functions over the C
kernels (``kernels.c``), where torch's CPU composites take a dozen small ops forward and more backward: at small
shapes their per-op overhead, not the arithmetic, is the cost.

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

from moerl.device import gpu_planned
from moerl.model.packed import KINDS, kernel
from moerl.model.rope import apply_rope


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
