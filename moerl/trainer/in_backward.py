"""The optimizer step inside the backward (``policy.optimizer_in_backward``): AdamW steps each trained tensor as soon
as its gradient is whole, and that gradient is freed at once, so that a step never holds the whole model's gradients.

Once a full fine-tune's blocks are recomputed in the backward, its fp32 gradients are the largest share of a step's
peak (they all live at the backward's end); stepped as they come, one or two are alive at a time. The price is what
needs every gradient before any tensor steps: clipping by the global norm (refused with it), accumulation over
micro-batches (a step of more than one is refused), and skipping a whole step on a non-finite gradient: the running
sum of squares turns non-finite at the first such gradient, and from there on the fused AdamW kernel skips each
tensor (its ``found_inf``), while the tensors stepped before it keep their step.

A tensor's gradient is whole when autograd has accumulated every use of it (``register_post_accumulate_grad_hook``);
by then no node of this backward reads it again (a block recomputed in the backward reads its weights before their
gradients exist), so stepping it in place changes nothing the backward still computes.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import partial

import torch


class StepInBackward:
    """Hooks on ``policy``'s trainable parameters that step its optimizer tensor by tensor while ``armed``; outside
    it they do nothing (a backward of the caller's own accumulates gradients as usual)."""

    def __init__(self, policy):
        self.policy = policy
        self.active = False
        self.squares: dict[torch.device, torch.Tensor] = {}  # the running sum of squared gradients, by device
        for name, p in policy.trainable.items():  # for the policy's life: disarmed, they return at once
            p.register_post_accumulate_grad_hook(partial(self._step, name))

    @contextmanager
    def armed(self):
        """Step each tensor as its gradient arrives during this block's backwards."""
        self.squares, self.active = {}, True
        try:
            yield
        finally:
            self.active = False

    def grad_norm(self) -> float:
        """The L2 norm of the gradients stepped in the last armed block (non-finite if one was)."""
        return math.sqrt(sum(float(s) for s in self.squares.values()))

    @torch.no_grad()
    def _step(self, name: str, param: torch.Tensor) -> None:
        if not self.active:
            return
        policy = self.policy
        if policy.master is not None:  # the master's gradient in fp32, freed after its step as the parameter's is
            policy.master.grad_to_master(name, kept=False)
        tensor = policy.trained[name]
        if tensor.grad is None:
            return
        square = torch.linalg.vector_norm(tensor.grad, dtype=torch.float32).square()
        device = tensor.grad.device
        total = self.squares[device] = self.squares[device] + square if device in self.squares else square
        optimizer = policy.optimizer
        group = optimizer.param_groups[0]
        every = group["params"]
        # the fused kernel skips the tensor (its step count too) where found_inf is 1: no host sync per tensor
        optimizer.found_inf = (~torch.isfinite(total)).float()
        group["params"] = [tensor]  # the step's loop visits this tensor only, not every other's missing gradient
        try:
            optimizer.step()
        finally:
            group["params"] = every
            del optimizer.found_inf
        tensor.grad = None
        if policy.master is not None:
            policy.master.master_to_model([name])
