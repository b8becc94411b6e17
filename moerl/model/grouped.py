"""Grouped GEMM over rows sorted by group (expert, or adapter slot x expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Groups:
    """Rows sorted by group (an expert, or a (slot, expert) pair) and how a grouped GEMM runs over them.

    On CUDA: ``torch._grouped_mm`` with the group offsets. On the CPU ``torch._grouped_mm`` is one small GEMM
    per group, and per-call overhead dominates when groups are small (decode); there a single bmm over a
    capacity-padded ``[groups, max rows, K]`` buffer is faster. It is used while groups average <= 64 rows and
    padding at most quadruples the work; large groups (prefill) keep the per-group GEMMs.

    Inside a ``torch.compile`` graph the choice depends on the data, so there the grouped GEMM is one opaque op
    (``moerl::group_mm``) that makes it when it runs.
    """

    __slots__ = ("offs", "padded", "group", "pos", "cap", "keys", "n_groups", "opaque")

    def __init__(self, keys: torch.Tensor, n_groups: int):
        self.keys, self.n_groups = keys, n_groups
        self.opaque = torch.compiler.is_compiling()
        if self.opaque:
            return
        counts = torch.bincount(keys, minlength=n_groups)
        ends = counts.cumsum(0)
        self.offs = ends.to(torch.int32)
        self.cap = int(counts.max()) if not keys.is_cuda and keys.numel() else 0
        rows = keys.numel()
        self.padded = not keys.is_cuda and 0 < rows <= 64 * n_groups and n_groups * self.cap <= 4 * rows
        if self.padded:
            self.group = keys
            self.pos = torch.arange(keys.numel(), device=keys.device) - (ends - counts)[keys]


def group_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Row block g of ``x`` [M, K] (rows sorted by group) times ``w[g]`` [K, N] -> [M, N]."""
    if groups.opaque:
        return _group_mm_op(x, w, groups.keys, groups.n_groups)
    if not groups.padded:
        if x.is_cuda and x.element_size() == 2:
            return _aligned_grouped_mm(x, w, groups.offs)
        return torch._grouped_mm(x, w, offs=groups.offs)
    buf = x.new_zeros(w.shape[0], groups.cap, x.shape[1])
    buf[groups.group, groups.pos] = x
    return torch.bmm(buf, w)[groups.group, groups.pos]


def _aligned_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """CUDA's grouped GEMM in a 16-bit dtype takes 16-byte-aligned strides only: K and N not a multiple of 8 (a
    rank-4 adapter, an odd hidden size) are padded with zeros, which add nothing, and the output is cut back."""
    k, n = x.shape[1], w.shape[2]
    if k % 8:
        x, w = F.pad(x, (0, -k % 8)), F.pad(w, (0, 0, 0, -k % 8))
    if n % 8:
        w = F.pad(w, (0, -n % 8))
    y = torch._grouped_mm(x, w, offs=offs)
    return y[:, :n] if n % 8 else y


@torch.library.custom_op("moerl::group_mm", mutates_args=())
def _group_mm_op(x: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``group_mm`` as one op a compiled graph calls (inference only: no autograd formula is registered)."""
    return group_mm(x, w, Groups(keys, n_groups))


@_group_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_groups: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])
