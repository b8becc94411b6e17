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

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moerl.parallel.world import World


def shard_model(
    model: torch.nn.Module,
    compute_dtype: torch.dtype,
    masters: bool,
    mesh: DeviceMesh | None = None,
    keep=frozenset(),
    root: torch.nn.Module | None = None,
    offload: bool = False,
) -> None:
    """Shard ``model`` in place over ``mesh`` (default: every rank): one FSDP unit per block, the routers, the root
    (``root``: a module that runs ``model``, e.g. a pipeline stage). ``masters``: the parameters are fp32 masters,
    gathered in ``compute_dtype`` (the routers in fp32, units of their own); else they are sharded as they are.
    Parameters in ``keep`` (expert-parallel slices) stay this rank's plain tensors. ``offload``: the shards and their
    gradients live in host memory (FSDP2's ``CPUOffloadPolicy``; the optimizer steps them there), gathered onto the
    device for each unit's forward and backward."""
    root = root if root is not None else model
    where = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    frozen = {p for p in model.parameters() if not p.requires_grad} | set(keep)
    if masters:  # the parameters are the fp32 masters: gathered in the compute dtype
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    else:  # what trains (adapters) is sharded as it is
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.layers:
        if next(block.parameters(), None) is None:  # another pipeline stage's layer
            continue
        router = getattr(getattr(block, "mlp", None), "router", None)
        if router is not None and masters:
            fully_shard(router, mesh=mesh, mp_policy=fp32, **where)
        ignored = (frozen & set(block.parameters())) or None
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored, **where)
    fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=frozen or None, **where)
    for unit in fsdp_units(root):
        unit.set_gradient_divide_factor(1.0)  # a sum (the losses are normalised globally)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no pre-multiplied sum


def fsdp_units(*roots: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP units in ``roots`` (e.g. a model, or its pipeline stages), each once."""
    units = {id(m): m for root in roots for m in root.modules() if isinstance(m, FSDPModule)}
    return list(units.values())


@contextmanager
def gathered(*roots: torch.nn.Module):
    """Every FSDP unit's parameters of ``roots`` whole (in their compute dtype) inside the block, e.g. to export
    adapters; a collective: every rank enters it together."""
    units = fsdp_units(*roots)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


@torch.no_grad()
def clip_grads(
    world: World, params: list[torch.Tensor], max_norm: float, expert_slices: set[int], copies: set[int] = frozenset()
) -> float:
    """Clip the gradients of ``params`` to a global L2 norm of ``max_norm`` over every rank; returns the norm before.

    FSDP shards are disjoint parts of a whole; expert slices (ids in ``expert_slices``) are disjoint across the ep
    group and replicated across dp and cp; other plain tensors are replicated across the data group and cp;
    ``copies`` (a tied embedding's copy on the last pipeline stage) are counted where the original is. Each part
    counts once.
    """
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)  # where the gradients are: one backend's collective
    for p in params:
        if p.grad is None or id(p) in copies:
            continue
        if isinstance(p.grad, DTensor):
            g = p.grad.to_local()
        elif world.dp_rank == 0 and world.cp_rank == 0 and (id(p) in expert_slices or world.data_rank == 0):
            g = p.grad
        else:
            continue
        total += g.double().square().sum()
    dist.all_reduce(total)
    norm = math.sqrt(float(total))
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
