"""The decoder's norms: RMSNorm (a fused kernel) and the layer / final norm a config asks for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig


def layer_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The norm of the decoder layers and the final norm: RMSNorm, or LayerNorm with a bias (``cfg.norm``)."""
    return RMSNorm(dim, cfg.rms_norm_eps) if cfg.norm == "rms" else nn.LayerNorm(dim, eps=cfg.rms_norm_eps)


class RMSNorm(nn.Module):
    """RMSNorm (fused kernel: statistics in fp32, one rounding to the input dtype after the weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
