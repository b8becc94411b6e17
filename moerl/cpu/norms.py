"""RMSNorm as one C call in an engine's decode, where torch's CPU composite takes eight ops, and the residual add
before a pre-norm in the same call."""

from __future__ import annotations

import torch

from moerl.cpu.binding import Binding
from moerl.cpu.kernels import KINDS, add_rms_norm, add_rms_norm_args, kernel, rms_norm, rms_norm_args
from moerl.model.norms import RMSNorm


def eager_decode() -> bool:
    """Whether a call runs outside autograd and outside a compiled graph: where the kernels apply."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class KernelRMSNorm(RMSNorm):
    """``RMSNorm`` whose forward without autograd is one kernel call (``rms_norm``: statistics in fp32, one rounding
    after the weight, as the plain module) and whose ``add_and_norm`` is one more (``add_rms_norm``, bit for bit the
    add and the norm)."""

    stands_for = RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if eager_decode() and x.device.type == "cpu":
            return rms_norm(x, self.weight, self.eps)
        return super().forward(x)

    def add_and_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if eager_decode() and x.shape == a.shape and x.dtype == a.dtype in KINDS and x.device.type == "cpu":
            return add_rms_norm(x, a, self.weight, self.eps)
        return super().add_and_norm(x, a)

    def bound_refusal(self, dtype: torch.dtype) -> str | None:
        """What of this norm a bound decode step of a ``dtype`` model cannot run: nothing."""
        return None

    def bind(self, step: Binding, x: torch.Tensor, out: torch.Tensor) -> None:
        """The call of this norm of rows ``x`` into ``out``."""
        step.call(kernel().moerl_rms_norm, rms_norm_args(x, self.weight, out, self.eps))

    def bind_add(self, step: Binding, x: torch.Tensor, a: torch.Tensor, total: torch.Tensor, out: torch.Tensor) -> None:
        """The call of ``total = x + a`` and this norm of it into ``out`` (``add_and_norm``)."""
        step.call(kernel().moerl_add_rms_norm, add_rms_norm_args(x, a, self.weight, self.eps, total, out))
