"""AdamW over fp32 parameters and the learning-rate schedule (constant, or linear warm-up then cosine)."""

from __future__ import annotations

import math

import torch

from moerl.errors import ConfigError

SCHEDULES = ("constant", "cosine")


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Multiplier of the base learning rate at a step."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={schedule!r}: allowed: {', '.join(SCHEDULES)}")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class MasterWeights:
    """fp32 master copies of a low-precision model's parameters: the optimizer steps the masters, the model gets
    them back rounded. fp32 parameters (the router) are their own masters."""

    def __init__(self, params: dict[str, torch.nn.Parameter], initial: dict[str, torch.Tensor] | None = None):
        """``initial``: fp32 starting values of some masters (default: the parameter's own, upcast)."""
        self.model_params = params
        self.master = {}
        initial = initial or {}
        for name, p in params.items():
            if p.dtype == torch.float32:
                self.master[name] = p
            else:
                self.master[name] = torch.nn.Parameter(initial.get(name, p.detach()).float().clone())

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.master.values())

    def grads_to_master(self) -> None:
        for name, p in self.model_params.items():
            m = self.master[name]
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for name, p in self.model_params.items():
            m = self.master[name]
            if m is not p:
                p.copy_(m)
