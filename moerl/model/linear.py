"""The model's projections: the linear layers a training mode may swap for its own (``moerl.model.lora``'s
``LoraLinear``, ``moerl.model.mx``'s ``MXLinear``). The head and the small gates are plain ``nn.Linear``: no mode
touches them."""

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.packed import AMX_LINEAR_MAX_ROWS, amx_linear, linear_panels


class Linear(nn.Linear):
    """A projection of attention or of an MLP (``nn.Linear``; the class marks what modes may swap). ``packed``: an
    engine's own model on a CPU with AMX (``MoEModel.decode_layout``) runs its bf16 rows without autograd as one
    kernel call from packed panels of the weight (``moerl.model.packed.amx_linear``), where oneDNN's GEMM of a
    decode step's few rows is mostly set-up."""

    packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed and self._packs(x):
            return amx_linear(x, linear_panels(self, self.weight), self.bias)
        return F.linear(x, self.weight, self.bias)

    def _packs(self, x: torch.Tensor) -> bool:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dtype != torch.bfloat16:
            return False
        return x.numel() <= AMX_LINEAR_MAX_ROWS * self.in_features
