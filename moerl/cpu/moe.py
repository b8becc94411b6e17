"""The MoE's router as one C call in an engine's decode: a softmax top-k over the fp32 router, replayed rows too."""

from __future__ import annotations

import torch

from moerl.cpu.norms import eager_decode
from moerl.model.moe import Router
from moerl.model.packed import KINDS, router_topk


class KernelRouter(Router):
    """``Router`` whose forward without autograd is one kernel call (``router_topk``) where its rule is a softmax
    top-k (``softmax_top_k``), the rows on the CPU in a kernel dtype; else the plain router's."""

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if eager_decode() and self.softmax_top_k and x.device.type == "cpu" and x.dtype in KINDS:
            return router_topk(x, self.weight, self.bias, self.top_k, self.norm_topk_prob, self.scale, replay)
        return super().forward(x, replay)
