"""One trainer rank of a run, traced: the real Policy on the real layout of a fake world, one training step of a
worst-case batch on fake tensors, its memory counted (``moerl.plan.memory``).

The batch is the run's own kind at its longest: every sequence ``rollout.max_model_len`` tokens (packing saves
nothing then), a completion of ``rollout.max_tokens`` of them in the loss, the engine's routing replayed (R3) and
balanced over the experts. A rank runs two micro-batches (the second holds the first's gradients), or as many as its
pipeline schedule keeps in flight. The optimizer's state is made first, as after a first step.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from moerl.device import capability, gpu_paths
from moerl.model.config import ModelConfig
from moerl.parallel.world import World, fake_world
from moerl.plan.fake import Shapes
from moerl.plan.memory import Breakdown, Memory
from moerl.run_config import RunConfig


@dataclass(slots=True)
class RankTrace:
    """What one rank holds at the peak of a training step (``peak``), at its end (``end``) and at the peak of the weight
    sync after it (``sync``: ``activations`` there are the gathered tensors and the bucket in flight), with the
    trace's own figures: the rank traced, its pipeline stages and expert slice, the bytes it sent, seconds, float
    reads answered 0, router choices assumed balanced."""

    rank: int
    stages: list[int]
    ep_rank: int
    peak: Breakdown
    end: Breakdown
    sync: Breakdown
    sent: int
    seconds: float
    float_reads: int
    assumed: int


class Elsewhere:
    """The rollout engine as a trainer rank sees it when the engine has GPUs of its own: what a sync sends leaves
    this rank (the sync's stream of buckets is traced against it; nothing is kept)."""

    def __init__(self):
        self.sent = 0

    def stage_weights(self, tensors: dict) -> None:
        self.sent += sum(t.numel() * t.element_size() for t in tensors.values())


def plan_model(cfg: ModelConfig, hf: dict | None = None):
    """``build(dtype=, device=)`` for ``Policy``: the model of ``cfg``, made on the meta device and given fake
    storage on ``device`` (inside ``Shapes``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from moerl.model.transformer import MoEModel

    def build(dtype: torch.dtype, device) -> MoEModel:
        with _disable_current_modes(), torch.device("meta"):  # built plain, then given fake storage
            model = MoEModel(cfg, dtype)
        model.to_empty(device=device)
        model.init_rope()
        model.hf_config = hf or {}
        return model

    return build


def step_rows(run: RunConfig) -> int:
    """Rows of one optimizer step: the step's samples over its mini-batches."""
    return math.ceil(run.rollout.prompts_per_step * run.rollout.group_size / run.algo.mini_batches)


def micro_rows(run: RunConfig) -> int:
    """Rows of one micro-batch at the run's longest sequences: ``policy.micro_batch_size``, or as many as
    ``policy.max_tokens_per_micro_batch`` lets in at ``rollout.max_model_len`` tokens each where fewer (or where
    the rows are not bounded)."""
    size, budget = run.policy.micro_batch_size, run.policy.token_budget
    if budget:
        fit = max(1, budget * run.parallel.cp // run.rollout.max_model_len)  # the budget is a cp rank's
        size = min(size, fit) if size else fit
    return size


def traced_rows(run: RunConfig, world: World) -> int:
    """Rows the trace runs: two micro-batches per data rank (or the pipeline's micro-batches in flight), at most the
    step's."""
    in_flight = world.pp * (2 if world.schedule == "interleaved_1f1b" else 1)
    per_rank = micro_rows(run) * max(2, run.parallel.microbatches, in_flight)
    return min(step_rows(run), per_rank * world.data_size)


def worst_batch(cfg: ModelConfig, run: RunConfig, rows: int, length: int | None = None):
    """``rows`` sequences of the run at their longest (real CPU tensors: their values are known to the trace)."""
    from moerl.rollout.episode import Episode, to_batch

    t = length or run.rollout.max_model_len
    new = min(run.rollout.max_tokens, t - 1)
    n_moe, k, e = len(cfg.route_layers()), cfg.top_k, cfg.num_experts  # R3 columns: JetMoE routes attention too
    routed = None
    if run.algo.r3 and n_moe:
        token = torch.arange(t - 1)[:, None, None]
        routed = ((token * k + torch.arange(k)) % e).expand(t - 1, n_moe, k).to(torch.int16)
    tokens = (torch.arange(t) % cfg.vocab_size).tolist()
    episodes = [
        Episode(i, tokens, t - new, [0] * (t - new) + [1] * new, [0.0] * t, routed, 0.0, "stop", None)
        for i in range(rows)
    ]
    batch = to_batch(episodes, run.algo.r3, overlong_filter=False)
    batch.extras["advantages"] = torch.ones(rows)
    loss = run.algo.loss
    if loss.kl_coef > 0:
        batch.extras["ref_logprobs"] = torch.zeros(rows, t)
    if not (run.algo.ppo_epochs == 1 and run.algo.mini_batches == 1 and not (loss.kl_coef > 0 and loss.kl_in_reward)):
        batch.extras["old_logprobs"] = torch.zeros(rows, t)
    return batch


def held(policy) -> dict[str, list[torch.Tensor]]:
    """What ``policy`` holds at rest, by category: its models' parameters and buffers, separate fp32 masters, the
    optimizer's state; with ``policy.cpu_offload`` the masters, the optimizer's state and FSDP's trained shards (the
    masters themselves) are host memory."""
    models = [m for m in (policy.model, policy.ref_model) if m is not None]
    weights = [t for m in models for t in (*m.parameters(), *m.buffers())]
    ids = {id(t) for t in weights}
    masters = [] if policy.master is None else [p for p in policy.master.parameters() if id(p) not in ids]
    state = [v for st in policy.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    if not policy.cfg.cpu_offload:
        return {"weights": weights, "masters": masters, "optimizer": state}
    shards = [p for p in policy.model.parameters() if isinstance(p, DTensor) and p.requires_grad]
    shard_ids = {id(p) for p in shards}
    return {"weights": [t for t in weights if id(t) not in shard_ids], "host": [*shards, *masters, *state]}


class _MastersCounted:
    """While alive, ``master``'s gradient copies count a parameter's gradient as a gradient, and make its master's
    as ``category`` (host memory under ``policy.cpu_offload``: there a master's gradient is made in host memory;
    a plan's CPU-traced policy makes it beside the model's, and counting it on the device would place the step's
    peak at that copy rather than at the backward's end). ``remove`` ends it."""

    def __init__(self, master, memory: Memory, category: str):
        self.master, self.memory, self.category = master, memory, category
        self.to_master = master.grad_to_master
        master.grad_to_master = self  # the instance's: grads_to_master and the step in the backward call it

    def __call__(self, name: str, kept: bool = True) -> None:
        self.memory.regard([self.master.model_params[name].grad], "gradients")
        made, self.memory.made_as = self.memory.made_as, self.category
        try:
            self.to_master(name, kept)
        finally:
            self.memory.made_as = made

    def remove(self) -> None:
        del self.master.grad_to_master


def count_the_step(policy, memory: Memory) -> list:
    """Hooks on ``policy``'s optimizer and masters (remove them after): the model's gradients are counted as
    gradients as they go to the masters, and as its step begins so are the gradients it steps (the policy drops
    them after the step), or as host memory where the optimizer runs there (``policy.cpu_offload``), as is what its
    step makes."""
    host = policy.cfg.cpu_offload

    def before(optimizer, args, kwargs) -> None:
        memory.regard([p.grad for p in policy.trained.values()], "host" if host else "gradients")
        memory.regard([p.grad for p in policy.trainable.values()], "gradients")
        if host:
            memory.made_as = "host"

    def after(optimizer, args, kwargs) -> None:
        memory.made_as = "activations"

    hooks = [policy.optimizer.register_step_pre_hook(before), policy.optimizer.register_step_post_hook(after)]
    if policy.master is not None:
        hooks.append(_MastersCounted(policy.master, memory, "host" if host else "gradients"))
    return hooks


def make_state(policy) -> None:
    """The state as after a first step: FSDP's units set up (their shards re-made as their first forward does) and
    the optimizer's moments made; the weights unchanged in shape."""
    from moerl.parallel.fsdp import gathered

    with gathered(*policy.layout.roots):
        pass
    trained = list(policy.trained.values())
    for p in trained:
        p.grad = torch.zeros_like(p)
    policy.optimizer.step()
    for p in trained:
        p.grad = None


@contextmanager
def peers_vote_alike():
    """torch's pipeline schedules agree on how their stages learn each other's shapes by a vote passed from stage to
    stage; on a fake world no vote arrives. Inside this block every stage takes the vote its own rank casts (the
    plan's peers are alike: a real moerl pipeline, whose stages give complete static shapes, votes static)."""
    from torch.distributed.pipelining import _utils, schedules

    InferenceMode = getattr(_utils, "InferenceMode", None)
    original = getattr(schedules._PipelineSchedule, "_warmup_p2p", None)
    if InferenceMode is None or original is None:  # torch before 2.12 has no vote
        yield
        return

    def vote(self, stages, has_backward, p2p_done):
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = vote
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


EXACT_LAYERS = 6  # a rank holding at most this many layers is traced whole; deeper ones by depth (moerl.plan.depth)


def trace_rank(
    cfg: ModelConfig,
    run: RunConfig,
    rank: int = 0,
    hf: dict | None = None,
    gpu: bool = True,
    exact: bool | None = None,
) -> RankTrace:
    """Trace trainer rank ``rank`` of ``run`` (its ``parallel.*`` on a fake world of that size) training a step of
    its worst-case batch; the memory it holds (see the module docstring). ``gpu``: through the code paths moerl
    takes on an sm90 GPU (``moerl.device.gpu_paths``), else the CPU's. ``exact``: trace every layer (default: when
    the rank holds at most ``EXACT_LAYERS``, or two interleaved stages), else two layers of each kind and extrapolate
    (``moerl.plan.depth``)."""
    from moerl.plan import depth

    ranges = depth.stage_ranges(cfg, run)
    held_kinds = depth.counts(cfg, ranges, depth.my_stages(run, rank, len(ranges)))
    if exact is None:  # two stages on a rank (interleaved) peak where their schedules overlap: not linear in depth
        exact = len(held_kinds) > 1 or sum(n for c in held_kinds.values() for n in c.values()) <= EXACT_LAYERS
    if exact:
        return _trace(cfg, run, rank, hf, gpu)
    two = {s: {k: min(n, depth.BASE) for k, n in c.items()} for s, c in held_kinds.items()}
    base = _trace(*depth.cut(cfg, run, ranges, two), rank, hf, gpu)
    steps = []
    for s, c in held_kinds.items():
        for k, n in c.items():
            if n > depth.BASE:
                more = {t: dict(v) for t, v in two.items()}
                more[s][k] = depth.BASE + 1
                steps.append((_trace(*depth.cut(cfg, run, ranges, more), rank, hf, gpu), n - depth.BASE))
    return RankTrace(
        rank,
        base.stages,
        base.ep_rank,
        depth.combine(base.peak, [(t.peak, n) for t, n in steps]),
        depth.combine(base.end, [(t.end, n) for t, n in steps]),
        depth.combine(base.sync, [(t.sync, n) for t, n in steps]),
        base.sent + sum(n * (t.sent - base.sent) for t, n in steps),
        base.seconds + sum(t.seconds for t, _ in steps),
        base.float_reads,
        base.assumed,
    )


# cuBLAS's workspace, which torch takes from its caching allocator for each thread that runs GEMMs on a device (a
# step's and autograd's): 32 MiB each on sm90 (a LoRA step, the first in a process on an H200, held 64 MiB beside its
# weights, optimizer state and gradients: benchmarks/plan_peak_cuda.py), torch's default of 8 MiB + 128 KiB elsewhere
GEMM_THREADS = 2


def gemm_workspace(capability: tuple[int, int]) -> int:
    """Bytes of cuBLAS workspace for one thread's GEMMs on a GPU of ``capability``."""
    return 32 * 2**20 if capability[0] == 9 else 8 * 2**20 + 128 * 2**10


def _trace(cfg: ModelConfig, run: RunConfig, rank: int, hf: dict | None, gpu: bool) -> RankTrace:
    """``trace_rank`` of every layer."""
    from moerl.sync.weights import buckets
    from moerl.trainer.losses import make_policy_loss
    from moerl.trainer.policy import Policy

    p = run.parallel
    pipeline = {"schedule": p.schedule, "microbatches": p.microbatches, "stages": p.stages or None}
    world = fake_world(p.dp, p.ep, p.pp, rank, cp=p.cp, **pipeline)
    policy_cfg = replace(run.policy, compile=False, device="cpu")
    start = time.perf_counter()
    try:
        batch = worst_batch(cfg, run, traced_rows(run, world))
        with Shapes() as shapes, peers_vote_alike(), gpu_paths() if gpu else nullcontext():
            policy = Policy(".", policy_cfg, world, build=plan_model(cfg, hf))
            make_state(policy)
            # a GPU rank's GEMM workspaces: made at its first GEMMs, kept while the process lives (temporaries' kind)
            workspace = gemm_workspace(capability(torch.device("cuda"))) if gpu else 0
            scratch = [torch.empty(workspace, dtype=torch.uint8) for _ in range(GEMM_THREADS)] if gpu else []
            with Memory(held(policy) | {"activations": scratch}) as memory:
                loss = run.algo.loss
                hooks = count_the_step(policy, memory)
                policy.train_step(batch, make_policy_loss(loss), replay=run.algo.r3, entropy=loss.entropy)
                for hook in hooks:
                    hook.remove()
            engine = Elsewhere()
            # sync_policy's stream, its values unchecked (the step dropped its gradients)
            with Memory(held(policy) | {"activations": scratch}) as sync:
                bucket_bytes = run.rollout.sync_bucket_mb * 2**20
                for bucket in buckets(policy.sync_tensors(part_bytes=bucket_bytes), bucket_bytes):
                    engine.stage_weights(bucket)
            stages = list(policy.layout.pipeline.plan.stages) if policy.layout.pipeline is not None else [0]
    finally:
        world.close()
    return RankTrace(
        rank,
        stages,
        world.ep_rank,
        memory.peak.copy(),
        memory.now.copy(),
        sync.peak.copy(),
        engine.sent,
        time.perf_counter() - start,
        shapes.float_reads,
        shapes.assumed,
    )
