"""Policy: the trained model in one of three modes (lora | full | mxfp8), its optimizer and its LR schedule."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from moerl.allocator import reuse_freed_memory
from moerl.bridges import load_model
from moerl.errors import ConfigError, TrainingStopped
from moerl.finite import all_finite
from moerl.model.lora import LoraConfig, attach_lora
from moerl.model.mx import SCALE_MODES
from moerl.parallel.expert import expert_slice, gather_experts, shard_experts, whole_experts
from moerl.parallel.fsdp import clip_grads, gathered, shard_model
from moerl.parallel.pipeline import Pipeline, Step, plan_stages, prune
from moerl.parallel.rows import gather_rows, micro_batches, share, sum_over_ranks
from moerl.parallel.world import World, agreed_min, full, like, local
from moerl.precision import compute_dtype, dtype_name
from moerl.trainer.batch import Batch
from moerl.trainer.optim import SCHEDULES, MasterWeights, lr_lambda
from moerl.trainer.packing import Packing, plan_packing

MODES = ("lora", "full", "mxfp8")

LossFn = Callable[[torch.Tensor, Batch, torch.Tensor | None], tuple[torch.Tensor, dict[str, float]]]


@dataclass(slots=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    schedule: str = "constant"  # constant | cosine (after warmup_steps of linear warm-up)
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        def finite(x) -> bool:
            return isinstance(x, int | float) and math.isfinite(x)

        rules = (
            # AdamW moves each weight by about lr per step: above 1 it is never meant, and large values overflow
            ("lr", finite(self.lr) and 0 < self.lr <= 1, "must lie in (0, 1]"),
            ("weight_decay", finite(self.weight_decay) and self.weight_decay >= 0, "must be finite and >= 0"),
            ("beta1", finite(self.beta1) and 0 <= self.beta1 < 1, "must lie in [0, 1)"),
            ("beta2", finite(self.beta2) and 0 <= self.beta2 < 1, "must lie in [0, 1)"),
            ("eps", finite(self.eps) and self.eps > 0, "must be finite and > 0"),
            ("grad_clip", finite(self.grad_clip) and self.grad_clip >= 0, "must be finite and >= 0 (0 = off)"),
            ("schedule", self.schedule in SCHEDULES, f"allowed: {', '.join(SCHEDULES)}"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("total_steps", self.total_steps >= 1, "must be >= 1"),
            ("min_lr_ratio", finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "must lie in [0, 1]"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise ConfigError(f"optim.{name}={getattr(self, name)!r}: {rule}")


@dataclass(slots=True)
class PolicyConfig:
    mode: str = "lora"
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 8
    dtype: str = "auto"  # compute dtype (lora: the frozen base; full: the model copy): auto | bfloat16 | float32
    reference: bool = False  # full / mxfp8: keep a frozen copy for reference logprobs (lora: adapters off)
    max_nan_steps: int = 3  # consecutive non-finite steps that stop training
    mx_scale_mode: str = "rceil"  # mxfp8: floor | rceil
    packing: bool = True  # forwards run on the micro-batch's sequences packed into fewer rows (moerl.trainer.packing)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"PolicyConfig.mode={self.mode!r}: allowed: {', '.join(MODES)}")
        dtype_name(self.dtype, key="PolicyConfig.dtype")  # auto: bf16 where native, else fp32 (moerl.precision)
        if self.micro_batch_size < 1:
            raise ConfigError(f"PolicyConfig.micro_batch_size={self.micro_batch_size}: must be >= 1")
        if self.max_nan_steps < 1:
            raise ConfigError(f"PolicyConfig.max_nan_steps={self.max_nan_steps}: must be >= 1")
        if self.mx_scale_mode not in SCALE_MODES:
            raise ConfigError(f"PolicyConfig.mx_scale_mode={self.mx_scale_mode!r}: allowed: {', '.join(SCALE_MODES)}")


@contextmanager
def _both(first, second):
    with first, second:
        yield


def next_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor, temperature: float, entropy: bool
):
    """fp32 logprobs [B, T] of ``input_ids``' tokens given the ones before them in ``logits`` [B, T, V] (the first
    place 0), times ``keep`` [B, T]; with ``entropy`` also each place's entropy (times ``keep``)."""
    logp_all = (logits[:, :-1].float() / temperature).log_softmax(-1)
    lp = F.pad(logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0)) * keep
    ent = None
    if entropy:
        ent = F.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0)) * keep
    return lp, ent


def token_logprobs(logits: torch.Tensor, mb: Batch, temperature: float, entropy: bool):
    """fp32 logprobs [B, T] of ``mb``'s tokens from ``logits`` [B, T, V] (0 at position 0 and on padding), and the
    entropy of each position's distribution when ``entropy``."""
    return next_token_logprobs(logits, mb.input_ids, mb.attention_mask, temperature, entropy)


def packed_logprobs(model, mb: Batch, pk: Packing, replay: bool, adapters, temperature: float, entropy: bool):
    """``token_logprobs`` of ``mb`` computed on its packed rows ``pk`` (see ``moerl.trainer.packing``)."""
    b, t = mb.input_ids.shape
    routed = None
    if replay and mb.replay is not None:  # checked in the batch's own shape, then packed with the tokens
        routed = pk.pack(model.check_replay(mb.replay, b, t), -1)
    if isinstance(adapters, torch.Tensor):  # a slot per sequence -> per token; padding takes any slot (dropped)
        adapters = pk.pack(adapters[:, None].expand(b, t), int(adapters[0]))
    ids = pk.pack(mb.input_ids, 0)
    out = model(ids, positions=pk.positions, attention_mask=pk.segment, replay=routed, adapters=adapters)
    seg = pk.segment
    # a place continues its sequence: its logprob is the next token's under the same sequence
    keep = F.pad((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), (1, 0))
    lp, ent = next_token_logprobs(out.logits, ids, keep, temperature, entropy)
    return pk.unpack(lp, (b, t)), (pk.unpack(ent, (b, t)) if entropy else None)


class Policy:
    """The model being trained. ``forward_logprobs`` gives fp32 per-token logprobs (R3 replay optional);
    ``train_step`` runs micro-batches, accumulates gradients, clips, steps AdamW and the LR schedule.

    lora: the base is frozen in the compute dtype, adapters are fp32; reference = the same model, adapters off.
    full: the model computes in the compute dtype; fp32 master weights and optimizer state; optional frozen
    reference copy. The router is fp32 in every mode.
    """

    def __init__(self, checkpoint: str | os.PathLike, cfg: PolicyConfig | None = None, world: World | None = None):
        self.cfg = cfg = cfg or PolicyConfig()
        reuse_freed_memory()  # CPU: each step frees and allocates the same activations (moerl.allocator)
        self.checkpoint = Path(checkpoint)
        self.world = world = world or World()
        self.dtype = dtype = compute_dtype(cfg.dtype)
        sharded = world.data_size > 1
        # sharded full / mxfp8: the model's own parameters are the fp32 masters (FSDP gathers them in ``dtype``)
        self.model = load_model(checkpoint, dtype=torch.float32 if sharded and cfg.mode != "lora" else dtype).eval()
        self.ref_model = None
        self.master: MasterWeights | None = None
        self.sliced: dict[str, int] = {}  # expert-parallel slices: parameter name -> expert dim
        self.pipeline: Pipeline | None = None  # this rank's pipeline stages (pp > 1)
        self.copies: set[str] = set()  # weights this rank holds as a copy of another stage's (a tied embedding)
        if cfg.mode == "lora":
            for p in self.model.parameters():
                p.requires_grad_(False)
            attach_lora(self.model, cfg.lora, dtype=torch.float32)
            for n, p in self.model.named_parameters():
                p.requires_grad_(".lora." in n)
            self.all_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            initial = self._shard(dtype)
            self.trainable = {n: p for n, p in self.model.named_parameters() if ".lora." in n}
            params = list(self.trainable.values())
        else:
            if cfg.mode == "mxfp8":
                from moerl.model.mx import apply_mxfp8

                apply_mxfp8(self.model, cfg.mx_scale_mode)
            if cfg.reference:  # frozen, in the compute dtype (replicated when the policy is sharded)
                self.ref_model = copy.deepcopy(self.model).to(dtype).requires_grad_(False)
            self.all_names = [n for n, _ in self.model.named_parameters()]
            initial = self._shard(dtype)
            self.trainable = dict(self.model.named_parameters())
            self.master = MasterWeights(self.trainable, initial)
            params = self.master.parameters()
        o = cfg.optim
        params = list(params)
        # the fused kernel (one pass per tensor; ~8x the per-op loop on a CPU) where every parameter is a plain
        # tensor; FSDP's DTensors keep the default path
        fused = {"fused": True} if not any(isinstance(p, DTensor) for p in params) else {}
        self.optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, **fused
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(o.schedule, o.warmup_steps, o.total_steps, o.min_lr_ratio)
        )
        self.step = 0
        self.nan_skipped = 0
        self.nan_streak = 0
        self.stop_checkpoint_dir: Path | None = None  # where to save before TrainingStopped
        self.stop_state: dict = {}  # the caller's state saved with it (the loop's step)

    def _shard(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Split the model over the ranks: layers into pipeline stages, experts over the ep group, the rest FSDP over
        the data group. Returns the fp32 values of expert slices now held in ``dtype`` (the optimizer's masters start
        from them)."""
        world, initial = self.world, {}
        if world.pp > 1:
            plan = plan_stages(self.model, world, world.schedule, world.stages)
            prune(self.model, plan)
            self.pipeline = Pipeline(self.model, plan, world, world.schedule, world.microbatches, token_logprobs)
            self.copies = {"embed_tokens.weight"} if self.pipeline.copy else set()
        if world.data_size == 1:
            return initial
        if world.ep > 1:
            self.sliced = shard_experts(self.model, world)
            params = dict(self.model.named_parameters())
            for name in self.sliced:  # plain tensors in the compute dtype, fp32 masters (as in one process)
                p = params[name]
                if p.requires_grad and p.dtype != dtype and self.cfg.mode != "lora":
                    initial[name] = p.detach()
                    p.data = p.data.to(dtype)
        keep = {dict(self.model.named_parameters())[n] for n in self.sliced}
        if self.pipeline is None:
            shard_model(self.model, self.dtype, self.cfg.mode, self.world.data_mesh, keep)
        else:
            for stage in self.pipeline.modules:  # each stage its own FSDP root
                shard_model(stage.view, self.dtype, self.cfg.mode, self.world.data_mesh, keep, root=stage)
        return initial

    @property
    def fsdp_roots(self) -> list[torch.nn.Module]:
        """What FSDP shards as a whole: the model, or each of this rank's pipeline stages."""
        return list(self.pipeline.modules) if self.pipeline is not None else [self.model]

    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of trained weight ``name`` (or of its optimizer state) from this rank's part ``t``: a
        collective when the policy is sharded."""
        dim = self.sliced.get(name)
        if dim is None or t.ndim == 0:
            return full(t)
        return gather_experts(self.world, t, dim)

    def laid_out(self, name: str, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A whole tensor ``value`` of weight ``name`` (or of its optimizer state) as this rank holds ``param``."""
        dim = self.sliced.get(name)
        if dim is None or value.ndim == 0:
            return like(param, value)
        return expert_slice(self.world, value, dim)

    def whole_shape(self, name: str, param: torch.Tensor) -> torch.Size:
        """The shape of weight ``name`` whole (``param`` is this rank's part)."""
        dim = self.sliced.get(name)
        if dim is None:
            return param.shape
        return param.shape[:dim] + (param.shape[dim] * self.world.ep,) + param.shape[dim + 1 :]

    @property
    def adapters(self) -> int | None:
        return 0 if self.cfg.mode == "lora" else None

    def _logprobs(self, model, mb: Batch, replay: bool, adapters, temperature: float, entropy: bool):
        if adapters is not None and "adapter_slots" in mb.extras:  # a slot per row (-1: none), see below
            adapters = mb.extras["adapter_slots"]
        pk = plan_packing(mb.attention_mask) if self.cfg.packing else None
        if pk is not None:
            return packed_logprobs(model, mb, pk, replay, adapters, temperature, entropy)
        out = model(
            mb.input_ids, attention_mask=mb.attention_mask, replay=mb.replay if replay else None, adapters=adapters
        )
        return token_logprobs(out.logits, mb, temperature, entropy)

    @torch.no_grad()
    def forward_logprobs(
        self,
        batch: Batch,
        replay: bool | torch.Tensor = True,
        reference: bool = False,
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logprobs [B, T] of every token given the ones before it (0 at position 0 and on padding).

        ``replay``: True uses ``batch.replay`` (R3); a tensor [B, T or T-1, L_moe, k] is used in its place; False
        routes by the model's own router. ``reference``: the reference model (LoRA: adapters off; full: the frozen
        copy), never with replay.
        """
        if isinstance(replay, torch.Tensor):
            batch = replace(batch, replay=replay)
            replay = True
        model, adapters = self.model, self.adapters
        if reference:
            replay, adapters = False, None
            if self.cfg.mode != "lora":
                if self.ref_model is None:
                    raise ConfigError(f"reference logprobs in mode {self.cfg.mode!r} need PolicyConfig.reference=True")
                model = self.ref_model
        if self.pipeline is not None and model is self.model:
            return self._pipeline_logprobs(Step(batch, replay, adapters, temperature, entropy))
        parts = []
        for mb, real in micro_batches(self.world, batch, self.cfg.micro_batch_size):
            out = self._logprobs(model, mb, replay, adapters, temperature, entropy)
            if real:
                parts.append(out)
        lp = gather_rows(self.world, [p[0] for p in parts], batch)
        return lp, (gather_rows(self.world, [p[1] for p in parts], batch) if entropy else None)

    def logprobs_with_reference(
        self, batch: Batch, replay: bool = True, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs with R3 replay, the reference model's logprobs) of ``batch``. LoRA in one process: one forward
        over both, the reference rows without adapters and routing themselves (-1 replay rows); else two forwards."""
        if self.cfg.mode != "lora" or self.world.size > 1 or self.pipeline is not None:
            policy = self.forward_logprobs(batch, replay=replay, temperature=temperature)[0]
            return policy, self.forward_logprobs(batch, reference=True, temperature=temperature)[0]
        b = len(batch)
        routed = batch.replay if replay and batch.replay is not None else None
        both = Batch(
            torch.cat([batch.input_ids, batch.input_ids]),
            torch.cat([batch.attention_mask, batch.attention_mask]),
            torch.cat([batch.loss_mask, batch.loss_mask]),
            None if routed is None else torch.cat([routed, torch.full_like(routed, -1)]),
            {"adapter_slots": torch.tensor([self.adapters] * b + [-1] * b)},
            total_tokens=batch.total_tokens,
            total_seqs=batch.total_seqs,
        )
        lp = self.forward_logprobs(both, replay=routed is not None, temperature=temperature)[0]
        return lp[:b], lp[b:]

    def train_step(
        self, batch: Batch, loss_fn: LossFn, replay: bool = True, temperature: float = 1.0, entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (micro-batched). ``loss_fn(logprobs, micro_batch, entropy)`` returns
        (loss, metrics), normalised by the whole batch (``micro_batch.total_tokens`` / ``total_seqs``) so the
        accumulated gradient is the full batch's. A non-finite loss or gradient skips the step."""
        params = self.optimizer.param_groups[0]["params"]
        for p in [*params, *self.trainable.values()]:
            p.grad = None
        self.model.train()
        step = Step(batch, replay, self.adapters, temperature, entropy)
        try:
            if self.pipeline is not None:
                total, metrics = self._pipeline_train(step, loss_fn)
            else:
                total, metrics = self._accumulate(step, loss_fn)
        finally:
            self.model.eval()
        total, metrics = sum_over_ranks(self.world, total, metrics)
        if self.master is not None:
            self.master.grads_to_master()
        self._reduce_expert_grads()
        own = self.master.master if self.master is not None else self.trainable
        if self.pipeline is not None:
            self.pipeline.tie_grads(own.get("embed_tokens.weight"))
        clip = self.cfg.optim.grad_clip or math.inf
        if self.world.size == 1:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        else:
            slices = {id(own[n]) for n in self.sliced if n in own}
            grad_norm = clip_grads(self.world, params, clip, slices, {id(own[n]) for n in self.copies if n in own})
        lr = self.optimizer.param_groups[0]["lr"]
        if not (math.isfinite(total) and math.isfinite(grad_norm)):
            self.nan_skipped += 1
            self.nan_streak += 1
            for p in params:
                p.grad = None
            if self.nan_streak >= self.cfg.max_nan_steps:
                raise TrainingStopped(
                    f"{self.nan_streak} consecutive steps had a non-finite loss or gradient (loss {total}, "
                    f"grad norm {grad_norm}) at step {self.step}{self.save_stop_checkpoint()}"
                )
            return {
                "loss": total,
                "grad_norm": grad_norm,
                "lr": lr,
                "skipped": 1.0,
                "nan_skipped": float(self.nan_skipped),
                **metrics,
            }
        self.optimizer.step()
        bad = self.nonfinite_weight()
        if bad is not None:  # the step cannot be undone: stop, and never save or sync these weights
            where = ""
            if self.stop_checkpoint_dir is not None:
                kept = self.stop_checkpoint_dir if self.stop_checkpoint_dir.exists() else "none yet"
                where = f"; nothing saved (last good checkpoint: {kept})"
            raise TrainingStopped(
                f"optimizer step {self.step + 1} made weight {bad!r} non-finite (loss {total}, grad norm {grad_norm}, "
                f"lr {lr}){where}"
            )
        self.scheduler.step()
        if self.master is not None:
            self.master.master_to_model()
        self.nan_streak = 0
        self.step += 1
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped": 0.0,
            "nan_skipped": float(self.nan_skipped),
            **metrics,
        }

    def _accumulate(self, step: Step, loss_fn: LossFn) -> tuple[float, dict[str, float]]:
        """Forward and backward of this rank's micro-batches; its loss and metric sums."""
        batch, total, metrics = step.batch, 0.0, {}
        for mb, real in micro_batches(self.world, batch, self.cfg.micro_batch_size):
            lp, ent = self._logprobs(self.model, mb, step.replay, step.adapters, step.temperature, step.entropy)
            loss, m = loss_fn(lp, mb, ent)
            if not real:  # a stand-in row: it only keeps FSDP's collectives in step
                loss, m = loss * 0.0, {k: 0.0 for k in m}
            loss.backward()
            total += float(loss.detach())
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) * len(mb) / len(batch) * real
        return total, metrics

    def _pipeline_rows(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """This pipeline's rows of ``batch`` (its data rank's share) and the largest share's size."""
        n = len(batch)
        return torch.arange(n)[share(self.world, self.world.data_rank, n)], math.ceil(n / self.world.data_size)

    def _pipeline_logprobs(self, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropies) of every row through the pipelines, on every rank."""
        batch, pipe = step.batch, self.pipeline
        rows, width = self._pipeline_rows(batch)
        out = pipe.run(step, rows, width, self.cfg.micro_batch_size, self.dtype)
        lp, ent = (out if step.entropy else (out, None)) if out is not None else (None, None)
        shape = (len(rows), batch.input_ids.shape[1])
        lp = gather_rows(self.world, [pipe.from_last(lp, shape)], batch)
        return lp, (gather_rows(self.world, [pipe.from_last(ent, shape)], batch) if step.entropy else None)

    def _pipeline_train(self, step: Step, loss_fn: LossFn) -> tuple[float, dict[str, float]]:
        """Forward and backward of this pipeline's rows; its loss and metric sums on every rank of the pipeline."""
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

        pipe.run(step, rows, width, self.cfg.micro_batch_size, self.dtype, loss)
        total, metrics = pipe.share_json([total, metrics])
        return total, metrics

    def _reduce_expert_grads(self) -> None:
        """Expert slices are replicated over dp (FSDP leaves them out): their gradients are summed over it, in
        fp32."""
        if self.world.dp == 1:
            return
        own = self.master.master if self.master is not None else self.trainable
        for name in self.sliced:
            p = own.get(name)
            if p is not None and p.grad is not None:
                dist.all_reduce(p.grad, group=self.world.group("dp"))

    def nonfinite_weight(self) -> str | None:
        """The name of the first trained tensor (adapter or fp32 master) holding NaN or inf, else None (each rank
        checks its shards; the ranks agree on the first bad name)."""
        state, names = self.trainable_state(), self.all_names
        bad = next((n for n in state if not all_finite(local(state[n]))), None)
        first = agreed_min(self.world, names.index(bad) if bad is not None else len(names))
        return names[first] if first < len(names) else None

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The trained weights and the optimizer's ``state_dict``, every tensor whole (gathered from the ranks when
        the policy is sharded: a collective)."""
        weights = {n: self.whole(n, t) for n, t in self.trainable_state().items()}
        opt, names = self.optimizer.state_dict(), list(weights)
        state = {names[i]: {k: self.whole(names[i], v) for k, v in st.items()} for i, st in opt["state"].items()}
        if self.pipeline is not None:  # every stage's tensors, on every rank of the pipeline
            own = [(f"w/{n}", t) for n, t in weights.items() if n not in self.copies]
            own += [(f"o/{k}/{n}", v) for n, st in state.items() if n not in self.copies for k, v in st.items()]
            weights, state = {}, {}
            for key, t in self.pipeline.stream(own):
                kind, rest = key.split("/", 1)
                if kind == "w":
                    weights[rest] = t
                else:
                    k, n = rest.split("/", 1)
                    state.setdefault(n, {})[k] = t
            weights = {n: weights[n] for n in self.all_names}
        index = {n: i for i, n in enumerate(weights)}  # the optimizer's order over the whole model
        opt["state"] = {index[n]: st for n, st in state.items()}
        opt["param_groups"] = [{**g, "params": list(range(len(weights)))} for g in opt["param_groups"]]
        return weights, opt

    def sync_tensors(self):
        """The named tensors an engine needs for the current weights, one at a time (see ``moerl.sync``)."""
        from moerl.sync.weights import policy_tensors

        return policy_tensors(self)

    def save_shards(self, directory) -> None:
        """Write this rank's part of the trained state under ``directory`` (a collective; see
        ``moerl.parallel.shards``)."""
        from moerl.parallel.shards import save_shards

        save_shards(self, Path(directory))

    def load(self, path) -> dict:
        """Restore the state saved at ``path`` (see ``moerl.trainer.checkpoint``); returns the caller's state."""
        from moerl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(path, self)

    def close(self) -> None:
        """Nothing to release in one process (a sharded policy lets its other ranks go)."""

    @contextmanager
    def gathered(self):
        """A context in which the model's parameters are whole (sharded policies gather them: a collective). With
        pipeline stages rank 0 gets a whole model built from every stage's weights (the other ranks None)."""
        if self.pipeline is None:
            with self.gathered_here():
                yield self.model
            return
        weights, _ = self.full_state()
        model = None
        if self.world.driver:
            model = load_model(self.checkpoint, dtype=self.dtype).eval()
            if self.cfg.mode == "lora":
                attach_lora(model, self.cfg.lora, dtype=torch.float32)
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name, t in weights.items():
                    params[name].copy_(t)
        yield model

    def gathered_here(self):
        """A context in which this rank's parameters are whole: FSDP shards and expert slices gathered."""
        return _both(gathered(*self.fsdp_roots), whole_experts(self.model, self.world))

    def save_stop_checkpoint(self) -> str:
        """Before a TrainingStopped: save the current state to ``stop_checkpoint_dir`` (with ``stop_state``) if its
        weights are finite; returns the sentence the error message ends with."""
        if self.stop_checkpoint_dir is None:
            return ""
        bad = self.nonfinite_weight()
        if bad is not None:
            return f"; weight {bad!r} is non-finite: nothing saved (last good checkpoint: {self.stop_checkpoint_dir})"
        if not self.world.driver:  # rank 0 writes it; this rank writes its shards with it
            from moerl.trainer.checkpoint import shards_of_save

            self.save_shards(shards_of_save(self.stop_checkpoint_dir))
            return ""
        from moerl.trainer.checkpoint import save_checkpoint

        save_checkpoint(self.stop_checkpoint_dir, self, state=self.stop_state)
        return f"; checkpoint of the last good state saved to {self.stop_checkpoint_dir}"

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores as weights: the adapters (lora) or the fp32 masters (full / mxfp8)."""
        if self.master is not None:
            return {n: p.detach() for n, p in self.master.master.items()}
        return {n: p.detach() for n, p in self.trainable.items()}
