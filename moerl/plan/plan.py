"""``moerl plan``: whether a run's layout fits its GPUs, where each rank's memory goes, what a weight sync sends, and
the smallest layout of the given GPUs that fits, answered before anything starts.

Each distinct trainer rank (a pipeline stage; every expert slice of a stage is alike under balanced routing) is
traced (``moerl.plan.rank``): its training step's peak and its weight sync's, split by what holds the memory. A rollout
engine on the same GPU (``--colocated``) adds its weights, KV cache and the weights a sync stages, from the sizes the
engine allocates. A rank fits when that total is within ``--usable`` of the GPU's memory (the rest: the CUDA context,
the allocator's fragmentation, NCCL's buffers).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig
from moerl.modes import mode_of
from moerl.plan.limits import MAX_GPUS
from moerl.plan.memory import CATEGORIES, ON_DEVICE
from moerl.plan.rank import RankTrace, micro_rows, trace_rank
from moerl.run_config import RunConfig

MODELS = Path(__file__).parent / "models"  # real configs shipped with moerl (config.json only, no weights)
GiB = 2**30


def shipped() -> list[str]:
    """The names of the real model configs shipped for planning (``model.path=NAME``)."""
    return sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())


def resolve_model(run: RunConfig) -> tuple[str, dict, ModelConfig]:
    """(name, config.json fields, ModelConfig) of the run's model: a checkpoint directory, a shipped config's name, or
    the random preset (``model.arch`` / ``model.preset``)."""
    from moerl.bridges import HFConfig, get_bridge, read_config
    from moerl.presets import preset_config

    path = run.model.path
    if path is None:
        hf, cfg = preset_config(run.model.arch, run.model.preset)
        return f"{run.model.arch} {run.model.preset}", hf, cfg
    directory = Path(path)
    if not directory.is_dir() and (MODELS / path.lower()).is_dir():
        directory = MODELS / path.lower()
    elif not directory.is_dir():
        raise ConfigError(
            f"model.path={path!r}: no such checkpoint directory and no shipped config of that name "
            f"(shipped: {', '.join(shipped())})"
        )
    hf = read_config(directory)
    source = str(directory / "config.json")
    return directory.name, hf, get_bridge(hf, source=source).config_from_hf(HFConfig(hf, source))


@dataclass(slots=True)
class Machine:
    """The GPUs a run is planned for: ``gpus`` in all on ``nodes`` nodes, ``memory`` bytes each, of which ``usable``
    may hold tensors; weight syncs cross a link of ``link`` bytes/s."""

    gpus: int
    memory: int = 80 * 10**9
    nodes: int = 1
    usable: float = 0.9
    link: float = 50e9

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nodes < 1 or self.gpus % self.nodes:
            raise ConfigError(f"--gpus {self.gpus} on --nodes {self.nodes}: needs whole GPUs per node (gpus >= 1)")
        if self.gpus > MAX_GPUS:
            raise ConfigError(f"--gpus {self.gpus}: moerl plans for at most {MAX_GPUS} GPUs")
        if not self.memory >= 1:
            raise ConfigError(f"--gpu-memory {self.memory} bytes: a GPU's memory must be more than 0")
        if not (self.link > 0 and math.isfinite(self.link)):
            raise ConfigError(f"--link {self.link} bytes/s: a link's bandwidth must be more than 0")
        if not 0 < self.usable <= 1:
            raise ConfigError(f"--usable {self.usable}: must lie in (0, 1]")

    @property
    def budget(self) -> int:
        return int(self.memory * self.usable)


@dataclass(slots=True)
class Role:
    """One traced rank with its colocated engine's bytes and its verdict."""

    trace: RankTrace
    engine: int
    need: int
    fits: bool

    @property
    def largest(self) -> str:
        parts = {c: self.trace.peak.bytes[c] for c in ON_DEVICE} | {"engine": self.engine}
        return max(parts, key=parts.get)


@dataclass(slots=True)
class Plan:
    """A run's plan: its model, layout, each rank role's memory, the sync per mode, limits met, a proposed layout."""

    name: str
    params: int
    run: RunConfig
    machine: Machine
    colocated: bool
    roles: list[Role] = field(default_factory=list)
    sync_bytes: dict[str, int] = field(default_factory=dict)
    limits: list[str] = field(default_factory=list)
    proposal: tuple[int, int, int] | None = None
    # a setting that makes the run fit where its own do not: (the override, the layout that fits with it, or None
    # for the run's own layout)
    option: tuple[str, tuple[int, int, int] | None] | None = None
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return bool(self.roles) and all(r.fits for r in self.roles)


# the context-parallel sizes a plan tries where a run's sequences do not fit its ranks (``_with_option``)
CONTEXT_SPLITS = (2, 4, 8)


def layout_of(run: RunConfig) -> tuple[int, int, int]:
    return run.parallel.dp, run.parallel.ep, run.parallel.pp


def layout_text(dp: int, ep: int, pp: int, cp: int) -> str:
    """A layout as the plan says it: ``dp 2 x ep 4 x pp 1`` (and ``x cp N`` where it splits sequences)."""
    return f"dp {dp} x ep {ep} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "")


def roles(run: RunConfig) -> list[int]:
    """A representative rank of each pipeline stage (data rank 0, expert slice 0, context rank 0): the others of a
    stage are alike."""
    dp, ep, _ = layout_of(run)
    return [stage * dp * ep * run.parallel.cp for stage in range(run.parallel.pp)]


def plan_dtype(run: RunConfig) -> RunConfig:
    """The run as a GPU runs it: ``auto`` dtypes are bf16 there (moerl.precision)."""
    policy = run.policy
    if policy.dtype == "auto":
        run = replace(run, policy=replace(policy, dtype="bfloat16"))
    return run


Tracer = Callable[[ModelConfig, RunConfig, list[int], dict], list[RankTrace]]


def plan(run: RunConfig, machine: Machine, colocated: bool = False, propose: bool = True, workers: int = 1) -> Plan:
    """Plan ``run`` on ``machine`` (see the module docstring). ``workers`` > 1: the ranks are traced that many at a
    time, each in a process of its own (a trace is single-threaded Python: one per core)."""
    with (
        ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _one_thread)
        if workers > 1
        else (nullcontext()) as pool
    ):

        def trace(cfg: ModelConfig, run: RunConfig, ranks: list[int], hf: dict) -> list[RankTrace]:
            if pool is None or len(ranks) == 1:
                return [trace_rank(cfg, run, rank, hf) for rank in ranks]
            return list(pool.map(_trace_rank, *zip(*((cfg, run, rank, hf) for rank in ranks), strict=True)))

        return plan_with(run, machine, colocated, propose, trace)


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _one_thread() -> None:
    torch.set_num_threads(1)  # the workers share the cores: no OpenMP pool each


def _trace_rank(cfg: ModelConfig, run: RunConfig, rank: int, hf: dict) -> RankTrace:
    return trace_rank(cfg, run, rank, hf)


def plan_with(
    run: RunConfig, machine: Machine, colocated: bool, propose: bool, tracer: Tracer, options: bool = True
) -> Plan:
    """``plan``, its ranks traced by ``tracer`` (in this process or a pool's); ``options``: where no layout fits,
    try the settings that save memory (``_with_option``)."""
    from moerl.engine.config import check_context
    from moerl.parallel.plan import check_layout
    from moerl.plan.limits import check_limits, propose_layout, why_none_fits
    from moerl.plan.sync import engine_bytes, sync_bytes

    start = time.perf_counter()
    run = plan_dtype(run)
    name, hf, cfg = resolve_model(run)
    if run.rollout.engine == "native":  # train's native engine refuses a window longer than the model's at its start
        check_context(run.rollout.max_model_len, cfg, key="rollout.max_model_len")
    params = _count_params(cfg)
    out = Plan(name, params, run, machine, colocated)
    par = run.parallel
    check_layout(par.dp, par.ep, par.pp, cfg, par.schedule, par.stages, par.cp)
    out.sync_bytes = sync_bytes(cfg, run)
    engine = engine_bytes(cfg, run, out.sync_bytes) if run.rollout.engine == "native" else None
    out.limits = check_limits(cfg, run, machine, engine)
    size = par.size
    if size > machine.gpus:
        out.limits.append(
            f"the layout {layout_text(par.dp, par.ep, par.pp, par.cp)} takes {size} GPUs; {machine.gpus} are given"
        )
    else:
        for trace in tracer(cfg, run, roles(run), hf):
            trainer = max(trace.peak.total, trace.sync.total)
            need = trainer
            if colocated and engine is not None:  # the engine's weights always; its cache while it generates (the
                # trainer at rest then, its gradients kept), its staged weights during a sync
                busiest = max(trace.peak.total, trace.sync.total + engine.staging, trace.end.total + engine.kv)
                need = engine.weights + busiest
            out.roles.append(Role(trace, need - trainer, need, need <= machine.budget))
    if propose and not out.fits:
        # activations beyond a GPU on their own: no layout helps (a 1F1B first stage holds pp micro-batches of
        # 1 / pp of the layers: as many layers' activations as one rank of no pipeline)
        acts = max((r.trace.peak.bytes["activations"] for r in out.roles), default=0)
        if acts <= machine.budget:

            def fits(trial: RunConfig) -> bool:
                return plan_with(trial, machine, colocated, False, tracer).fits

            out.proposal = propose_layout(cfg, run, machine, fits)
        if out.proposal is None and options:
            out.option = _with_option(run, machine, colocated, tracer)
        if out.proposal is None and out.option is None:
            out.limits += why_none_fits(cfg, run, machine, out.roles)
    out.seconds = time.perf_counter() - start
    return out


def _with_option(run: RunConfig, machine: Machine, colocated: bool, tracer: Tracer):
    """Where the run's own settings fit no layout: the same run with the settings that save memory and that it has
    not on — each decoder block recomputed in the backward, the trained state in host memory (modes with masters),
    one then both; then each sequence split over more context-parallel ranks (``CONTEXT_SPLITS``, with the blocks
    recomputed); last, in one process with masters, both and the optimizer stepping in the backward (without
    clipping) — planned on its layout and, failing that, on the layouts a proposal searches; (the overrides as the
    user writes them, the layout that fits or None for its own) of the first that fits, else None. A split the model
    cannot take (its heads, its layers) is passed over."""
    policy, par = run.policy, run.parallel
    options = []
    if policy.activation_checkpointing != "full":
        options.append({"policy.activation_checkpointing": "full"})
    if mode_of(policy.mode).masters and not policy.cpu_offload:
        options.append({"policy.cpu_offload": True})
    if len(options) == 2:
        options.append(options[0] | options[1])
    recompute = {"policy.activation_checkpointing": "full"} if policy.activation_checkpointing != "full" else {}
    options += [{"parallel.cp": cp} | recompute for cp in CONTEXT_SPLITS if cp > par.cp and par.pp == 1]
    if mode_of(policy.mode).masters and par.size == 1 and not policy.optimizer_in_backward:
        # last: it gives up clipping; the gradients a full step would hold are stepped and freed in the backward
        offload = {} if policy.cpu_offload else {"policy.cpu_offload": True}
        options.append(recompute | offload | {"policy.optimizer_in_backward": True, "policy.optim.grad_clip": 0})
    for over in options:
        by_section: dict[str, dict] = {"policy": {}, "parallel": {}}
        for key, value in over.items():
            section, field_name = key.split(".", 1)
            if "." in field_name:  # policy.optim.*: the nested section replaced, each key of it once
                sub, name = field_name.split(".")
                by_section[section][sub] = replace(getattr(getattr(run, section), sub), **{name: value})
            else:
                by_section[section][field_name] = value
        trial = replace(
            run, policy=replace(policy, **by_section["policy"]), parallel=replace(par, **by_section["parallel"])
        )
        try:
            planned = plan_with(trial, machine, colocated, True, tracer, False)
        except ConfigError:  # e.g. a context split the model's heads or layers do not take
            continue
        if planned.fits or planned.proposal is not None:
            text = " ".join(f"{k}={str(v).lower()}" for k, v in over.items())
            return text, planned.proposal
    return None


def _count_params(cfg: ModelConfig) -> int:
    from moerl.model.transformer import MoEModel

    with torch.device("meta"):
        model = MoEModel(cfg, torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def render(p: Plan) -> str:
    """The plan as the table ``moerl plan`` prints."""
    run, m = p.run, p.machine
    dp, ep, pp = layout_of(run)
    cp = run.parallel.cp
    split = f", split over {cp} context-parallel ranks" if cp > 1 else ""
    lines = [
        f"moerl plan: {p.name} ({p.params / 1e9:.1f} B parameters), mode {run.policy.mode}, {run.policy.dtype}; "
        f"layout {layout_text(dp, ep, pp, cp)} ({run.parallel.schedule if pp > 1 else 'no pipeline'}) on "
        f"{m.gpus} GPUs x {m.memory / 1e9:.0f} GB ({m.nodes} node{'s' * (m.nodes > 1)}); usable {m.usable:.0%} = "
        f"{_gib(m.budget)} GiB",
        f"step: micro-batch {micro_rows(run)} x {run.rollout.max_model_len} tokens (every sequence at "
        f"rollout.max_model_len{split}), "
        f"packing {'on' if run.policy.packing else 'off'}, R3 {'on' if run.algo.r3 else 'off'}"
        f", activation checkpointing {run.policy.activation_checkpointing}, logits in chunks of "
        f"{run.policy.logits_chunk or 'all'} tokens{'; masters and optimizer in host memory' * run.policy.cpu_offload}"
        "; engine "
        f"{'on the same GPU' if p.colocated else 'on GPUs of its own'}",
    ]
    if p.roles:
        head = ["rank", "stages", *CATEGORIES, "sync", "engine", "total", "fits", "largest"]
        rows = [head]
        for r in p.roles:
            t = r.trace
            rows.append(
                [
                    str(t.rank),
                    ",".join(map(str, t.stages)),
                    *(_gib(t.peak.bytes[c]) for c in CATEGORIES),
                    _gib(t.sync.total),
                    _gib(r.engine),
                    _gib(r.need),
                    "yes" if r.fits else "NO",
                    r.largest,
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines.append("GiB per rank at the step's peak (sync: the trainer's peak during a weight sync):")
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        traced = p.roles[0].trace
        lines.append(
            f"  traced: {len(p.roles)} rank(s), {sum(r.trace.seconds for r in p.roles):.1f} s of tracing in all; "
            f"router choices assumed balanced {traced.assumed}x, float reads answered 0: {traced.float_reads}"
        )
    sends = ", ".join(f"{mode} {_gib(n)} GiB = {n / m.link:.2f} s" for mode, n in p.sync_bytes.items() if n is not None)
    lines.append(f"weight sync per step at {m.link / 1e9:.0f} GB/s: {sends}")
    verdict = "fits" if p.fits else "does not fit"
    lines.append(f"verdict: {verdict}")
    if p.proposal is not None:
        pdp, pep, ppp = p.proposal
        lines.append(
            f"smallest layout that fits: parallel.dp={pdp} parallel.ep={pep} parallel.pp={ppp} "
            f"({pdp * pep * ppp * cp} GPUs)"
        )
    elif p.option is not None:
        option, layout = p.option
        cp = next((int(o.split("=")[1]) for o in option.split() if o.startswith("parallel.cp=")), cp)
        where = (
            "on this layout"
            if layout is None
            else (
                f"on parallel.dp={layout[0]} parallel.ep={layout[1]} parallel.pp={layout[2]} "
                f"({math.prod(layout) * cp} GPUs)"
            )
        )
        lines.append(f"with {option}: fits {where}")
    elif not p.fits:
        lines.append(f"no layout of these {m.gpus} GPUs was found to fit")
    lines += [f"limit: {text}" for text in p.limits]
    lines.append(f"planned in {p.seconds:.1f} s")
    return "\n".join(lines)
