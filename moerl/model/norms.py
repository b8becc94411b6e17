"""The decoder's norms: RMSNorm (a fused kernel) and the layer / final norm a config asks for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.fused import RmsNormFn, fuses
from moerl.model.packed import KINDS, add_rms_norm, rms_norm


def layer_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The norm of the decoder layers and the final norm: RMSNorm, or LayerNorm with a bias (``cfg.norm``)."""
    return RMSNorm(dim, cfg.rms_norm_eps) if cfg.norm == "rms" else nn.LayerNorm(dim, eps=cfg.rms_norm_eps)


class RMSNorm(nn.Module):
    """RMSNorm (fused kernel: statistics in fp32, one rounding to the input dtype after the weight). ``one_call``: an
    engine's own CPU model (``MoEModel.decode_layout``) runs it without autograd as one C call
    (``moerl.model.packed.rms_norm``), where torch's CPU composite takes eight ops; CPU training runs its backward as
    one (``moerl.model.fused``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.one_call = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._one_call():
            return rms_norm(x, self.weight, self.eps)
        if fuses(x, self.weight):
            return RmsNormFn.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def _one_call(self) -> bool:
        return self.one_call and not torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def takes_residual(self, x: torch.Tensor, a: torch.Tensor) -> bool:
        """Whether ``with_residual`` runs the residual add ``x + a`` and this norm as one kernel call (an engine's
        own CPU model, rows of one shape and dtype)."""
        return self._one_call() and x.shape == a.shape and x.dtype == a.dtype in KINDS and x.device.type == "cpu"

    def with_residual(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, this norm of it), bit for bit the add and ``forward``, in one call (``add_rms_norm``)."""
        return add_rms_norm(x, a, self.weight, self.eps)
