"""FSDP2 data parallel for the trainer: ``fully_shard`` per decoder block and the root, applied from outside.

- full / mxfp8: the model's parameters are the fp32 masters, sharded across the ranks; FSDP gathers them in the
  compute dtype (bf16) for forward and backward and reduces the gradients in fp32 — the single-process recipe (bf16
  model, fp32 masters and optimizer state) without the second copy. Each router is its own FSDP unit, gathered in
  fp32. MXFP8 layers quantize the gathered weights with the same quantizer as in one process.
- lora: only what trains is sharded (the adapters, fp32); the frozen base is replicated on every rank.

Gradients are summed across ranks, not averaged: the losses are already normalised by the global batch's token and
sequence counts, so the loss and the gradient are the same numbers whatever the dp size.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype, mode: str) -> None:
    """Shard ``model`` in place over the default process group (one FSDP unit per block, the routers, the root)."""
    frozen = {p for p in model.parameters() if not p.requires_grad}
    if mode == "lora":
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.layers:
        router = getattr(block.mlp, "router", None)
        if router is not None and mode != "lora":
            fully_shard(router, mp_policy=fp32)
        fully_shard(block, mp_policy=mp, ignored_params=(frozen & set(block.parameters())) or None)
    fully_shard(model, mp_policy=mp, ignored_params=frozen or None)
    for unit in fsdp_units(model):
        unit.set_gradient_divide_factor(1.0)  # a sum (the losses are normalised globally)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no pre-multiplied sum


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: torch.nn.Module):
    """Every FSDP unit's parameters whole (in their compute dtype) inside the block, e.g. to export adapters; a
    collective: every rank enters it together."""
    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
