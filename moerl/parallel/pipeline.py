"""Pipeline parallelism with R3, on ``torch.distributed.pipelining``, applied from outside the model.

The layers are split into stages (balanced by parameter count, or as ``parallel.stages`` says); each rank keeps its
stages' layers (the others become placeholders, the embedding lives on the first stage, the norm and head on the last).
Every rank of a pipeline holds the step's whole batch (rank 0 announces it) and splits it into the same micro-batches,
so what travels between stages with a micro-batch is its hidden states alone (each stage runs its forwards in
micro-batch order, in every schedule, and takes the next micro-batch's rows itself): from the rows each stage reads its
own inputs — the first stage the token ids, every stage the attention mask and R3's routed experts of *its* MoE layers
only (the columns of the global MoE layer indices it holds; -1 rows still route themselves), the last stage the loss
mask, advantages and the engine's logprobs. Old-logprob and training forwards replay; the reference forward never does.

With dp / ep > 1 there is one pipeline per data rank: each takes its share of the batch's rows, and every pipeline
runs as many micro-batches of the same size (FSDP's gathers and the expert exchange pair up across the stage's data
group). Each stage is its own FSDP root (``fsdp.shard_model`` on its ``StageModule``), so the schedule reduces its
gradients once, after the last micro-batch.

Tied input and output embeddings: the last stage holds a copy of the embedding for its head. The copy starts equal
to the first stage's weight, gets the same gradient (the two stages add theirs, ``Pipeline.tie_grads``) and so the same
optimizer step; it is left out of everything that counts or writes a weight once (gradient norm, checkpoints, weight
sync, export).

A step's batch is padded to equal micro-batches with stand-in rows (index -1) whose loss is zero. The stages are
built per call with static shapes (the sequence length changes between steps), so no metadata is pickled between
ranks.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from moerl.errors import ConfigError
from moerl.model.transformer import MoEModel
from moerl.parallel.plan import check_layout
from moerl.parallel.world import World, broadcast_bytes, broadcast_json, local

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}


def stages_per_rank(schedule: str) -> int:
    """Interleaved 1F1B runs two stages on every rank (rank r holds stages r and r + pp)."""
    return 2 if schedule == "interleaved_1f1b" else 1


def split_layers(model: MoEModel, n_stages: int, given: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges of ``n_stages`` stages: ``given`` layer counts, or the split whose largest stage has
    the fewest parameters (the embedding counted on the first stage, the norm and head on the last). No stage starts
    at a layer that reads what an earlier one handed on (``ModelConfig.stage_bound``: GLM-5's shared indexer layers,
    the second of LongCat-Flash's pairs)."""
    n = len(model.layers)
    shared = model.config.stage_bound()
    if given:  # checked by check_layout
        bounds = [0, *torch.tensor(given).cumsum(0).tolist()]
        starts = [b for b in bounds[1:-1] if b in shared]
        if starts:
            why = (
                "keeps the keys the indexer layer before it chose (index_shared_layers); start each stage at a "
                "layer with an indexer"
                if starts[0] in model.config.index_shared_layers
                else "adds the MoE output of the layer before it (moe_shortcut: LongCat-Flash's pairs); start each "
                "stage at an even layer"
            )
            raise ConfigError(f"parallel.stages={list(given)}: a stage starts at layer {starts[0]}, which {why}")
        return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    # adapters not counted: a rank plans its stages before they are attached (HeldStages) as after
    cost = [sum(p.numel() for n, p in layer.named_parameters() if ".lora." not in n) for layer in model.layers]
    cost[0] += model.embed_tokens.weight.numel()
    cost[-1] += sum(p.numel() for m in (model.norm, model.lm_head) if m is not None for p in m.parameters())
    if model.config.tie_word_embeddings:  # the last stage's copy of the embedding, for its head
        cost[-1] += model.embed_tokens.weight.numel()
    prefix = [0, *torch.tensor(cost).cumsum(0).tolist()]
    # best[s][i]: the smallest largest-stage cost of the first i layers in s stages; cut[s][i] its last cut
    best = [[math.inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if j in shared:
                    continue
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    if best[n_stages][n] == math.inf:
        raise ConfigError(
            f"{n_stages} pipeline stages: the model has fewer layers a stage can start at (not reading an earlier "
            "layer's keys or MoE output: ModelConfig.stage_bound)"
        )
    ends, i = [], n
    for s in range(n_stages, 0, -1):
        ends.append(i)
        i = cut[s][i]
    bounds = [0, *reversed(ends)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class _Hole(nn.Module):
    """Another stage's layer."""


def _keep(model: MoEModel, layers: set[int], first: bool, last: bool) -> MoEModel:
    """``model`` with only ``layers`` (the others placeholders), the embedding only if ``first`` (or ``last`` with
    tied embeddings: the head's weight), the norm and head only if ``last`` — in place."""
    for i in range(len(model.layers)):
        if i not in layers:
            model.layers[i] = _Hole()
    if not (first or (last and model.config.tie_word_embeddings)):
        model.embed_tokens = None
    if not last:
        model.norm, model.lm_head, model.lm_head_bias = None, None, None
    model.moe_layer_ids = [i for i in model.moe_layer_ids if i in layers]
    return model


@dataclass(slots=True)
class Plan:
    """This rank's stages: their indices and layer ranges, and every stage's range."""

    stages: list[int]
    ranges: list[range]  # of every stage, in order

    @property
    def layers(self) -> set[int]:
        return {i for s in self.stages for i in self.ranges[s]}

    def owner(self, layer: int) -> int:
        return next(s for s, r in enumerate(self.ranges) if layer in r)


def plan_stages(model: MoEModel, world: World, schedule: str, given: list[int] | None) -> Plan:
    """Which stages (and layers) this rank holds."""
    check_layout(world.dp, world.ep, world.pp, model.config, schedule, given)
    per_rank = stages_per_rank(schedule)
    n_stages = world.pp * per_rank
    ranges = split_layers(model, n_stages, given)
    return Plan([world.stage + k * world.pp for k in range(per_rank)], ranges)


class HeldStages:
    """What a pipeline rank loads of a checkpoint (``read_model``'s ``keep``): on the model still on the meta device,
    this rank's stages are planned and the others pruned, so their layers are neither allocated nor read. ``plan``
    is then the plan ``parallelize`` splits by: the pruned model cannot be planned again."""

    def __init__(self, world: World):
        self.world = world
        self.plan: Plan | None = None

    def __call__(self, model: MoEModel) -> None:
        self.plan = plan_stages(model, self.world, self.world.schedule, self.world.stages)
        prune(model, self.plan)


def prune(model: MoEModel, plan: Plan) -> MoEModel:
    """Keep this rank's stages of ``model`` (in place)."""
    last = len(plan.ranges) - 1
    return _keep(model, plan.layers, 0 in plan.stages, last in plan.stages)


def stage_view(model: MoEModel, plan: Plan, stage: int) -> MoEModel:
    """A view of the pruned ``model`` that runs stage ``stage`` only (modules and parameters shared, hooks its own:
    FSDP's on one stage must not run on another)."""
    view = MoEModel.__new__(MoEModel)
    nn.Module.__init__(view)
    fresh = set(view.__dict__)
    view.__dict__.update({k: v for k, v in model.__dict__.items() if k not in fresh})
    view._parameters, view._buffers, view._modules = dict(model._parameters), dict(model._buffers), dict(model._modules)
    view.training = model.training
    view.layers = nn.ModuleList(layer for layer in model.layers)
    return _keep(view, set(plan.ranges[stage]), stage == 0, stage == len(plan.ranges) - 1)


def tied_copy(model: MoEModel, plan: Plan) -> bool:
    """Whether this rank's ``embed_tokens.weight`` is the last stage's copy of the first stage's (tied embeddings)."""
    return model.config.tie_word_embeddings and 0 not in plan.stages and len(plan.ranges) - 1 in plan.stages


class Step:
    """What every stage of one pipeline call reads: the batch and the forward's options."""

    def __init__(self, batch, replay: bool, adapters, temperature: float, entropy: bool, unpadded: bool = False):
        """``unpadded``: no row of ``batch`` has padding (the model then attends plainly causally, with no mask)."""
        self.batch, self.replay, self.adapters = batch, replay, adapters
        self.temperature, self.entropy, self.unpadded = temperature, entropy, unpadded

    def rows(self, rows: torch.Tensor):
        """The micro-batch of row indices ``rows`` (-1: a stand-in row, its loss mask zero)."""
        mb = self.batch.rows(rows.clamp(min=0))
        if (rows < 0).any():
            from dataclasses import replace

            mb = replace(mb, loss_mask=mb.loss_mask * (rows >= 0)[:, None])
        return mb


class StageModule(nn.Module):
    """One stage for ``PipelineStage``: (rows) or (hidden) in; (hidden) or the logprobs out. A stage after the first
    takes its micro-batches' rows from ``queue`` (the call's micro-batches, in order)."""

    def __init__(self, view: MoEModel, columns: list[int], first: bool, last: bool, logprobs):
        super().__init__()
        self.view, self.columns, self.first, self.last = view, columns, first, last
        self.logprobs = logprobs  # (micro-batch, temperature, entropy) -> the head of the last stage's forward
        self.step: Step | None = None
        self.queue: list[torch.Tensor] = []

    def forward(self, inputs: torch.Tensor):
        hidden, rows = (None, inputs) if self.first else (inputs, self.queue.pop(0))
        step = self.step
        mb = step.rows(rows)
        replay = None
        if step.replay and mb.replay is not None and self.columns:
            replay = mb.replay.index_select(2, torch.tensor(self.columns, device=mb.replay.device))
        head = self.logprobs(mb, step.temperature, step.entropy) if self.last else None
        out = self.view(
            mb.input_ids, attention_mask=None if step.unpadded else mb.attention_mask, replay=replay,
            adapters=step.adapters, hidden=hidden,
            head=head,
        )  # fmt: skip
        if not self.last:
            return out.hidden
        lp, ent = out.head
        return (lp, ent) if step.entropy else lp


class Pipeline:
    """This rank's stages of the policy's model and the schedule that runs a batch through them."""

    def __init__(self, model: MoEModel, plan: Plan, world: World, schedule: str, microbatches: int, logprobs, device):
        self.plan, self.world, self.schedule, self.microbatches = plan, world, schedule, microbatches
        self.device = torch.device(device)
        self.group = world.group("pp")
        self.last_stage = len(plan.ranges) - 1
        self.tied = model.config.tie_word_embeddings
        self.copy = tied_copy(model, plan)  # this rank's embedding is the last stage's copy
        routed = model.config.route_layers()  # the layer of each of R3's columns, over the whole model
        self.modules = []
        for s in plan.stages:
            view = stage_view(model, plan, s)
            columns = [j for j, i in enumerate(routed) if i in plan.ranges[s]]
            self.modules.append(StageModule(view, columns, s == 0, s == self.last_stage, logprobs))

    @property
    def last(self) -> bool:
        """Whether this rank holds the last stage (the logprobs and the loss live there)."""
        return self.last_stage in self.plan.stages

    def _count(self, rows: int, micro_batch_size: int) -> int:
        n = max(self.microbatches or len(self.plan.ranges), math.ceil(rows / micro_batch_size))
        if self.schedule == "interleaved_1f1b":
            n = math.ceil(n / self.world.pp) * self.world.pp
        return n

    def run(self, step: Step, rows: torch.Tensor, width: int, micro_batch_size: int, hidden_dtype, loss_fn=None):
        """Run ``rows`` of ``step.batch`` through the pipeline (forward and, with ``loss_fn(output, rows)``,
        backward), padded to ``width`` rows (the data group's largest share: every pipeline of the group runs the
        same micro-batches). Returns the last stage's outputs for the real rows (None on other stages)."""
        n = self._count(width, micro_batch_size)
        size = max(1, math.ceil(width / n))
        padded = torch.cat([rows, rows.new_full((n * size - len(rows),), -1)])
        t = step.batch.input_ids.shape[1]
        hidden = self.modules[0].view.config.hidden_size
        for module in self.modules:
            module.step, module.queue = step, list(padded.split(size))
        grad = loss_fn is not None  # static metadata: the float activations carry gradients when training

        def act(*shape, dtype=torch.float32):
            return torch.empty(*shape, dtype=dtype, device=self.device, requires_grad=grad)

        stages = []
        for module, s in zip(self.modules, self.plan.stages, strict=True):
            ins = (padded.new_empty(size),) if s == 0 else (act(size, t, hidden, dtype=hidden_dtype),)
            if s == self.last_stage:
                outs = (act(size, t), act(size, t)) if step.entropy else act(size, t)
            else:
                outs = act(size, t, hidden, dtype=hidden_dtype)
            stages.append(PipelineStage(module, s, len(self.plan.ranges), self.device, ins, outs, group=self.group))
        cls = SCHEDULES[self.schedule]
        sched = cls(
            stages if len(stages) > 1 or cls is ScheduleInterleaved1F1B else stages[0],
            n,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        first = 0 in self.plan.stages
        args = (padded,) if first else ()
        kwargs = {"target": padded} if loss_fn is not None and self.last else {}
        if loss_fn is None:
            with torch.no_grad():
                out = sched.eval(*args, **kwargs)
        else:
            out = sched.step(*args, **kwargs)
        if not self.last:
            return None
        if isinstance(out, tuple):
            return tuple(o[: len(rows)] for o in out)
        return out[: len(rows)]

    @torch.no_grad()
    def tie_grads(self, param: torch.Tensor | None) -> None:
        """Tied embeddings: the first stage's embedding and the last stage's copy each get the sum of both
        gradients (this rank's part; the same part on both ends), bit for bit the same on both; other ranks
        and untied models: nothing. ``param``: this rank's embedding weight (None when it does not train)."""
        me, ends = dist.get_rank(self.group), (0, self.world.pp - 1)
        if not self.tied or param is None or me not in ends:
            return
        peer = dist.get_global_rank(self.group, ends[1] if me == ends[0] else ends[0])
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        mine = local(param.grad)
        theirs = torch.empty_like(mine)
        ops = [
            dist.P2POp(dist.isend, mine.contiguous(), peer, self.group),
            dist.P2POp(dist.irecv, theirs, peer, self.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        mine.add_(theirs)  # a + b on one end, b + a on the other: the same bits

    def from_last(self, t: torch.Tensor | None, shape, dtype=torch.float32) -> torch.Tensor:
        """The last stage's tensor ``t`` on every rank of this pipeline."""
        if self.world.pp == 1:
            return t
        src = dist.get_global_rank(self.group, self.last_stage % self.world.pp)
        buf = t.contiguous() if t is not None else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src, group=self.group)
        return buf

    def whole_names(self, own: list[str]) -> list[str]:
        """Every stage's names (``own``: this rank's), in the whole model's order: the embedding, the layers by
        number, then the rest (a collective over this pipeline: a rank loaded with its stages only knows its own)."""
        me, every = dist.get_rank(self.group), []
        for src in range(self.world.pp):
            every += broadcast_json(own if src == me else None, dist.get_global_rank(self.group, src), self.group)

        def place(name: str) -> tuple[int, int]:
            layer = re.match(r"layers\.(\d+)\.", name)
            return (1, int(layer.group(1))) if layer else (0, 0) if name.startswith("embed_tokens.") else (2, 0)

        return sorted(dict.fromkeys(every), key=place)  # stable: a layer's names keep their order

    def share_json(self, value=None):
        """The last stage's JSON-able ``value`` on every rank of this pipeline (bytes, not pickles)."""
        return broadcast_json(value, dist.get_global_rank(self.group, self.last_stage % self.world.pp), self.group)

    def stream(self, own):
        """Every stage's named tensors (``own``: this rank's ``(name, tensor)`` pairs), stage by stage, one tensor at a
        time, on every rank of this pipeline (a collective: every rank runs it to the end)."""
        me = dist.get_rank(self.group)
        for src in range(self.world.pp):
            root = dist.get_global_rank(self.group, src)
            items = iter(own) if src == me else None
            while True:
                item = next(items, None) if items is not None else None
                head = {"end": True}  # another stage's: its own replaces it (on a fake world it ends that stage's)
                if item is not None:
                    head = {"name": item[0], "dtype": str(item[1].dtype)[6:], "shape": list(item[1].shape)}
                head = json.loads(broadcast_bytes(json.dumps(head).encode(), root, self.group))
                if head.get("end"):
                    break
                dtype = getattr(torch, head["dtype"])  # sent as bytes: gloo has no float8 (MXFP8's data and scales)
                if items is not None:
                    raw = item[1].contiguous().reshape(-1).view(torch.uint8)
                else:
                    size = math.prod(head["shape"]) * dtype.itemsize
                    raw = torch.empty(size, dtype=torch.uint8, device=self.device)  # the sender's device: one backend
                dist.broadcast(raw, root, group=self.group)
                yield head["name"], raw.view(dtype).reshape(head["shape"])
