"""Data parallel over rows: each rank of the data group (dp x ep) takes a contiguous share of a batch's rows and runs
as many micro-batches as every other rank (FSDP gathers the weights and expert parallelism exchanges tokens in each
forward, so the ranks' forwards must pair up). A batch is anything with ``len``, ``rows`` and ``input_ids``, as
``moerl.trainer.Batch`` (which this package does not import)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.errors import ConfigError
from moerl.parallel.world import World


def share(world: World, rank: int, n: int) -> slice:
    """Data rank ``rank``'s rows of a batch of ``n`` (``tensor_split``'s shares: the first ``n % size`` get one
    more)."""
    base, extra = divmod(n, world.data_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


@dataclass(slots=True)
class Split:
    """How a batch's rows go through a step: every data rank's contiguous share (``shares``) and this rank's
    micro-batches, each flagged real (a stand-in only keeps the ranks' collectives in step: its result is dropped)."""

    shares: list[slice]
    micro: list[tuple[object, bool]]


def split_rows(world: World, batch, size: int, max_tokens: int = 0, packed: bool = True) -> Split:
    """``batch``'s rows in micro-batches of at most ``size`` rows (0: any number) and, with ``max_tokens``, at most
    that many tokens: a packed micro-batch holds its rows' tokens, an unpacked one rows x the batch's width. With a
    token budget the data ranks' shares are balanced by tokens, and each share is cut where the next row would pass
    a limit. Every rank runs as many micro-batches as the rank that needs the most; the others add stand-ins (the
    batch's first row). The budget is a rank's: with context parallelism (cp ranks share a micro-batch's tokens) a
    micro-batch holds cp times as many. A row that alone passes that is refused by name."""
    if not max_tokens:
        return Split([share(world, r, len(batch)) for r in range(world.data_size)], micro_batches(world, batch, size))
    costs = row_costs(batch, packed)
    worst = max(range(len(costs)), key=costs.__getitem__, default=None)
    per_rank = max_tokens
    max_tokens *= world.cp
    if worst is not None and costs[worst] > max_tokens:
        split = f" split over parallel.cp={world.cp} ranks" if world.cp > 1 else ""
        raise ConfigError(
            f"policy.max_tokens_per_micro_batch={per_rank}: row {worst} of the batch holds {costs[worst]} tokens"
            f"{'' if packed else ' (padded, unpacked)'}, more than a micro-batch may{split}; raise it, raise "
            "parallel.cp (a sequence's tokens split over ranks), or shorten rollout.max_model_len / rollout.max_tokens"
        )
    shares = balanced_shares(costs, world.data_size)
    runs = [cut(costs[s], size, max_tokens) for s in shares]
    count = max(1, *map(len, runs))
    mine, start = runs[world.data_rank], shares[world.data_rank].start
    micro = [(batch.rows(slice(start + a, start + b)), True) for a, b in mine]
    micro += [(batch.rows(slice(0, 1)), False)] * (count - len(mine))
    return Split(shares, micro)


def row_costs(batch, packed: bool) -> list[int]:
    """What each row of ``batch`` costs a micro-batch, in tokens: its own (packed rows) or the batch's width."""
    if packed:
        return batch.row_lengths()
    return [batch.input_ids.shape[1]] * len(batch)


def balanced_shares(costs: list[int], parts: int) -> list[slice]:
    """``parts`` contiguous runs of rows whose costs are near even: each boundary at the row where the running cost
    first reaches its part's even share of the total."""
    total, bounds, run, i = sum(costs), [0], 0, 0
    for p in range(1, parts):
        while i < len(costs) and run + costs[i] / 2 < total * p / parts:  # a row goes where most of it lies
            run += costs[i]
            i += 1
        bounds.append(i)
    bounds.append(len(costs))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def cut(costs: list[int], size: int, max_tokens: int) -> list[tuple[int, int]]:
    """Runs (start, stop) of rows with at most ``size`` rows (0: any) and ``max_tokens`` tokens each, in order."""
    runs, start, tokens = [], 0, 0
    for i, c in enumerate(costs):
        if i > start and ((size and i - start >= size) or tokens + c > max_tokens):
            runs.append((start, i))
            start, tokens = i, 0
        tokens += c
    return runs + [(start, len(costs))] if costs else runs


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


def gather_rows(world: World, parts: list[torch.Tensor], batch, shares: list[slice] | None = None) -> torch.Tensor:
    """Per-row results [rows, T] of every rank's share (``shares``: by count where not given), in row order, on
    every rank."""
    mine = torch.cat(parts) if parts else torch.zeros(0, batch.input_ids.shape[1], device=batch.input_ids.device)
    if world.data_size == 1:
        return mine
    n = len(batch)
    shares = shares or [share(world, r, n) for r in range(world.data_size)]
    counts = [len(range(n)[s]) for s in shares]
    width = max(counts)
    padded = torch.cat([mine, mine.new_zeros(width - len(mine), *mine.shape[1:])])
    pieces = [torch.empty_like(padded) for _ in range(world.data_size)]
    dist.all_gather(pieces, padded, group=world.group("data"))
    return torch.cat([p[:c] for p, c in zip(pieces, counts, strict=True)])


def sum_over_ranks(world: World, total: float, metrics: dict[str, float]) -> tuple[float, dict[str, float]]:
    """A step's loss and metric sums, each rank holding its rows' share, added up on every rank."""
    if world.data_size == 1:
        return total, metrics
    keys = sorted(metrics)
    sums = torch.tensor([total, *(metrics[k] for k in keys)], dtype=torch.float64)
    dist.all_reduce(sums, group=world.group("data"))
    return float(sums[0]), dict(zip(keys, sums[1:].tolist(), strict=True))
