"""Data parallel over rows: each rank of the data group (dp x ep) takes a contiguous share of a batch's rows and runs
as many micro-batches as every other rank (FSDP gathers the weights and expert parallelism exchanges tokens in each
forward, so the ranks' forwards must pair up). A batch is anything with ``len``, ``rows`` and ``input_ids``, as
``moerl.trainer.Batch`` (which this package does not import)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moerl.parallel.world import World


def share(world: World, rank: int, n: int) -> slice:
    """Data rank ``rank``'s rows of a batch of ``n`` (``tensor_split``'s shares: the first ``n % size`` get one
    more)."""
    base, extra = divmod(n, world.data_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def micro_batches(world: World, batch, size: int) -> list[tuple[object, bool]]:
    """This rank's micro-batches of ``batch`` (at most ``size`` rows each), each flagged real. With several ranks
    every rank runs as many as the largest share needs; a rank short of rows runs a stand-in row (the batch's
    first) whose result the caller drops."""
    if world.data_size == 1:
        return [(mb, True) for mb in batch.split(size)]
    rows = share(world, world.data_rank, len(batch))
    count = max(1, math.ceil(math.ceil(len(batch) / world.data_size) / size))
    out = []
    for chunk in torch.arange(rows.start, rows.stop).tensor_split(count):
        real = len(chunk) > 0
        start, stop = (int(chunk[0]), int(chunk[-1]) + 1) if real else (0, 1)
        out.append((batch.rows(slice(start, stop)), real))
    return out


def gather_rows(world: World, parts: list[torch.Tensor], batch) -> torch.Tensor:
    """Per-row results [rows, T] of every rank's share, in row order, on every rank."""
    mine = torch.cat(parts) if parts else torch.zeros(0, batch.input_ids.shape[1], device=batch.input_ids.device)
    if world.data_size == 1:
        return mine
    n = len(batch)
    width = math.ceil(n / world.data_size)
    padded = torch.cat([mine, mine.new_zeros(width - len(mine), *mine.shape[1:])])
    pieces = [torch.empty_like(padded) for _ in range(world.data_size)]
    dist.all_gather(pieces, padded, group=world.group("data"))
    counts = [len(range(n)[share(world, r, n)]) for r in range(world.data_size)]
    return torch.cat([p[:c] for p, c in zip(pieces, counts, strict=True)])


def sum_over_ranks(world: World, total: float, metrics: dict[str, float]) -> tuple[float, dict[str, float]]:
    """A step's loss and metric sums, each rank holding its rows' share, added up on every rank."""
    if world.data_size == 1:
        return total, metrics
    keys = sorted(metrics)
    sums = torch.tensor([total, *(metrics[k] for k in keys)], dtype=torch.float64)
    dist.all_reduce(sums, group=world.group("data"))
    return float(sums[0]), dict(zip(keys, sums[1:].tolist(), strict=True))
