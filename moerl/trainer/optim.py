"""AdamW over fp32 parameters and the learning-rate schedule (constant, or linear warm-up then cosine)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from moerl.device import on_gpu

SCHEDULES = ("constant", "cosine")


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """Multiplier of the base learning rate at a step (the values as ``OptimConfig`` checked them)."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def adamw(params: list[torch.nn.Parameter], o) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``policy.optim`` ``o``'s hyperparameters: the fused kernel (one pass per tensor;
    ~8x the per-op loop on a CPU) where every parameter is a plain tensor; FSDP's DTensors keep the default path."""
    fused = {"fused": True} if not any(isinstance(p, DTensor) for p in params) else {}
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **fused)


def lr_schedule(optimizer: torch.optim.Optimizer, o, at: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``policy.optim`` ``o``'s learning-rate schedule over ``optimizer``, at its step ``at`` (the rates set)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = o.lr
    fn = lr_lambda(o.schedule, o.warmup_steps, o.total_steps, o.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn, last_epoch=at - 1)


class MasterWeights:
    """fp32 master copies of a low-precision model's parameters: the optimizer steps the masters, the model gets
    them back rounded. fp32 parameters (the router) are their own masters.

    ``host`` (``policy.cpu_offload``): every master of a parameter held on a GPU is a copy in host memory (pinned,
    so that the copies back to the GPU do not wait), its gradient is copied there and the optimizer steps it there;
    a parameter already in host memory (FSDP's offloaded shards, or a CPU policy's) keeps the rule above."""

    def __init__(
        self, params: dict[str, torch.nn.Parameter], initial: dict[str, torch.Tensor] | None = None, host: bool = False
    ):
        """``initial``: fp32 starting values of some masters (default: the parameter's own, upcast)."""
        self.model_params = params
        self.master = {}
        initial = initial or {}
        for name, p in params.items():
            away = host and _on_device(p)
            if p.dtype == torch.float32 and not away:
                self.master[name] = p
            else:
                value = initial.get(name, p.detach())
                self.master[name] = torch.nn.Parameter(_host(value) if away else value.float().clone())

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.master.values())

    def grads_to_master(self) -> None:
        for name in self.model_params:
            self.grad_to_master(name)

    def grad_to_master(self, name: str, kept: bool = True) -> None:
        """Parameter ``name``'s gradient onto its master, in fp32 (the parameter's dropped). ``kept``: on a CPU, into
        a buffer kept across steps (see ``_fp32_grad``); False when gradients must not outlive their step."""
        p, m = self.model_params[name], self.master[name]
        if m is not p:
            m.grad = None if p.grad is None else self._fp32_grad(name, p.grad, m, kept)
            p.grad = None

    def _fp32_grad(self, name: str, grad: torch.Tensor, master: torch.Tensor, kept: bool = True) -> torch.Tensor:
        """``grad`` in fp32. On a CPU into a buffer kept across steps (laid out as its master): a fresh one of an
        expert weight's size comes from the kernel page by page (10 ms for small's [16, 512, 512] inside a step,
        0.5 ms copied into a kept one); CUDA's caching allocator keeps its blocks anyway, and a kept buffer would
        hold memory through the next forward."""
        if master.device != grad.device:  # into host memory: fp32 on the way
            return grad.to(master.device, torch.float32)
        if not kept or on_gpu(grad) or type(grad) is not torch.Tensor or grad.shape != master.shape:
            return grad.float()  # on a GPU, or sharded (a DTensor)
        kept = self.__dict__.setdefault("_grads", {})
        if name not in kept:
            kept[name] = torch.empty_like(master, dtype=torch.float32)
        return kept[name].copy_(grad)

    @torch.no_grad()
    def master_to_model(self, names=None) -> None:
        """The masters' values (of ``names``, default all) into the model's parameters, rounded."""
        for name in self.model_params if names is None else names:
            p, m = self.model_params[name], self.master[name]
            if m is not p:
                p.copy_(m, non_blocking=m.is_pinned())  # from pinned host memory: queued, not waited for


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is on an accelerator (a DTensor's: its local shard's)."""
    return (t.to_local() if isinstance(t, DTensor) else t).device.type != "cpu"


def _host(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of ``t`` in host memory, pinned where CUDA can pin it."""
    out = torch.empty(t.shape, dtype=torch.float32, pin_memory=torch.cuda.is_available())
    return out.copy_(t)
