"""Attention's q / k / v, and its q / k norms with RoPE, as one C call each in an engine's decode; in a bound decode
step (``moerl.cpu.direct``) the attention read from the paged cache in place too."""

from __future__ import annotations

from functools import partial

import torch

from moerl.cpu.binding import Binding
from moerl.cpu.kernels import (
    bf16_linear_args,
    fused_linear,
    kernel,
    norm_rope,
    norm_rope_args,
    paged_args,
    paged_scratch,
    rows_of,
)
from moerl.cpu.linear import KernelLinear, KernelLoraLinear, fused_bf16_args, fused_projections
from moerl.cpu.norms import eager_decode
from moerl.cpu.training import plain_rope, rope_in_one_call
from moerl.model.attention import Attention


class KernelAttention(Attention):
    """``Attention`` whose q / k / v are one bf16 dot-product call where all three run there (``fused_projections``)
    and whose per-head norms (or none) before a full rotate-half RoPE are one call, in place (``norm_rope``), without
    autograd; else the plain attention's."""

    stands_for = Attention

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.k_eq_v:  # no v_proj: the keys are the values
            return super()._qkv(x)
        fused = fused_projections(self, (self.q_proj, self.k_proj, self.v_proj), x)
        return fused if fused is not None else super()._qkv(x)

    def _norm_and_rotate(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        if eager_decode() and plain_rope(self, q, k, cos) and rows_of(q) is not None and rows_of(k) is not None:
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm == "head" else (None, None)
            norm_rope(q, k, qw, kw, self.q_norm.eps if qw is not None else 0.0, cos, sin)
            return q, k
        return super()._norm_and_rotate(q, k, cos, sin)

    def bound_refusal(self, dtype: torch.dtype) -> str | None:
        """What of this attention a bound decode step of a ``dtype`` model cannot run."""
        if self.k_eq_v or self.v_norm:
            return "values that are the keys, or normed values"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m = getattr(self, name)
            if not isinstance(m, KernelLinear):
                return f"{name} is a {type(m).__name__}, not a projection of the CPU backend"
            why = m.bound_refusal(dtype)
            if why is not None:
                return why
        if len({type(m) for m in (self.q_proj, self.k_proj, self.v_proj)}) > 1:
            return "adapters on some of q / k / v only"
        if self.output_gate or self.gate_kind != "none" or self.clip_qkv is not None:
            return "an attention output gate, or clipped q / k / v"
        if self.v_dim != self.head_dim or self.value_scale != 1.0:
            return "value heads of their own size, or scaled values"
        if not rope_in_one_call(self):
            return "q / k norms other than per head before RoPE, or interleaved or partial RoPE"
        return None

    def bind(self, step: Binding, h: torch.Tensor, out: torch.Tensor) -> bool:
        """The calls of this attention on rows ``h``: q / k / v, their norms and RoPE, the attention over the paged
        cache (this step's keys and values written by the same call), o_proj into ``out``. False where the adapters
        do not run as one call (``step.why``)."""
        qkv = self._bind_qkv(step, h)
        if qkv is None:
            return False
        q, k, v = qkv
        b, d, cache = step.rows, self.head_dim, step.cache
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm == "head" else (None, None)
        eps = self.q_norm.eps if qw is not None else 0.0
        step.call(kernel().moerl_norm_rope, norm_rope_args(q, k, qw, kw, eps, step.cos, step.sin))
        window = cache.sliding_window if self.sliding and cache.sliding_window else 0
        sinks = self.sinks.float().contiguous() if self.sinks is not None else None
        seen = step.buf("seen", step.padded, self.num_heads * d, dtype=h.dtype)
        hq, bs = self.num_heads, cache.block_size
        scratch = step.buf("paged", *paged_scratch(hq // self.num_kv_heads, d, step.width, bs))
        pools = (cache.k[self.layer], cache.v[self.layer], step.tables, step.pos, sinks)
        new = (k.view(b, -1), v.view(b, -1), step.slots)
        args = paged_args(q.view(b, -1), hq, pools, bs, window, self.scale, seen, scratch, new)
        step.call(kernel().moerl_paged_decode, args)
        self.o_proj.bind(step, seen, out)
        step.keep.append(sinks)
        return True

    def _bind_qkv(self, step: Binding, h: torch.Tensor) -> list[torch.Tensor] | None:
        """The calls of q / k / v for rows ``h``: on the bf16 dot products one call from their panels side by side
        (``fused_projections``' call, adapters joined), else torch's GEMM each (fp32, the modules' ``F.linear``).
        Returns q, k, v [rows, heads, d] (views of what the calls write), or None where the adapters do not run as one
        call (``step.why``)."""
        layers, d, dt, b = (self.q_proj, self.k_proj, self.v_proj), self.head_dim, h.dtype, step.rows
        if not self.q_proj.has_panels:
            outs = [step.buf(f"qkv {i}", b, m.out_features, dtype=dt) for i, m in enumerate(layers)]
            for m, y in zip(layers, outs, strict=True):
                step.call(partial(torch.mm, out=y), (h[:b], m.weight.t()))
            return [y.view(b, -1, d) for y in outs]
        panels, _ = fused_linear(self, layers)
        qkv = step.buf("qkv", b, panels.shape[1] * panels.shape[3], dtype=dt)
        adapters = xa = None
        if step.adapters is not None and type(self.q_proj) is KernelLoraLinear:
            made = fused_bf16_args(self, [m.lora for m in layers], panels, step.adapters)
            if made is None:
                step.why = "q / k / v adapters that do not run as one call (their scales or ranks differ)"
                return None
            adapters, xa = made[1], step.buf("xa", b, made[1].r)
            step.keep.append(made)
        step.call(kernel().moerl_bf16_linear, bf16_linear_args(h, b, panels, qkv, adapters, xa))
        return [t.view(b, -1, d) for t in qkv.split([m.out_features for m in layers], dim=1)]
