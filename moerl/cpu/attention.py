"""Attention's q / k / v, and its q / k norms with RoPE, as one C call each in an engine's decode."""

from __future__ import annotations

import torch

from moerl.cpu.linear import fused_projections
from moerl.cpu.norms import eager_decode
from moerl.model.attention import Attention
from moerl.model.packed import norm_rope, rows_of


class KernelAttention(Attention):
    """``Attention`` whose q / k / v are one bf16 dot-product call where all three run there (``fused_projections``)
    and whose per-head norms (or none) before a full rotate-half RoPE are one call, in place (``norm_rope``), without
    autograd; else the plain attention's."""

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fused = fused_projections(self, (self.q_proj, self.k_proj, self.v_proj), x)
        return fused if fused is not None else super()._qkv(x)

    def _norm_and_rotate(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        if eager_decode() and self._plain_rope(q, k, cos) and rows_of(q) is not None and rows_of(k) is not None:
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm == "head" else (None, None)
            norm_rope(q, k, qw, kw, self.q_norm.eps if qw is not None else 0.0, cos, sin)
            return q, k
        return super()._norm_and_rotate(q, k, cos, sin)
