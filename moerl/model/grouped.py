"""Grouped GEMM over rows sorted by group (expert, or adapter slot x expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerl.device import capability, on_gpu


class Groups:
    """Rows sorted by group (an expert, or a (slot, expert) pair) and how a grouped GEMM runs over them.

    ``keys`` [M] (each row's group) must be sorted. The group offsets come from a search of the sorted keys, on
    their device: no host read (CUDA's ``bincount`` reads its input's extent on the host: a sync per layer, and none
    may happen while a CUDA graph is captured).

    On CUDA: ``torch._grouped_mm`` with the group offsets (its kernel, for bf16 on sm90 / sm100: ``device_kernel``;
    elsewhere torch falls back to one GEMM per group over offsets it reads on the host). On the CPU
    ``torch._grouped_mm`` is one small GEMM per group, and per-call overhead dominates when groups are small (decode);
    there a single bmm over a capacity-padded ``[groups, max rows, K]`` buffer is faster. ``padded`` says it may be
    used: groups average <= 64 rows and padding at most quadruples the work; large groups (prefill) keep the
    per-group GEMMs. ``group_mm`` also keeps them for fp32 groups whose weight exceeds ``PAD_MAX_FP32_BYTES``: there
    streaming the weight, not the call, is the cost, and the padded rows add to it.

    Inside a ``torch.compile`` graph the choice depends on the data, so there ``group_mm`` is one opaque op
    (``moerl::group_mm``, its graph form: ``_group_mm_in_graph``) that makes it when it runs; its backward is two
    more such ops (``group_mm`` of the output's gradient by the transposed weights, ``moerl::group_mm_wgrad``), so a
    compiled training graph holds it.
    """

    __slots__ = ("offs", "keys", "n_groups", "_padding")

    def __init__(self, keys: torch.Tensor, n_groups: int):
        self.keys, self.n_groups = keys, n_groups
        self._padding: tuple[bool, int, torch.Tensor | None] | None = None
        ends = torch.searchsorted(keys, torch.arange(n_groups, device=keys.device, dtype=keys.dtype), right=True)
        self.offs = ends.to(torch.int32)

    @property
    def padded(self) -> bool:
        """Whether the capacity-padded bmm may be used (see the class)."""
        return self._plan()[0]

    def _plan(self) -> tuple[bool, int, torch.Tensor | None]:
        """(padded, the largest group's rows, each row's place in its group), made when first asked: the per-group
        GEMMs of streamed weights never ask (each small op beside those GEMMs costs tens of us: their threads wake
        again)."""
        if self._padding is None:
            padded, cap, pos, rows = False, 0, None, self.keys.numel()
            if not on_gpu(self.keys) and rows:  # the CPU's choice reads the largest group: no sync on a CPU
                ends = self.offs.to(self.keys.dtype)
                counts = torch.diff(ends, prepend=ends.new_zeros(1))
                cap = int(counts.max())
                padded = rows <= 64 * self.n_groups and self.n_groups * cap <= 4 * rows
                if padded:  # each row's place within its group
                    pos = torch.arange(rows, device=self.keys.device) - (ends - counts)[self.keys]
            self._padding = padded, cap, pos
        return self._padding

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows sorted by group [M, D] -> the capacity-padded buffer [groups, cap, D] (zeros past each group's rows)."""
        _, cap, pos = self._plan()
        buf = rows.new_zeros(self.n_groups, cap, rows.shape[1])
        buf[self.keys, pos] = rows
        return buf

    def unpad(self, buf: torch.Tensor) -> torch.Tensor:
        """The capacity-padded buffer [groups, cap, D] -> its rows sorted by group [M, D]."""
        return buf[self.keys, self._plan()[2]]


# fp32 on the CPU: one group's weight past this and streaming it bounds the GEMM, so the per-group GEMMs (no padded
# rows to stream it against) beat the padded bmm; bf16's padded bmm keeps its lead there
PAD_MAX_FP32_BYTES = 256 * 1024


def streams_weights(w: torch.Tensor) -> bool:
    """Whether a grouped GEMM over ``w`` [G, K, N] is bound by streaming each group's weight (fp32, a group's weight
    past ``PAD_MAX_FP32_BYTES``): it runs per group, unpadded, and stores its weights K-major where it can
    (an engine's own CPU model: ``moerl.cpu.experts.k_major``)."""
    return w.dtype == torch.float32 and w.shape[-2] * w.shape[-1] * 4 > PAD_MAX_FP32_BYTES


# a CPU GEMM in bf16 / fp16 is oneDNN's, which compiles a kernel for each new shape, costlier than the GEMM of a
# training step's expert group: a group's rows padded to a multiple of this repeat their shapes across steps, so
# the kernels come from its cache
BUCKET_ROWS = 64


def jits_per_shape(t: torch.Tensor) -> bool:
    """Whether a GEMM of ``t`` compiles a kernel per shape: a CPU GEMM in a half-precision dtype (oneDNN's)."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def _bucket(groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's place, the group ends) in a buffer where every group's rows are padded to a multiple of
    ``BUCKET_ROWS`` (zeros after them)."""
    ends = groups.offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + BUCKET_ROWS - 1) // BUCKET_ROWS * BUCKET_ROWS
    padded_ends = padded.cumsum(0)
    shift = (padded_ends - padded) - (ends - counts)  # each group's start, padded minus unpadded
    place = torch.arange(groups.keys.numel(), device=ends.device) + shift[groups.keys]
    return place, padded_ends.to(torch.int32)


def _bucketed(groups: Groups, *rows: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Rows (each [M, D], sorted by group) laid out in ``_bucket``'s buffer, the layout made once for them all
    (differentiable): (the buffers, each row's place, the buffers' group ends)."""
    place, ends = _bucket(groups)
    total = int(ends[-1]) if ends.numel() else 0
    return [r.new_zeros(total, r.shape[1]).index_copy(0, place, r) for r in rows], place, ends


def group_mm(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Row block g of ``x`` [M, K] (rows sorted by group) times ``w[g]`` [K, N] -> [M, N]."""
    if streams_weights(w) or not groups.padded:
        if jits_per_shape(x) and x.shape[0]:
            (buf,), place, ends = _bucketed(groups, x)
            return _aligned_grouped_mm(buf, w, ends).index_select(0, place)
        return _aligned_grouped_mm(x, w, groups.offs)
    return groups.unpad(torch.bmm(groups.pad(x), w))


def group_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, groups: Groups) -> torch.Tensor:
    """The gradient of ``group_mm``'s weights [G, K, N]: ``x_g^T @ dy_g`` over each group's rows of ``x`` [M, K] and
    of the output's gradient ``dy`` [M, N] (zeros for a group without rows)."""
    k, n = x.shape[1], dy.shape[1]
    if groups.padded:
        return torch.bmm(groups.pad(x).transpose(1, 2), groups.pad(dy))
    # the 2D x 2D form groups along the reduced dim; x^T's row stride is K, and strides must be 16-byte aligned
    a, offs = 16 // x.element_size(), groups.offs
    if jits_per_shape(x) and x.shape[0]:
        (x, dy), _, offs = _bucketed(groups, x, dy)
    x = F.pad(x, (0, -k % a)) if k % a else x.contiguous()
    dy = F.pad(dy, (0, -n % a)) if n % a else dy.contiguous()
    return torch._grouped_mm(x.t(), dy, offs=offs)[:, :k, :n]


def device_kernel(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether CUDA's grouped GEMM has its kernel for ``dtype`` on ``device``: bf16 on sm90 / sm100 (no host read, so
    a CUDA graph can hold it). Elsewhere on CUDA ``torch._grouped_mm`` falls back to one GEMM per group over
    ``offs.cpu()``: right, but a host sync per call, which no CUDA graph can capture."""
    cc = capability(torch.device(device))
    return dtype == torch.bfloat16 and cc is not None and cc[0] in (9, 10)


def _aligned_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM takes 16-byte-aligned strides only (CUDA and CPU alike): K and N not a multiple of
    ``16 / element size`` (a rank-4 adapter in bf16, an odd hidden size) are padded with zeros, which add nothing,
    and the output is cut back."""
    k, n, a = x.shape[1], w.shape[2], 16 // x.element_size()
    if k % a:
        x, w = F.pad(x, (0, -k % a)), F.pad(w, (0, 0, 0, -k % a))
    else:  # a gradient may arrive expanded (stride 0), which the kernel refuses
        x = x.contiguous()
    if n % a:
        w = F.pad(w, (0, -n % a))
    y = torch._grouped_mm(x, w, offs=offs)
    return y[:, :n] if n % a else y


@torch.library.custom_op("moerl::group_mm", mutates_args=())
def _group_mm_op(x: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``group_mm`` as one op a compiled graph calls. Its output is contiguous whatever the path (a padded K / N
    leaves a strided slice), as its fake says: a graph plans its layout from the fake."""
    return group_mm(x, w, Groups(keys, n_groups)).contiguous()


@_group_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_groups: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("moerl::group_mm_wgrad", mutates_args=())
def _group_mm_wgrad_op(x: torch.Tensor, dy: torch.Tensor, keys: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``group_mm_wgrad`` as one op a compiled graph's backward calls (contiguous, as its fake)."""
    return group_mm_wgrad(x, dy, Groups(keys, n_groups)).contiguous()


@_group_mm_wgrad_op.register_fake
def _(x: torch.Tensor, dy: torch.Tensor, keys: torch.Tensor, n_groups: int) -> torch.Tensor:
    return x.new_empty(n_groups, x.shape[1], dy.shape[1])


def _save(ctx, inputs, output) -> None:
    x, w, keys, n_groups = inputs
    ctx.save_for_backward(x, w, keys)
    ctx.n_groups = n_groups


def _backward(ctx, dy: torch.Tensor):
    x, w, keys = ctx.saved_tensors
    dx = _group_mm_op(dy, w.transpose(1, 2), keys, ctx.n_groups) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1] and w.transpose(1, 2).is_contiguous():
        # the experts' and adapters' weights come as transposed views: their gradient made in the parameter's own
        # layout (dy_g^T x_g) and handed back transposed, so no copy or strided add reaches the parameter's .grad
        dw = _group_mm_wgrad_op(dy, x, keys, ctx.n_groups).transpose(1, 2)
    elif ctx.needs_input_grad[1]:
        dw = _group_mm_wgrad_op(x, dy, keys, ctx.n_groups)
    return dx, dw, None, None


_group_mm_op.register_autograd(_backward, setup_context=_save)


@torch.compiler.substitute_in_graph(group_mm)
def _group_mm_in_graph(x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
    """``group_mm`` as a compiled graph traces it: the one op, whose choice of path reads the data when it runs."""
    return _group_mm_op(x, w, groups.keys, groups.n_groups)
