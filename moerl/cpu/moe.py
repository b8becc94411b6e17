"""The MoE's router as one C call in an engine's decode: a softmax top-k over the fp32 router, replayed rows too."""

from __future__ import annotations

import torch

from moerl.cpu.binding import Binding
from moerl.cpu.kernels import KINDS, kernel, router_args, router_topk, router_work
from moerl.cpu.norms import eager_decode
from moerl.model.moe import Router


class KernelRouter(Router):
    """``Router`` whose forward without autograd is one kernel call (``router_topk``) where its rule is a softmax
    top-k (``softmax_top_k``), the rows on the CPU in a kernel dtype; else the plain router's."""

    stands_for = Router

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if eager_decode() and self.softmax_top_k and x.device.type == "cpu" and x.dtype in KINDS:
            return router_topk(x, self.weight, self.bias, self.top_k, self.norm_topk_prob, self.scale, replay)
        return super().forward(x, replay)

    def bound_refusal(self, dtype: torch.dtype) -> str | None:
        """What of this router a bound decode step cannot run: a rule other than a softmax top-k."""
        return None if self.softmax_top_k else "a router other than a softmax top-k (its correction bias, groups, ...)"

    def bind(self, step: Binding, h: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor) -> None:
        """The call of this router on rows ``h``: each row's experts into ``idx``, their weights into ``gate``."""
        work = step.buf("router", router_work(self.num_experts))
        args = router_args(h, self.weight, self.bias, self.norm_topk_prob, self.scale, gate, idx, work)
        step.call(kernel().moerl_router_topk, args)
