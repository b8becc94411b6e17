"""Expert parallelism, applied from outside the model: each rank of the ``ep`` group keeps a contiguous slice of
every MoE layer's experts (and of their per-expert adapters), and each MoE forward sends every (token, slot) pair to
the rank that holds its expert and the results back, with ``all_to_all_single`` (counts exchanged first). The
exchange is a pair of hooks on the experts module (torchtitan's input / output functions of a parallel style): the
pre-hook sends the pairs away and hands the module the pairs it got, the forward hook sends the results back and
sums them per token. The module itself — plain, LoRA or MXFP8 — runs unchanged on its slice.

The expert index of each pair — the router's own or R3's replayed one — decides where it goes; a pair of a
zero-computation expert (LongCat-Flash's) goes nowhere: the MoE block adds its gate weight times the token itself.
Its gate weight travels with it in fp32, so the router's gradient comes back through the exchange. The receiving rank
computes its rows as ``k = 1`` rows of the ordinary expert path (grouped GEMM, MXFP8, both adapter layouts): one code
path for the math, whatever the split. ``shared_outer`` adapters keep their hidden-size factors whole on every rank
(they are not per expert); FSDP reduces their gradients over the data group like any other replicated weight.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from moerl.errors import ConfigError
from moerl.model.moe import EXPERT_WEIGHTS, Experts
from moerl.parallel.plan import check_layout
from moerl.parallel.world import World


def _all_to_all(rows: torch.Tensor, out_counts: list[int], in_counts: list[int], group) -> torch.Tensor:
    out = rows.new_empty(sum(out_counts), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), out_counts, in_counts, group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, out_counts, in_counts, group):
        ctx.counts, ctx.group = (out_counts, in_counts), group
        return _all_to_all(rows, out_counts, in_counts, group)

    @staticmethod
    def backward(ctx, grad):
        out_counts, in_counts = ctx.counts
        return _all_to_all(grad, in_counts, out_counts, ctx.group), None, None, None


def exchange(rows: torch.Tensor, out_counts: list[int], in_counts: list[int], group) -> torch.Tensor:
    """``rows`` split by ``in_counts`` to the ranks of ``group``; returns what they sent here (``out_counts``).
    Differentiable: the backward sends the gradients back the way the rows came."""
    if rows.requires_grad:
        return _Exchange.apply(rows, out_counts, in_counts, group)
    return _all_to_all(rows, out_counts, in_counts, group)


class ExpertDispatch:
    """The exchange of one MoE layer's experts: experts ``[first, first + local)`` of ``total`` on this rank of
    ``group`` (``ranks`` ranks). Installed as the experts module's forward pre-hook and forward hook."""

    def __init__(self, experts: nn.Module, first: int, total: int, group, ranks: int):
        self.first, self.total, self.local = first, total, total // ranks
        self.zero = experts.zero  # router slots past the experts (LongCat-Flash's zero-computation experts)
        self.group, self.ranks = group, ranks
        self._back = None  # (x, token, sent, got) of the forward in flight, for the forward hook
        self.handles = (
            experts.register_forward_pre_hook(self.dispatch),
            experts.register_forward_hook(self.combine),
        )

    def dispatch(self, experts: nn.Module, args: tuple) -> tuple:
        """(x [N, H], idx [N, k], weights [N, k]) -> the pairs this rank's experts run: (rows, local idx, gate)."""
        x, idx, weights = args
        lora = getattr(experts, "lora", None)
        if lora is not None and lora.ctx.active and lora.ctx.single is None:
            raise ConfigError(
                "expert parallelism trains one adapter slot per forward; per-sequence adapter slots (the rollout "
                "engine's) are not supported under parallel.ep > 1"
            )
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # pairs sorted by expert, so grouped by the rank that holds it
        if self.zero:  # zero-computation experts' pairs (last in the order) stay: the MoE block adds them itself
            order = order[: int((flat < self.total).sum())]
        token, expert = order // k, flat[order]
        sent = torch.bincount(expert // self.local, minlength=self.ranks)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)
        sent, got = sent.tolist(), got.tolist()
        rows = exchange(x.index_select(0, token), got, sent, self.group)
        gate = exchange(weights.reshape(-1)[order], got, sent, self.group)
        local = exchange(expert % self.local, got, sent, self.group)
        self._back = (x, token, sent, got)
        return rows, local[:, None], gate[:, None]

    def combine(self, experts: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        """The results of the pairs this rank ran, back to their tokens' ranks and summed per token."""
        x, token, sent, got = self._back
        self._back = None
        back = exchange(y, sent, got, self.group)
        return torch.zeros_like(x).index_add_(0, token, back)


def _sliced_tensors(experts: Experts, base: bool = True) -> list[tuple[nn.Module, str, int]]:
    """(module, attribute, expert dim) of every per-expert tensor of ``experts`` and its adapters (``base``: the
    expert weights too)."""
    out = [(experts, n, 0) for n in EXPERT_WEIGHTS if base and getattr(experts, n) is not None]
    lora = getattr(experts, "lora", None)
    if lora is not None:
        per_expert = lora.layout == "per_expert"
        names = ("gate_up_A", "gate_up_B", "down_A", "down_B") if per_expert else ("gate_up_B", "down_A")
        out += [(lora, n, 1) for n in names]
    return out


def shard_experts(model: nn.Module, world: World) -> dict[str, int]:
    """Keep this rank's slice of every MoE layer's experts (in place) and install the exchange; returns
    {parameter name: expert dim} of the sliced tensors (plain tensors, not FSDP's: the caller leaves them out of the
    data-parallel units)."""
    check_layout(world.dp, world.ep, world.pp, model.config)
    total = model.config.num_experts
    n = total // world.ep
    first = world.ep_rank * n
    sliced = {}
    for i in model.moe_layer_ids:
        experts = model.layers[i].mlp.experts
        for module, attr, dim in _sliced_tensors(experts):
            p = getattr(module, attr)
            if p.shape[dim] == total:  # else loaded as this rank's share already (read_model's experts)
                setattr(module, attr, nn.Parameter(p.detach().narrow(dim, first, n).clone(), p.requires_grad))
            prefix = f"layers.{i}.mlp.experts" + (".lora" if module is not experts else "")
            sliced[f"{prefix}.{attr}"] = dim
        experts.ep = ExpertDispatch(experts, first, total, world.group("ep"), world.ep)
        _count(experts, n)
    return sliced


def gather_experts(world: World, t: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole tensor of every ep rank's expert slice ``t`` (a collective over the ep group)."""
    pieces = [torch.empty_like(t) for _ in range(world.ep)]
    dist.all_gather(pieces, t.contiguous(), group=world.group("ep"))
    return torch.cat(pieces, dim)


@contextmanager
def whole_experts(model: nn.Module, world: World, base: bool = True):
    """Inside the block every expert tensor of ``model`` is whole (gathered over the ep group; a collective), e.g.
    to export the adapters; the slices are back after it. ``base=False``: the adapters' only (the frozen expert
    weights stay sliced: a whole copy of every layer's experts on every rank is the model's size)."""
    kept, layers = [], [model.layers[i].mlp.experts for i in model.moe_layer_ids]
    layers = [e for e in layers if getattr(e, "ep", None) is not None]
    for experts in layers:
        for module, attr, dim in _sliced_tensors(experts, base):
            p = getattr(module, attr)
            kept.append((module, attr, p))
            setattr(module, attr, nn.Parameter(gather_experts(world, p.detach(), dim), requires_grad=False))
        _count(experts, experts.ep.total, base)
    try:
        yield model
    finally:
        for module, attr, p in kept:
            setattr(module, attr, p)
        for experts in layers:
            _count(experts, experts.ep.local, base)


def _count(experts: Experts, n: int, base: bool = True) -> None:
    if base:
        experts.num_experts = n
    lora = getattr(experts, "lora", None)
    if lora is not None:
        lora.num_experts = n
