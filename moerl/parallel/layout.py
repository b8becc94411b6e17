"""The Layout: how this rank holds the trained model, and every operation whose form depends on it.

``parallelize(model, world, cfg)`` splits the model from outside, as torchtitan's ``parallelize_fn`` does: layers
into pipeline stages, experts over the ep group, the rest FSDP over the data group. The returned ``Layout`` owns the
stages, the FSDP roots, the expert slices, the tied copies and the device, and answers what the trainer, checkpoints
and weight sync ask of a split model: a tensor whole or laid out by name, every stage's tensors streamed, gradients
reduced and clipped over every placement, a batch run as micro-batches or through the pipeline, rows gathered. One
process is a Layout too, where each of these is the plain single-process operation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from moerl.errors import ConfigError
from moerl.parallel.checkpointing import apply_checkpointing
from moerl.parallel.context import ContextSplit, check_context
from moerl.parallel.expert import shard_experts, whole_experts
from moerl.parallel.fsdp import clip_grads, gathered, shard_model
from moerl.parallel.pipeline import HeldStages, Pipeline, Plan, Step, plan_stages, prune
from moerl.parallel.rows import Split, gather_rows, share, split_rows, sum_over_ranks
from moerl.parallel.world import World, agreed_min, full, like, local

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # (micro-batch) -> (logprobs, entropy or None)
Loss = Callable[..., tuple[torch.Tensor, dict[str, float]]]  # (logprobs, micro-batch, entropy) -> (loss, metrics)


@dataclass(slots=True)
class LayoutConfig:
    """What the split needs to know of the training: whether the model's own weights train through fp32 masters
    (``masters``: they are sharded and gathered in ``dtype``; else only what trains is sharded, e.g. adapters), the
    compute dtype, the micro-batch size, and the pipeline's last-stage head: ``head(micro-batch, temperature,
    entropy)`` gives the ``head`` the last stage's model takes (its result: (logprobs, entropy or None))."""

    masters: bool
    dtype: torch.dtype
    micro_batch_size: int
    head: Callable
    checkpointing: str = "none"  # each decoder block recomputed in the backward: none | full | selective
    max_tokens: int = 0  # tokens a micro-batch may hold (0: micro_batch_size alone cuts them)
    packed: bool = True  # whether micro-batches run packed (their tokens, not rows x width, count)
    stages: Plan | None = None  # the pipeline stages the model was loaded with (``HeldStages``); None: plan them
    offload: bool = False  # FSDP's shards and their gradients in host memory (``policy.cpu_offload``)


def storage_dtype(world: World, masters: bool, dtype: torch.dtype) -> torch.dtype:
    """The dtype to load the model in: a sharded model whose weights train through ``masters`` holds the fp32
    masters as its own parameters (FSDP gathers them in the compute dtype); otherwise the compute dtype."""
    return torch.float32 if world.shard_size > 1 and masters else dtype


def held_stages(world: World) -> HeldStages | None:
    """What a rank of ``world`` keeps of a checkpoint as it loads it (``read_model``'s ``keep``): its pipeline
    stages, planned on the model still on the meta device; None where one stage holds every layer."""
    return HeldStages(world) if world.pp > 1 else None


def parallelize(model: torch.nn.Module, world: World, cfg: LayoutConfig) -> Layout:
    """Split ``model`` (in place) over ``world`` and return its Layout. Trainable flags must be set before: FSDP
    leaves frozen parameters replicated."""
    check_context(world.cp, world.pp, model.config)
    layout = Layout(model, world, cfg)
    if cfg.checkpointing != "none":
        if model.config.index_shared_layers:
            raise ConfigError(
                f"policy.activation_checkpointing={cfg.checkpointing} with a model whose layers reuse an earlier "
                f"indexer's choice (index_shared_layers {model.config.index_shared_layers}): recomputing them is not "
                "built; set it to none"
            )
        apply_checkpointing(model, cfg.checkpointing)
    if world.pp > 1:
        plan = cfg.stages or plan_stages(model, world, world.schedule, world.stages)
        prune(model, plan)
        layout.pipeline = Pipeline(model, plan, world, world.schedule, world.microbatches, cfg.head, layout.device)
        layout.copies = {"embed_tokens.weight"} if layout.pipeline.copy else set()
    if world.shard_size == 1:
        return layout
    if world.ep > 1:
        layout.sliced = shard_experts(model, world)
        params = dict(model.named_parameters())
        for name in layout.sliced:  # plain tensors in the compute dtype, fp32 masters (as in one process)
            p = params[name]
            if p.requires_grad and p.dtype != cfg.dtype and cfg.masters:
                layout.initial[name] = p.detach()
                p.data = p.data.to(cfg.dtype)
    keep = {dict(model.named_parameters())[n] for n in layout.sliced}
    for root in layout.roots:  # the model, or each pipeline stage as its own FSDP root
        view = root.view if layout.pipeline is not None else root
        shard_model(view, cfg.dtype, cfg.masters, world.data_mesh, keep, root=root, offload=cfg.offload)
    return layout


class Layout:
    """This rank's part of the model and how the parts fit (see the module docstring). Built by ``parallelize``."""

    def __init__(self, model: torch.nn.Module, world: World, cfg: LayoutConfig):
        self.model, self.world, self.cfg = model, world, cfg
        self.device = next(model.parameters()).device
        self.pipeline: Pipeline | None = None  # this rank's pipeline stages (pp > 1)
        self.sliced: dict[str, int] = {}  # expert-parallel slices: parameter name -> expert dim
        self.copies: set[str] = set()  # weights held as a copy of another stage's (a tied embedding's)
        self.initial: dict[str, torch.Tensor] = {}  # fp32 values of slices now held in the compute dtype
        self._split_models: dict[int, ContextSplit] = {}  # cp > 1: each model's forward on this rank's tokens

    @property
    def ranks(self) -> int:
        return self.world.size

    @property
    def roots(self) -> list[torch.nn.Module]:
        """What FSDP shards as a whole: the model, or each of this rank's pipeline stages."""
        return list(self.pipeline.modules) if self.pipeline is not None else [self.model]

    # --- tensors by name -------------------------------------------------------------------------------------

    def global_view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (this rank's part of weight ``name`` or of its state) as a tensor that knows its place in the whole:
        FSDP's DTensors as they are, an expert slice as a DTensor sharded over the ep ranks, anything else whole
        (replicated, or held by one pipeline stage). Every question about a tensor's placement goes through it."""
        dim = self.sliced.get(name)
        if dim is None or t.ndim == 0:
            return t
        return DTensor.from_local(t, self.world.mesh["ep"], [Shard(dim)], run_check=False)

    def own_part(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The inverse of ``global_view``: how this rank holds weight ``name`` (an expert slice as its own plain
        tensor, the rest as they are)."""
        return t.to_local().clone() if name in self.sliced and isinstance(t, DTensor) else t

    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of weight ``name`` (or of its optimizer state) from this rank's part ``t``: a collective
        when the model is sharded."""
        return full(self.global_view(name, t))

    def in_rows(self, name: str, t: torch.Tensor) -> bool:
        """Whether weight ``name`` (``t``: this rank's part) is split over ranks along its first dim (FSDP's shard, or
        an expert-parallel slice of an MoE layer's experts) and has rows (2-D or more): a sync sends it in parts
        (``row_parts``), never whole on one rank."""
        view = self.global_view(name, t)
        return (
            isinstance(view, DTensor)
            and view.ndim >= 2
            and view.device_mesh.ndim == 1
            and view.placements == (Shard(0),)
        )

    def row_parts(
        self, name: str, t: torch.Tensor, form: Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]], max_bytes: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key@first_row, rows)`` for weight ``name`` (``t``: this rank's part) split over ranks by rows: every
        rank's rows in turn, at most ``max_bytes`` of them at a time (one row at least), each made by the rank that
        holds them into what a sync sends (``form``: rows -> ``[(key, tensor of those rows)]``, e.g. MX data and
        scales). The first rank of the ranks that split ``name`` gets them all and yields them (a collective, as
        ``whole`` is: that rank is the driver, or the one a pipeline stage streams from); the others send their own
        rows and yield nothing. See ``moerl.sync.parts``."""
        from moerl.sync.parts import part_name

        view, mine = self.global_view(name, t), local(t).detach()
        mesh, rows = view.device_mesh, view.shape[0]
        group, me, ranks = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        per = math.ceil(rows / ranks)  # torch.chunk's split: FSDP's and the expert slices' (which divide evenly)
        if mine.shape[0] != min((me + 1) * per, rows) - min(me * per, rows):
            raise RuntimeError(f"{name}: rank {me} of {ranks} holds {mine.shape[0]} of its {rows} rows")
        if not mine.shape[0]:
            return
        sample = form(mine.new_empty((1, *mine.shape[1:]), device="meta"))  # the forms' keys, row shapes, dtypes
        row_bytes = sum(f[0].numel() * f.element_size() for _, f in sample)
        step = max(1, max_bytes // max(row_bytes, 1))
        for r in range(ranks) if me == 0 else [me]:
            first, end = min(r * per, rows), min((r + 1) * per, rows)
            for a in range(first, end, step):
                b = min(a + step, end)
                if r == me:  # made here, a part at a time (offloaded masters: on the device, a part at a time)
                    parts = form(mine[a - first : b - first].to(self.device))
                    if me != 0:
                        for _, part in parts:
                            dist.send(_wire(part.contiguous()), dist.get_global_rank(group, 0), group=group)
                        continue
                else:
                    parts = [
                        (k, torch.empty((b - a, *f.shape[1:]), dtype=f.dtype, device=self.device)) for k, f in sample
                    ]
                    for _, part in parts:
                        dist.recv(_wire(part), dist.get_global_rank(group, r), group=group)
                yield from ((part_name(key, a), part) for key, part in parts)

    def laid_out(self, name: str, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A whole tensor ``value`` of weight ``name`` (or of its optimizer state) as this rank holds ``param``."""
        return self.own_part(name, like(self.global_view(name, param), value))

    def experts_held(self) -> dict[str, range]:
        """The experts this rank holds of each expert-parallel slice, by parameter name (e.g. to open only their
        tensors of a checkpoint: ``moerl.bridges.checkpoint.names_held``)."""
        out = {}
        for name in self.sliced:
            module = self.model.get_submodule(name.rsplit(".", 1)[0].removesuffix(".lora"))
            out[name] = range(module.ep.first, module.ep.first + module.ep.local)
        return out

    def whole_shape(self, name: str, param: torch.Tensor) -> torch.Size:
        """The shape of weight ``name`` whole (``param`` is this rank's part)."""
        return self.global_view(name, param).shape

    def everywhere(self, parts: Iterable[tuple[str, str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, whole tensor)`` for every stage's ``(key, weight name, this rank's part)`` — tied copies left out
        (their original is there) — one tensor at a time, on every rank (a collective: every rank runs it to the
        end). One pipeline stage: this rank's own, made whole."""
        return self.stream((key, self.whole(name, t)) for key, name, t in parts if name not in self.copies)

    def stream(self, own: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's ``(name, tensor)`` (``own``: this rank's, already whole over its data group), stage by stage,
        on every rank of the pipeline (a collective); one stage: ``own``."""
        return iter(own) if self.pipeline is None else self.pipeline.stream(own)

    def gathered_here(self, base: bool = True):
        """A context in which this rank's parameters are whole: FSDP shards and expert slices gathered (``base=False``:
        the expert adapters' slices only, the frozen expert weights stay sliced)."""
        return _both(gathered(*self.roots), whole_experts(self.model, self.world, base))

    @contextmanager
    def gathered(self, trained: dict[str, torch.Tensor], build: Callable[[], torch.nn.Module]):
        """A context with the model whole. One pipeline: this rank's parameters gathered (``gathered_here``). Several
        stages: rank 0 gets ``build()`` (a fresh model of the same kind) with every stage's ``trained`` tensors
        copied in, the other ranks None."""
        if self.pipeline is None:
            with self.gathered_here():
                yield self.model
            return
        weights = dict(self.everywhere((n, n, t) for n, t in trained.items()))
        model = None
        if self.world.driver:
            model = build()
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, t in weights.items():
                    params[name].copy_(t)
        yield model

    # --- running batches ----------------------------------------------------------------------------------------

    def runner(self, model: torch.nn.Module):
        """What runs ``model``'s trainer forwards (the policy's or a reference copy): the model itself, or with
        context parallelism its forward on this rank's part of the tokens (``ContextSplit``)."""
        if self.world.cp == 1:
            return model
        if id(model) not in self._split_models:
            self._split_models[id(model)] = ContextSplit(model, self.world)
        return self._split_models[id(model)]

    def forward(self, step: Step, forward: Forward, stages: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs [B, T] (and entropies) of every row of ``step.batch``, on every rank. ``forward(micro-batch)``
        runs one micro-batch through a whole model; with pipeline stages (and ``stages``) the batch goes through
        them instead."""
        if self.pipeline is not None and stages:
            return self._pipeline_forward(step)
        batch, parts = step.batch, []
        split = self._split(batch)
        for mb, real in split.micro:
            out = forward(mb)
            if real:  # a stand-in row only keeps the ranks' collectives in step
                parts.append(out)
        lp = gather_rows(self.world, [p[0] for p in parts], batch, split.shares)
        return lp, (gather_rows(self.world, [p[1] for p in parts], batch, split.shares) if step.entropy else None)

    def micro_batches(self, batch) -> int:
        """How many micro-batches this rank runs ``batch`` in, outside a pipeline."""
        return len(self._split(batch).micro)

    def _split(self, batch) -> Split:
        return split_rows(self.world, batch, self.cfg.micro_batch_size, self.cfg.max_tokens, self.cfg.packed)

    def backward(self, step: Step, forward: Forward, loss_fn: Loss) -> tuple[float, dict[str, float]]:
        """Forward and backward of every row of ``step.batch`` (each rank its share); the loss and metric sums over
        the batch, on every rank. ``loss_fn(logprobs, micro-batch, entropy)`` is normalised by the whole batch."""
        if self.pipeline is not None:
            total, metrics = self._pipeline_backward(step, loss_fn)
        else:
            total, metrics = self._accumulate(step, forward, loss_fn)
        return sum_over_ranks(self.world, total, metrics)

    def _accumulate(self, step: Step, forward: Forward, loss_fn: Loss) -> tuple[float, dict[str, float]]:
        batch, total, metrics = step.batch, 0.0, {}
        for mb, real in self._split(batch).micro:
            lp, ent = forward(mb)
            loss, m = loss_fn(lp, mb, ent)
            if not real:  # a stand-in row: it only keeps FSDP's collectives in step
                loss, m = loss * 0.0, {k: 0.0 for k in m}
            loss.backward()
            total += float(loss.detach())
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) * len(mb) / len(batch) * real
        return total, metrics

    def _pipeline_rows(self, batch) -> tuple[torch.Tensor, int]:
        """This pipeline's rows of ``batch`` (its data rank's share) and the largest share's size."""
        n = len(batch)
        rows = torch.arange(n, device=batch.input_ids.device)[share(self.world, self.world.data_rank, n)]
        return rows, math.ceil(n / self.world.data_size)

    def _pipeline_size(self, batch) -> int:
        """Rows a pipeline micro-batch holds: ``micro_batch_size`` and, with a token budget, as many rows as it
        takes at the batch's width (a pipeline runs rows padded, unpacked)."""
        size, budget, width = self.cfg.micro_batch_size, self.cfg.max_tokens, batch.input_ids.shape[1]
        if budget:
            if width > budget:
                raise ConfigError(
                    f"policy.max_tokens_per_micro_batch={budget}: a pipeline's micro-batch holds rows of the batch's "
                    f"width, {width} tokens, more than it may; raise it, or shorten rollout.max_model_len (splitting "
                    "a sequence over ranks, context parallelism, is not built)"
                )
            size = min(size, budget // width) if size else budget // width
        return size or len(batch)

    def _pipeline_forward(self, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, pipe = step.batch, self.pipeline
        rows, width = self._pipeline_rows(batch)
        out = pipe.run(step, rows, width, self._pipeline_size(batch), self.cfg.dtype)
        lp, ent = (out if step.entropy else (out, None)) if out is not None else (None, None)
        shape = (len(rows), batch.input_ids.shape[1])
        lp = gather_rows(self.world, [pipe.from_last(lp, shape)], batch)
        return lp, (gather_rows(self.world, [pipe.from_last(ent, shape)], batch) if step.entropy else None)

    def _pipeline_backward(self, step: Step, loss_fn: Loss) -> tuple[float, dict[str, float]]:
        """This pipeline's rows; its loss and metric sums on every rank of the pipeline."""
        batch, pipe = step.batch, self.pipeline
        rows, width = self._pipeline_rows(batch)
        total, metrics = 0.0, {}

        def loss(output, rows):
            nonlocal total
            lp, ent = output if step.entropy else (output, None)
            value, m = loss_fn(lp, step.rows(rows), ent)
            total += float(value.detach())
            real = int((rows >= 0).sum())
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) * real / len(batch)
            return value

        pipe.run(step, rows, width, self._pipeline_size(batch), self.cfg.dtype, loss)
        return tuple(pipe.share_json([total, metrics]))

    # --- gradients ----------------------------------------------------------------------------------------------

    def reduce_grads(self, trained: dict[str, torch.Tensor]) -> None:
        """What the schedule and FSDP leave to do for the gradients of ``trained`` (the optimizer's tensors by name):
        expert slices, replicated over dp and cp, summed over them in fp32; a tied embedding's two ends given the sum
        of both."""
        for dim in ("dp", "cp"):
            if getattr(self.world, dim) == 1:
                continue
            for name in self.sliced:
                p = trained.get(name)
                if p is not None and p.grad is not None:
                    dist.all_reduce(p.grad, group=self.world.group(dim))
        if self.pipeline is not None:
            self.pipeline.tie_grads(trained.get("embed_tokens.weight"))

    def clip_grads(self, trained: dict[str, torch.Tensor], max_norm: float) -> float:
        """Clip the gradients of ``trained`` to a global L2 norm of ``max_norm``, every part counted once; returns
        the norm before."""
        params = list(trained.values())
        if self.world.size == 1:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        slices = {id(trained[n]) for n in self.sliced if n in trained}
        copies = {id(trained[n]) for n in self.copies if n in trained}
        return clip_grads(self.world, params, max_norm, slices, copies)

    def agreed_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. the index of the first bad tensor in a shared list)."""
        return agreed_min(self.world, value)


@contextmanager
def _both(first, second):
    with first, second:
        yield


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a collective sends it: float8 (MXFP8's data and scales) as its bytes, which gloo can send."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t
