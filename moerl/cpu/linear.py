"""The projections in an engine's decode on a CPU: bf16 rows as one call on the bf16 dot products from packed panels
of the weight (oneDNN's GEMM of a decode step's few rows is mostly set-up), attention's q / k / v as one such call,
and adapter slots' deltas inside the same call (bf16) or as one more (``lora_add``, fp32)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from moerl.cpu.binding import Binding
from moerl.cpu.kernels import (
    BF16_LINEAR_MAX_ROWS,
    _panel_view,
    bf16_linear,
    bf16_linear_args,
    bf16_linear_op,
    bf16_linear_packs,
    bf16_lora,
    fused_linear,
    graph_panels,
    kept_call,
    kept_copy,
    kernel,
    linear_panels,
    lora_add,
    panels_shape,
)
from moerl.cpu.norms import eager_decode
from moerl.model.linear import Linear
from moerl.model.lora import LinearLora, LoraLinear


class KernelLinear(Linear):
    """``Linear`` whose bf16 rows without autograd run as one call from packed panels of its weight where the CPU has
    bf16 dot products (``has_panels``, ``lay_out``): ``bf16_linear`` eager, ``bf16_linear_op`` on the panels made
    before a compiled decode step (``refresh_panels``); else the plain projection's."""

    stands_for = Linear
    has_panels = False

    def lay_out(self) -> None:
        """Whether this layer runs on the bf16 dot products: a bf16 weight, on a CPU that has them."""
        self.has_panels = bf16_linear_packs(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_eager(x):
            return bf16_linear(x, linear_panels(self, self.weight), self.bias)
        if self.has_panels and x.dtype == torch.bfloat16 and torch.compiler.is_compiling():
            panels = graph_panels(self, "weight") if not torch.is_grad_enabled() else None
            if panels is not None:
                return bf16_linear_op(x, panels, self.bias)
        return super().forward(x)

    def _bf16_eager(self, x: torch.Tensor) -> bool:
        """Whether rows ``x`` run eager on the bf16 dot products: panels, bf16 rows, no autograd, not too many."""
        if not self.has_panels or x.dtype != torch.bfloat16 or not eager_decode():
            return False
        return x.numel() <= BF16_LINEAR_MAX_ROWS * self.in_features

    def bf16_part(self, x: torch.Tensor) -> tuple[bool, LinearLora | None]:
        """(whether rows ``x`` run eager on the bf16 dot products, the adapter slots whose delta joins the call: None
        here), what ``fused_projections`` asks of each layer it runs together."""
        return self._bf16_eager(x), None

    def refresh_panels(self) -> None:
        """Make (or pack again after a sync) the panels a compiled graph reads, outside it."""
        if self.has_panels:
            linear_panels(self, self.weight)

    def bound_refusal(self, dtype: torch.dtype) -> str | None:
        """What of this projection a bound decode step of a ``dtype`` model cannot run."""
        if self.bias is not None or self.has_panels != (dtype == torch.bfloat16):
            return "a projection with a bias, or a bf16 one not on the bf16 dot products"
        return None

    def bind(self, step: Binding, rows: torch.Tensor, out: torch.Tensor) -> None:
        """The call of this projection of ``rows`` (a buffer of at least the step's rows) into ``out``: on the bf16 dot
        products (adapters joined), else torch's GEMM (fp32, as the module's ``F.linear``)."""
        if not self.has_panels:
            step.call(partial(torch.mm, out=out), (rows[: step.rows], self.weight.t()))
            return
        panels, adapters, xa = self._bound_panels(step)
        step.call(kernel().moerl_bf16_linear, bf16_linear_args(rows, step.rows, panels, out, adapters, xa))

    def _bound_panels(self, step: Binding) -> tuple:
        """(the weight's panels, the adapters' checked kernel struct, its shrink's buffer) a bound call takes."""
        return linear_panels(self, self.weight), None, None


class KernelLoraLinear(LoraLinear, KernelLinear):
    """``LoraLinear`` whose active slots' delta runs without autograd or dropout in the base layer's call on the bf16
    dot products (``bf16_linear`` with its LoRA list), or else as one call after it (``lora_add``); the plain
    adapter's GEMMs with autograd or inside a compiled graph."""

    stands_for = LoraLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora
        if lora.ctx.active and self._one_call():
            if self._bf16_eager(x):  # the base GEMM and the delta in one call
                return bf16_linear(x, *self._bf16_args(lora.ctx.row_slots(x.numel() // x.shape[-1])))
            slots = lora.ctx.single if lora.ctx.token_slots is None else lora.ctx.token_slots
            base = KernelLinear.forward(self, x)
            return lora_add(x, base, slots, *decode_factors(lora))  # three ops of a few rows -> one
        return super().forward(x)

    def _one_call(self) -> bool:
        """Whether the active slots' delta runs in a kernel call: no autograd, no dropout, not compiling."""
        lora = self.lora
        return eager_decode() and not (lora.training and isinstance(lora.dropout, nn.Dropout))

    def bf16_part(self, x: torch.Tensor) -> tuple[bool, LinearLora | None]:
        if not self.lora.ctx.active:
            return super().bf16_part(x)
        return self._one_call() and self._bf16_eager(x), self.lora

    def _bf16_args(self, slots: torch.Tensor) -> tuple:
        """``bf16_linear``'s arguments after the rows: the weight's panels, the bias, the LoRA list and its checked
        kernel struct, kept while the slots and the weight and factors stay (``kept_call``)."""
        lora = self.lora
        sources = (self.weight, lora.lora_A, lora.lora_B, lora.scale)
        panels, args, struct = kept_call(self, "_bf16_memo", slots, sources, lambda: self.bf16_lora_args(slots))
        return panels, self.bias, args, struct

    def bf16_lora_args(self, slots: torch.Tensor) -> tuple:
        """(the weight's panels, the LoRA list for rows of ``slots`` [N] int64, its checked struct), made now."""
        args = [slots, *bf16_factors(self.lora)]
        panels = linear_panels(self, self.weight)
        return panels, args, bf16_lora(args, panels)

    def bound_refusal(self, dtype: torch.dtype) -> str | None:
        why = super().bound_refusal(dtype)
        if why is None and dtype != torch.bfloat16:  # fp32: the delta is lora_add's call, not joined to the GEMM
            return "adapters on projections off the bf16 dot products"
        return why

    def _bound_panels(self, step: Binding) -> tuple:
        if step.adapters is None:
            return super()._bound_panels(step)
        panels, *made = self.bf16_lora_args(step.adapters)
        step.keep.append(made)
        return panels, made[1], step.buf("xa", step.rows, made[1].r)


def fused_projections(owner: nn.Module, layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[m(x) for m in layers]`` as one bf16 dot-product call from their panels side by side (``fused_linear``; each
    column's sums as its own layer's call gives them), adapters included (``fused_bf16``), or None where one of them
    is not the backend's, does not run on the bf16 dot products here, or only some carry adapters. An engine's decode
    runs attention's q / k / v this way: three calls of a step's few rows cost more in their set-up than in their
    products."""
    parts = [m.bf16_part(x) if isinstance(m, KernelLinear) else (False, None) for m in layers]
    adapters = [a for _, a in parts]
    if not all(ok for ok, _ in parts) or (any(a is None for a in adapters) and any(a is not None for a in adapters)):
        return None
    panels, bias = fused_linear(owner, layers)
    lora = () if adapters[0] is None else fused_bf16(owner, adapters, panels, x.numel() // x.shape[-1])
    if lora is None:
        return None
    return list(bf16_linear(x, panels, bias, *lora).split([m.out_features for m in layers], dim=-1))


def bf16_factors(lora: LinearLora) -> list[torch.Tensor]:
    """[scale [S], A [S, r, in], B^T's panels [S, out / NT, r, NT]] of adapter slots ``lora`` in fp32, as
    ``bf16_linear`` takes them, kept beside the adapter while it is unchanged."""
    f32, (s, out, r) = torch.float32, lora.lora_B.shape
    return [
        kept_copy(lora, "scale", lora.scale, dtype=f32),
        kept_copy(lora, "A", lora.lora_A, dtype=f32),
        kept_copy(lora, "B panels", lora.lora_B, _b_panels_view, f32, panels_shape(s, r, out)),
    ]


def fused_bf16(owner: nn.Module, loras: list[LinearLora], panels: torch.Tensor, rows: int) -> tuple | None:
    """``bf16_linear``'s LoRA arguments (list, struct) for layers of one input run as one call
    (``fused_projections``): their A stacked along the rank [S, n r, in] (one shrink of every layer's ranks), their
    B^T panels side by side, each panel's delta from its own layer's r shrinks (``bf16_lora``'s ``tile_r0``: the same
    r terms in the same order as its own call), kept on ``owner`` while the slots and factors stay. None where their
    scales differ (one scale a slot in the kernel) or another context or rank."""
    slots = loras[0].ctx.row_slots(rows)
    sources = tuple(t for m in loras for t in (m.lora_A, m.lora_B, m.scale))
    made = kept_call(owner, "_fused_bf16_memo", slots, sources, lambda: fused_bf16_args(owner, loras, panels, slots))
    return made[:2] if made is not None else None  # the struct points into tile_r0: kept with it


def fused_bf16_args(owner: nn.Module, loras: list[LinearLora], panels: torch.Tensor, slots: torch.Tensor):
    """``fused_bf16``'s (list, struct, tile_r0) for rows of ``slots`` [N] int64, made now (None where the scales
    differ, or another context or rank); the struct points into the list and tile_r0."""
    first_lora = loras[0]
    if not all(m.ctx is first_lora.ctx and m.lora_A.shape[:2] == first_lora.lora_A.shape[:2] for m in loras):
        return None
    if not all(torch.equal(m.scale, first_lora.scale) for m in loras[1:]):
        return None
    f32, r, nt = torch.float32, first_lora.lora_A.shape[1], panels.shape[3]
    a = kept_copy(owner, "fused A", tuple(m.lora_A for m in loras), lambda t: torch.cat(t, dim=1), f32)
    bs = tuple(m.lora_B for m in loras)
    b = kept_copy(owner, "fused B panels", bs, lambda t: torch.cat([_b_panels_view(x) for x in t], 1), f32)
    first = [i * r for i, m in enumerate(loras) for _ in range(m.lora_B.shape[1] // nt)]
    tile_r0 = torch.tensor(first, dtype=torch.int32)
    args = [slots, kept_copy(owner, "fused scale", first_lora.scale, dtype=f32), a, b]
    return args, bf16_lora(args, panels, tile_r0), tile_r0


def decode_factors(lora: LinearLora) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A [S, r, in], B^T [S, r, out], scale [S]) of adapter slots ``lora`` in fp32 as ``lora_add`` takes them, kept
    beside the adapter while it is unchanged (an adapter load writes its slots in place)."""
    f32 = torch.float32
    return (
        kept_copy(lora, "A", lora.lora_A, dtype=f32),
        kept_copy(lora, "B^T", lora.lora_B, lambda b: b.transpose(1, 2), f32),
        kept_copy(lora, "scale", lora.scale, dtype=f32),
    )


def _b_panels_view(b: torch.Tensor) -> torch.Tensor:
    return _panel_view(b.float().transpose(1, 2), False)  # B [S, out, r] -> B^T [S, r, out]'s fp32 panels
