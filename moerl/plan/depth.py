"""A deep stage's memory from shallow traces: a rank's layers of one kind (attention type, MoE or dense MLP, rotary
or not) hold the same bytes each, so its memory is linear in how many of each kind it holds.

The rank is traced on a model whose stages are cut down: this rank's stages keep ``BASE`` layers of each kind they
hold (fewer where they hold fewer: ``base``), and once more with one kind one layer deeper (one trace per kind);
the other stages keep one layer. Each category of the peak, of the step's end and of the sync's peak is then ``base +
sum over kinds of (n - BASE) x (deeper - base)``. The base holds two of a kind, not one: a layer's buffers that live
once at the peak whatever the depth (FSDP's reduce-scatter of the layer before, in flight) appear from the second
layer on, and a difference from one layer would count them once per layer. A shallow rank (few layers), or one
holding two interleaved stages (their peaks overlap as the schedule runs, not linearly in depth), is traced whole.
``tests/test_plan.py`` checks the extrapolation against whole traces. LongCat-Flash's layers come in pairs whose
first hands its MoE output to the second (``moe_shortcut``): there a pair is the unit, counted at its first layer and
cut as two layers.
"""

from __future__ import annotations

from dataclasses import replace

from moerl.model.config import ModelConfig
from moerl.plan.memory import Breakdown
from moerl.run_config import RunConfig

Kind = tuple[str, bool, bool, bool]  # (layer type, MoE, rotates nothing, a mixer alone)
BASE = 2  # layers of each kind the base trace holds (see the module docstring)


def kind(cfg: ModelConfig, i: int) -> Kind:
    return cfg.layer_types[i], i in set(cfg.moe_layers), i in set(cfg.nope_layers), i in set(cfg.mixer_only_layers)


def stage_ranges(cfg: ModelConfig, run: RunConfig) -> list[range]:
    """Every pipeline stage's layers of ``run``'s model (``parallel.stages``, else the balanced split)."""
    import torch

    from moerl.model.transformer import MoEModel
    from moerl.parallel.pipeline import split_layers, stages_per_rank

    n = run.parallel.pp * stages_per_rank(run.parallel.schedule)
    if n == 1:
        return [range(cfg.num_layers)]
    with torch.device("meta"):
        model = MoEModel(cfg, torch.bfloat16)
    return split_layers(model, n, run.parallel.stages or None)


def my_stages(run: RunConfig, rank: int, n_stages: int) -> list[int]:
    """The stages rank ``rank`` holds (interleaved schedules: two)."""
    p = run.parallel
    stage = rank // (p.dp * p.ep * p.cp)
    return [s for s in range(stage, n_stages, p.pp)]


def counts(cfg: ModelConfig, ranges: list[range], mine: list[int]) -> dict[int, dict[Kind, int]]:
    """How many layers of each kind each of ``mine`` holds, kinds in order of first appearance."""
    out = {}
    for s in mine:
        c: dict[Kind, int] = {}
        for i in ranges[s]:
            if cfg.moe_shortcut and i % 2:  # the second of a pair: counted with the first
                continue
            c[kind(cfg, i)] = c.get(kind(cfg, i), 0) + 1
        out[s] = c
    return out


def cut(cfg: ModelConfig, run: RunConfig, ranges: list[range], layers: dict[int, dict[Kind, int]]):
    """(config, run) of the model whose stage s holds ``layers[s]`` (kind -> count), the other stages one layer of
    their first kind."""
    kinds: list[Kind] = []
    sizes = []
    for s, r in enumerate(ranges):
        mine = layers.get(s) or {kind(cfg, r.start): 1}
        for k, n in mine.items():
            # a pair (moe_shortcut): its MoE layer, then the dense layer of the same attention it hands its output to
            kinds += ([k, (k[0], False, k[2], False)] if cfg.moe_shortcut else [k]) * n
        sizes.append(sum(mine.values()) * (2 if cfg.moe_shortcut else 1))
    types = [k[0] for k in kinds]
    nope = [i for i, k in enumerate(kinds) if k[2]]
    small = replace(
        cfg,
        num_layers=len(kinds),
        layer_types=types,
        moe_layers=[i for i, k in enumerate(kinds) if k[1]],
        nope_layers=nope,
        mixer_only_layers=[i for i, k in enumerate(kinds) if k[3]],
        **_absent(cfg, set(types), bool(nope)),
    )
    stages = sizes if len(ranges) > 1 else []
    return small, replace(run, parallel=replace(run.parallel, stages=stages))


def _absent(cfg: ModelConfig, types: set[str], nope: bool) -> dict:
    """The fields of ``cfg`` about layers the cut model lacks, at their defaults (a field about no layer is refused):
    the sliding layers' window and own sizes and RoPE, the chunked layers' chunk, the NoPE layers' temperature, the
    full layers' values that are their keys."""
    out = {}
    if "sliding" not in types:
        out |= dict(sliding_window=None, sliding_rope=None, sliding_rope_dim=None, sliding_kv_heads=0)
        out |= dict(sliding_head_dim=0, sinks_sliding_only=False)
        if cfg.sinks_sliding_only:  # no layer holds them
            out["attention_sinks"] = False
    if "chunked" not in types:
        out["attention_chunk"] = None
    if not nope:
        out |= dict(attn_temperature_scale=0.0, attn_temperature_floor=0)
    if "full" not in types:
        out["attn_k_eq_v"] = False
    return {k: v for k, v in out.items() if getattr(cfg, k) != v}


def combine(base: Breakdown, steps: list[tuple[Breakdown, int]]) -> Breakdown:
    """``base`` plus, for each (deeper trace, extra layers), extra x (deeper - base), per category."""
    out = base.copy()
    for doubled, extra in steps:
        for c in out.bytes:
            out.bytes[c] += extra * (doubled.bytes[c] - base.bytes[c])
    return out
