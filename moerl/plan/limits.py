"""What ``moerl plan`` says beyond a figure: parts of a layout that moerl does not build (tensor, context and expert
tensor parallelism), and the smallest layout of the given GPUs that fits."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig
from moerl.modes import mode_of
from moerl.run_config import RunConfig

TRACED_CANDIDATES = 2  # layouts traced at most while looking for one that fits (each is a plan of its own)


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
    whole = _bf16_bytes(cfg)
    if whole > budget:
        out.append(
            f"each trainer rank loads the whole checkpoint ({whole / 2**30:.0f} GiB in bf16) before the layout splits "
            "it: that much host memory per rank (loading only a rank's tensors, moerl.bridges.checkpoint.names_held, "
            "is not wired into Policy yet)"
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


def _bf16_bytes(cfg: ModelConfig) -> int:
    from moerl.model.transformer import MoEModel

    with torch.device("meta"):
        return sum(p.numel() * 2 for p in MoEModel(cfg, torch.bfloat16).parameters())


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


def candidates(cfg: ModelConfig, run: RunConfig, gpus: int) -> list[tuple[int, int, int]]:
    """Every (dp, ep, pp) of at most ``gpus`` ranks the model can take, fewest GPUs first, then the most experts
    split, then the fewest stages."""
    per_rank = 2 if run.parallel.schedule == "interleaved_1f1b" else 1
    out = []
    for n in range(1, gpus + 1):
        for ep in range(1, n + 1):
            if n % ep or cfg.num_experts % ep:
                continue
            for pp in range(1, n // ep + 1):
                if (n // ep) % pp or pp * per_rank > cfg.num_layers:
                    continue
                out.append((n // ep // pp, ep, pp))
    return sorted(out, key=lambda lay: (math.prod(lay), -lay[1], lay[2]))


def at_rest_floor(cfg: ModelConfig, run: RunConfig, layout: tuple[int, int, int]) -> int:
    """A floor under any rank's bytes at rest in ``layout``: the trained state split perfectly over its ranks, a
    frozen base (lora) over its stages and expert slices. A layout whose floor exceeds the budget cannot fit."""
    from moerl.model.transformer import MoEModel

    dp, ep, pp = layout
    with torch.device("meta"):
        model = MoEModel(cfg, torch.bfloat16)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for p in model.parameters()) - experts
    if not mode_of(run.policy.mode).masters:  # lora: a bf16 base, experts split by ep, the rest whole on its stage
        return 2 * (experts // ep + rest) // pp
    return 16 * (experts + rest) // (dp * ep * pp)  # fp32 masters, gradients and two moments


def propose_layout(cfg: ModelConfig, run: RunConfig, machine, fits: Callable[[RunConfig], bool]):
    """The first of ``candidates`` (a ``(dp, ep, pp)``) for which ``fits(run with that layout)`` (its plan: every
    rank fits; layouts below the at-rest floor skipped), or None (then the limits say why)."""
    traced = 0
    for layout in candidates(cfg, run, machine.gpus):
        if layout == (run.parallel.dp, run.parallel.ep, run.parallel.pp):
            continue
        if at_rest_floor(cfg, run, layout) > machine.budget:
            continue
        dp, ep, pp = layout
        trial = replace(run, parallel=replace(run.parallel, dp=dp, ep=ep, pp=pp, stages=[]))
        try:
            if fits(trial):
                return layout
        except ConfigError:
            continue
        traced += 1
        if traced >= TRACED_CANDIDATES:
            break
    return None


def why_none_fits(cfg: ModelConfig, run: RunConfig, machine, roles: list) -> list[str]:
    """Why no layout of ``machine``'s GPUs fits: the trained state's floor (how many such GPUs it needs at least),
    and activations that no split of the layers brings down (a micro-batch's sequence itself too long)."""
    out = []
    for n in (2**k for k in range(0, 17)):
        floors = [at_rest_floor(cfg, run, lay) for lay in candidates(cfg, run, n) if math.prod(lay) == n]
        if floors and min(floors) <= machine.budget:
            if n > machine.gpus:
                out.append(f"the weights, masters and optimizer state alone need at least {n} GPUs of this size")
            break
    acts = max((r.trace.peak.bytes["activations"] for r in roles), default=0)
    if acts > machine.budget:
        b, t = run.policy.micro_batch_size, run.rollout.max_model_len
        out.append(
            f"one micro-batch of {b} x {t} tokens holds {acts / 2**30:.0f} GiB of activations on a rank: lower "
            "policy.micro_batch_size or rollout.max_model_len, or split the sequence over ranks (context "
            "parallelism) or recompute activations in the backward (activation checkpointing): moerl builds "
            "neither yet"
        )
    return out
