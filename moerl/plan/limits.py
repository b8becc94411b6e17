"""What ``moerl plan`` says beyond a figure: parts of a layout that moerl does not build (tensor and expert tensor
parallelism), and the smallest layout of the given GPUs that fits."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig
from moerl.modes import mode_of
from moerl.run_config import RunConfig

TRACED_CANDIDATES = 2  # layouts traced at most while looking for one that fits (each is a plan of its own)
MAX_GPUS = 2**16  # the most GPUs moerl plans for: the layout search and why_none_fits's count reach this far


def check_limits(cfg: ModelConfig, run: RunConfig, machine, engine) -> list[str]:
    """The named limits a run meets on ``machine``: a native engine that cannot hold the model on one GPU, a layer
    whose weights alone exceed a GPU (tensor parallel), one expert that does (expert tensor parallel)."""
    out = []
    budget = machine.budget
    if engine is not None and engine.weights > budget:
        out.append(
            f"the native engine holds the whole model on one GPU ({engine.weights / 2**30:.0f} GiB of weights > "
            f"{budget / 2**30:.0f} GiB): serve it with vLLM split over GPUs (rollout.engine=vllm, "
            "rollout.vllm_args.tensor_parallel_size=N); moerl drives vLLM engines, tested on CPU builds only"
        )
    whole = run.policy.reference and mode_of(run.policy.mode).reference_copy  # a reference copy needs every tensor
    ep, pp = (1, 1) if whole else (run.parallel.ep, run.parallel.pp)
    loaded = _loaded_bytes(cfg, run, ep, pp)
    if loaded > budget:
        what = "the whole model" if whole else f"its pipeline stage's weights and its 1/{ep} of their experts"
        out.append(
            f"each trainer rank loads {what} ({loaded / 2**30:.0f} GiB in bf16) before FSDP shards them: more than a "
            "GPU holds; "
            + ("the frozen reference copy (policy.reference) is loaded whole" if whole else "raise parallel.ep or .pp")
        )
    layer, expert = _largest_layer(cfg)
    if layer > budget:
        out.append(
            f"one decoder layer's non-expert weights are {layer / 2**30:.0f} GiB in bf16, more than a GPU holds: "
            "FSDP gathers a layer whole, so this needs tensor parallelism, which moerl does not build"
        )
    if expert > budget:
        out.append(
            f"one expert's weights are {expert / 2**30:.0f} GiB in bf16, more than a GPU holds even at one expert per "
            "rank: this needs expert tensor parallelism (each expert split over ranks), which moerl does not build"
        )
    return out


def _loaded_bytes(cfg: ModelConfig, run: RunConfig, ep: int, pp: int) -> int:
    """What the most loaded trainer rank reads of the checkpoint (bf16): its pipeline stages' layers (with the
    embedding on the first stage, the norm and head on the last), each weight but the routed experts whole and its
    ``1/ep`` share of those (``moerl.bridges.checkpoint.read_model``'s experts and ``keep``)."""
    from moerl.model.transformer import MoEModel
    from moerl.plan.depth import my_stages, stage_ranges

    with torch.device("meta"):
        model = MoEModel(cfg, torch.bfloat16)
    routed = {id(p) for i in model.moe_layer_ids for p in model.layers[i].mlp.experts.parameters()}

    def size(params) -> int:
        return sum(p.numel() * 2 // (ep if id(p) in routed else 1) for p in params)

    if pp == 1:
        return size(model.parameters())
    ranges = stage_ranges(cfg, run)
    last = len(ranges) - 1
    ends = {
        "first": list(model.embed_tokens.parameters()),
        "last": [p for m in (model.norm, model.lm_head) if m is not None for p in m.parameters()]
        + (list(model.embed_tokens.parameters()) if cfg.tie_word_embeddings else []),
    }
    most = 0
    for stage in range(pp):
        stages = my_stages(run, stage * run.parallel.dp * run.parallel.ep, len(ranges))
        params = [p for s in stages for i in ranges[s] for p in model.layers[i].parameters()]
        params += ends["first"] if 0 in stages else []
        params += ends["last"] if last in stages else []
        most = max(most, size(params))
    return most


def _largest_layer(cfg: ModelConfig) -> tuple[int, int]:
    """(the largest decoder layer's bytes without its routed experts, one routed expert's bytes), bf16."""
    from moerl.model.transformer import MoEModel

    with torch.device("meta"):
        model = MoEModel(cfg, torch.bfloat16)
    layer = expert = 0
    for block in model.layers:
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        inside = {id(p) for p in experts.parameters()} if experts is not None else set()
        layer = max(layer, sum(p.numel() * 2 for p in block.parameters() if id(p) not in inside))
        if experts is not None:
            expert = max(expert, sum(p.numel() * 2 for p in experts.parameters()) // cfg.num_experts)
    return layer, expert


def expert_splits(cfg: ModelConfig) -> list[int]:
    """The expert splits (``ep``) the model takes: the divisors of its experts per MoE layer (1 for a model without:
    a split of no experts only copies)."""
    return [ep for ep in range(1, cfg.num_experts + 1) if cfg.num_experts % ep == 0] or [1]


def stage_counts(cfg: ModelConfig, run: RunConfig) -> range:
    """The pipeline depths (``pp``) the model takes: stages of at least one layer (two per rank interleaved)."""
    per_rank = 2 if run.parallel.schedule == "interleaved_1f1b" else 1
    return range(1, max(1, cfg.num_layers // per_rank) + 1)


Layout = tuple[int, int, int]  # (dp, ep, pp)


def candidates(cfg: ModelConfig, run: RunConfig, gpus: int, budget: int | None = None) -> Iterator[Layout]:
    """Every (dp, ep, pp) of at most ``gpus`` ranks the model can take, fewest GPUs first, then the most experts
    split, then the fewest stages; with ``budget``, only those whose ``at_rest_floor`` is within it. Made lazily, one
    stream of data-parallel sizes per (ep, pp) merged in order: a search that stops early never makes the rest (a
    listing of them all grows with ``gpus`` times the splits times the depths)."""
    state = None if budget is None else _state(cfg, run)
    gpus //= run.parallel.cp  # the run's context-parallel ranks are each data rank's
    streams = [_stream(ep, pp, gpus, state, budget) for ep in expert_splits(cfg) for pp in stage_counts(cfg, run)]
    for _, _, _, layout in heapq.merge(*streams):
        yield layout


def _stream(ep: int, pp: int, gpus: int, state: tuple | None, budget: int | None) -> Iterator[tuple]:
    """``candidates``' layouts of one (ep, pp), dp rising from the first whose floor is within ``budget``, each
    behind its sort key."""
    most = gpus // (ep * pp)
    first = 1 if state is None else _first_within(lambda dp: _floor(state, (dp, ep, pp)), most, budget)
    for dp in range(first, most + 1):
        yield dp * ep * pp, -ep, pp, (dp, ep, pp)


def _first_within(floor: Callable[[int], int], most: int, budget: int) -> int:
    """The smallest ``dp`` in [1, ``most``] whose ``floor(dp)`` is within ``budget`` (a floor never rises with dp:
    bisection), or ``most + 1`` where none is."""
    lo, hi = 1, most + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if floor(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _state(cfg: ModelConfig, run: RunConfig) -> tuple[int, int, bool, bool, int]:
    """(routed-expert parameters, the other parameters, whether the run keeps fp32 masters, whether they are in host
    memory, its context-parallel ranks): what ``_floor`` splits."""
    from moerl.model.transformer import MoEModel

    with torch.device("meta"):
        model = MoEModel(cfg, torch.bfloat16)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    masters = mode_of(run.policy.mode).masters
    rest = sum(p.numel() for p in model.parameters()) - experts
    return experts, rest, masters, masters and run.policy.cpu_offload, run.parallel.cp


def _floor(state: tuple[int, int, bool, bool, int], layout: tuple[int, int, int]) -> int:
    """``at_rest_floor`` of ``layout`` from ``_state``'s counts (FSDP shards over the cp ranks too)."""
    experts, rest, masters, offload, cp = state
    dp, ep, pp = layout
    dp *= cp
    if not masters:  # lora: a bf16 base, experts split by ep, the rest whole on its stage
        return 2 * (experts // ep + rest) // pp
    if offload:  # the expert slices' bf16 weights; the rest, the masters and the optimizer state in host memory
        return 2 * experts // (ep * pp)
    return 16 * (experts + rest) // (dp * ep * pp)  # fp32 masters, gradients and two moments


def at_rest_floor(cfg: ModelConfig, run: RunConfig, layout: tuple[int, int, int]) -> int:
    """A floor under any rank's bytes at rest in ``layout``: the trained state split perfectly over its ranks, a
    frozen base (lora) over its stages and expert slices. A layout whose floor exceeds the budget cannot fit."""
    return _floor(_state(cfg, run), layout)


def propose_layout(cfg: ModelConfig, run: RunConfig, machine, fits: Callable[[RunConfig], bool]):
    """The first of ``candidates`` (a ``(dp, ep, pp)``) for which ``fits(run with that layout)`` (its plan: every
    rank fits; layouts below the at-rest floor skipped), or None (then the limits say why). At most
    ``TRACED_CANDIDATES`` plans are made, a refused one (ConfigError) counted too: each costs a plan."""
    traced = 0
    for layout in candidates(cfg, run, machine.gpus, machine.budget):
        if layout == (run.parallel.dp, run.parallel.ep, run.parallel.pp):
            continue  # the run's context-parallel size kept: the layout is its other dimensions
        dp, ep, pp = layout
        trial = replace(run, parallel=replace(run.parallel, dp=dp, ep=ep, pp=pp, stages=[]))
        try:
            if fits(trial):
                return layout
        except ConfigError:
            pass
        traced += 1
        if traced >= TRACED_CANDIDATES:
            break
    return None


def why_none_fits(cfg: ModelConfig, run: RunConfig, machine, roles: list) -> list[str]:
    """Why no layout of ``machine``'s GPUs fits: the trained state's floor (how many such GPUs it needs at least),
    and activations that no split of the layers brings down (a micro-batch's sequence itself too long)."""
    out = []
    state = _state(cfg, run)
    masters, offload = state[2:4]
    host = "; policy.cpu_offload=true keeps the masters and optimizer state in host memory" * (masters and not offload)
    shapes = [(ep, pp) for ep in expert_splits(cfg) for pp in stage_counts(cfg, run)]
    for n in (2**k for k in range(MAX_GPUS.bit_length())):  # 1, 2, 4, ... MAX_GPUS
        cp = run.parallel.cp
        floors = [_floor(state, (n // (ep * pp * cp), ep, pp)) for ep, pp in shapes if n % (ep * pp * cp) == 0]
        if floors and min(floors) <= machine.budget:
            if n > machine.gpus:
                out.append(f"the weights, masters and optimizer state alone need at least {n} GPUs of this size{host}")
            break
    else:
        out.append(
            f"the weights, masters and optimizer state alone need more than {MAX_GPUS} GPUs of this size (the most "
            f"moerl plans for){host}"
        )
    acts = max((r.trace.peak.bytes["activations"] for r in roles), default=0)
    if acts > machine.budget:
        from moerl.plan.rank import micro_rows

        b, t = micro_rows(run), run.rollout.max_model_len
        options = []
        if run.policy.activation_checkpointing != "full":
            options.append(f"policy.activation_checkpointing=full (now {run.policy.activation_checkpointing})")
        if not run.policy.logits_chunk:
            options.append("policy.logits_chunk=2048 (now 0: the whole logits at once)")
        if b > 1:
            options.append(f"fewer rows a micro-batch (policy.micro_batch_size / max_tokens_per_micro_batch: {b} now)")
        cp = run.parallel.cp
        options.append(f"parallel.cp above {cp} (each sequence's tokens split over that many ranks)")
        out.append(
            f"one micro-batch of {b} x {t} tokens holds {acts / 2**30:.0f} GiB of activations on a rank: lower "
            f"rollout.max_model_len; or " + ", ".join(options)
        )
    return out
