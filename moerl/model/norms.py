"""The decoder's norms: RMSNorm (a fused kernel) and the layer / final norm a config asks for."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig


def layer_norm(cfg: ModelConfig, dim: int, eps: float | None = None) -> nn.Module:
    """The norm of the decoder layers and the final norm (``cfg.norm``): RMSNorm, or LayerNorm with a bias or
    without; ``eps``: its own epsilon (default ``cfg.rms_norm_eps``)."""
    eps = cfg.rms_norm_eps if eps is None else eps
    if cfg.norm == "rms":
        return RMSNorm(dim, eps)
    return nn.LayerNorm(dim, eps=eps, bias=cfg.norm == "layer")


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` scaled to unit root-mean-square over its last dim, in fp32, without a weight (Llama 4's q / k L2Norm,
    Gemma 4's value norm and router input norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (torch's fused op: statistics in fp32, one rounding to the input dtype after the weight). The CPU
    backend swaps in its own: one C call in an engine's decode (``moerl.cpu.norms``), the backward as one in
    training (``moerl.cpu.training``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, this norm of it): a decoder layer's residual add and the pre-norm after it, the two steps a
        backend's module may take as one."""
        x = x + a
        return x, self(x)
