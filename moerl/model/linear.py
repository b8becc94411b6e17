"""The model's projections: the linear layers a training mode may swap for its own (``moerl.model.lora``'s
``LoraLinear``, ``moerl.model.mx``'s ``MXLinear``). The head and the small gates are plain ``nn.Linear``: no mode
touches them."""

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.packed import (
    BF16_LINEAR_MAX_ROWS,
    bf16_linear,
    bf16_linear_op,
    fused_linear,
    graph_panels,
    linear_panels,
)


class Linear(nn.Linear):
    """A projection of attention or of an MLP (``nn.Linear``; the class marks what modes may swap). ``packed``: an
    engine's own model on a CPU with bf16 dot products (``MoEModel.decode_layout``) runs its bf16 rows without autograd
    as one kernel call from packed panels of the weight (``moerl.model.packed.bf16_linear``; in a compiled decode step
    as one op on the panels made before it, ``refresh_packed``), where oneDNN's GEMM of a decode step's few rows is
    mostly set-up."""

    packed = False
    takes_packed = True  # False: a mode whose GEMMs are its own (MXFP8) never runs the packed kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_eager(x):
            return bf16_linear(x, linear_panels(self, self.weight), self.bias)
        if self.packed and x.dtype == torch.bfloat16 and not torch.is_grad_enabled() and torch.compiler.is_compiling():
            panels = graph_panels(self, "weight")
            if panels is not None:
                return bf16_linear_op(x, panels, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _bf16_eager(self, x: torch.Tensor) -> bool:
        """Whether these rows run eager on the bf16 dot products: a packed layer, bf16 rows, no autograd, not too many
        rows."""
        if not self.packed or x.dtype != torch.bfloat16 or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        return x.numel() <= BF16_LINEAR_MAX_ROWS * self.in_features

    def bf16_part(self, x: torch.Tensor) -> tuple[bool, nn.Module | None]:
        """(whether rows ``x`` run eager on the bf16 dot products, the adapter slots whose delta joins the call: None
        here), what ``fused_projections`` asks of each layer it runs together."""
        return self._bf16_eager(x), None

    def refresh_packed(self) -> None:
        """Make (or pack again after a sync) the panels a compiled graph reads, outside it."""
        if self.packed and self.takes_packed:  # a module swapped in later (MXFP8) keeps the flag, not the path
            linear_panels(self, self.weight)


def fused_projections(owner: nn.Module, layers: tuple[Linear, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[m(x) for m in layers]`` as one bf16 dot-product call from their panels side by side (``fused_linear``; each
    column's sums as its own layer's call gives them), adapters included (each layer's slots,
    ``LinearLora.fused_bf16``), or None where one of them does not run on the bf16 dot products here or only some carry
    adapters. An engine's decode runs attention's q / k / v this way: three calls of a step's few rows cost more in
    their set-up than in their products."""
    parts = [m.bf16_part(x) for m in layers]
    adapters = [a for _, a in parts]
    if not all(ok for ok, _ in parts) or (any(a is None for a in adapters) and any(a is not None for a in adapters)):
        return None
    panels, bias = fused_linear(owner, layers)
    lora = () if adapters[0] is None else adapters[0].fused_bf16(owner, adapters, panels, x.numel() // x.shape[-1])
    if lora is None:
        return None
    return list(bf16_linear(x, panels, bias, *lora).split([m.out_features for m in layers], dim=-1))
