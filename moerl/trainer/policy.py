"""Policy: the trained model in one of three modes (lora | full | mxfp8), its optimizer and its LR schedule."""

from __future__ import annotations

import copy
import math
import os
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from moerl.allocator import reuse_freed_memory
from moerl.bridges import load_model
from moerl.device import device_name, resolve_device
from moerl.errors import ConfigError, OutOfMemory, TrainingStopped
from moerl.finite import first_nonfinite
from moerl.model.lora import LoraConfig, attach_lora
from moerl.model.mx import SCALE_MODES
from moerl.parallel.layout import LayoutConfig, parallelize, storage_dtype
from moerl.parallel.pipeline import Step
from moerl.parallel.world import World, local
from moerl.precision import compute_dtype, dtype_name
from moerl.trainer.batch import Batch
from moerl.trainer.compile import check as check_compile
from moerl.trainer.compile import compile_blocks, pays, uncompile_blocks
from moerl.trainer.optim import SCHEDULES, MasterWeights, lr_lambda
from moerl.trainer.packing import Packing, plan_packing

MODES = ("lora", "full", "mxfp8")

LossFn = Callable[[torch.Tensor, Batch, torch.Tensor | None], tuple[torch.Tensor, dict[str, float]]]


@dataclass(slots=True)
class OptimConfig:
    lr: float = 1e-5  # AdamW learning rate (peak, with a schedule)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    schedule: str = "constant"  # constant | cosine (after warmup_steps of linear warm-up)
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    total_steps: int = 1000  # cosine: the step where the learning rate reaches lr * min_lr_ratio
    min_lr_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr

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
    mode: str = "lora"  # what trains: lora (adapters, base frozen) | full (bf16 / fp32 compute) | mxfp8
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 8  # sequences per forward / backward (gradients accumulate over a mini-batch)
    dtype: str = "auto"  # compute dtype (lora: the frozen base; full: the model copy): auto | bfloat16 | float32
    device: str = "auto"  # auto (CUDA where present) | cpu | cuda | cuda:N (moerl.device)
    reference: bool = False  # full / mxfp8: keep a frozen copy for reference logprobs (lora: adapters off)
    max_nan_steps: int = 3  # consecutive non-finite steps that stop training
    mx_scale_mode: str = "rceil"  # mxfp8: floor | rceil
    packing: bool = True  # forwards run on the micro-batch's sequences packed into fewer rows (moerl.trainer.packing)
    # the training forward / backward compiled by decoder block (moerl.trainer.compile): auto (the loop decides from
    # its first steps' times, and keeps them where faster) | True | False
    compile: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"PolicyConfig.mode={self.mode!r}: allowed: {', '.join(MODES)}")
        dtype_name(self.dtype, key="PolicyConfig.dtype")  # auto: bf16 where native, else fp32 (moerl.precision)
        device_name(self.device, key="policy.device")  # what this host lacks is refused where the policy is built
        if self.micro_batch_size < 1:
            raise ConfigError(f"PolicyConfig.micro_batch_size={self.micro_batch_size}: must be >= 1")
        if self.max_nan_steps < 1:
            raise ConfigError(f"PolicyConfig.max_nan_steps={self.max_nan_steps}: must be >= 1")
        if self.mx_scale_mode not in SCALE_MODES:
            raise ConfigError(f"PolicyConfig.mx_scale_mode={self.mx_scale_mode!r}: allowed: {', '.join(SCALE_MODES)}")
        check_compile(self.compile, ranks=1, mode=self.mode)


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

    How the model is split over the ranks (one process included) is ``self.layout`` (``moerl.parallel.layout``):
    the policy is the mode, the masters, the optimizer, the schedule and the step on top of it.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        cfg: PolicyConfig | None = None,
        world: World | None = None,
        build: Callable[..., torch.nn.Module] | None = None,
    ):
        """``build(dtype=, device=)``: makes the model instead of loading ``checkpoint`` (a plan's model of fake
        tensors, ``moerl.plan``)."""
        self.cfg = cfg = cfg or PolicyConfig()
        reuse_freed_memory()  # CPU: each step frees and allocates the same activations (moerl.allocator)
        self.checkpoint = Path(checkpoint)
        world = world or World()
        self.device = resolve_device(cfg.device, key="policy.device")
        self.dtype = dtype = compute_dtype(cfg.dtype, self.device)
        build = build or partial(load_model, checkpoint)
        self.model = build(dtype=storage_dtype(world, cfg.mode, dtype), device=self.device).eval()
        self.ref_model = None
        self.master: MasterWeights | None = None
        if cfg.mode == "lora":
            for p in self.model.parameters():
                p.requires_grad_(False)
            attach_lora(self.model, cfg.lora, dtype=torch.float32)
            for n, p in self.model.named_parameters():
                p.requires_grad_(".lora." in n)
        else:
            if cfg.mode == "mxfp8":
                from moerl.model.mx import apply_mxfp8

                apply_mxfp8(self.model, cfg.mx_scale_mode)
            if cfg.reference:  # frozen, in the compute dtype (replicated when the policy is sharded)
                self.ref_model = copy.deepcopy(self.model).to(dtype).requires_grad_(False)
        self.all_names = [n for n, p in self.model.named_parameters() if p.requires_grad]  # of the whole model
        self.layout = parallelize(
            self.model, world, LayoutConfig(cfg.mode, dtype, cfg.micro_batch_size, head=token_logprobs)
        )
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        check_compile(cfg.compile, self.layout.ranks, cfg.mode)
        self.compiled = cfg.compile is True and compile_blocks(self.model) > 0
        if cfg.mode != "lora":
            self.master = MasterWeights(self.trainable, self.layout.initial)
        o = cfg.optim
        params = list(self.trained.values())
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

    def compile_if_it_pays(self, steps_left: int, seconds_train: float) -> bool:
        """``policy.compile: auto``: compile the training blocks now if ``steps_left`` steps of ``seconds_train``
        each repay it (``moerl.trainer.compile.pays``; one process, not mxfp8: see ``compile.check``). True if this
        call compiled them."""
        if self.compiled or self.cfg.compile != "auto" or self.layout.ranks > 1 or self.cfg.mode == "mxfp8":
            return False
        if not pays(steps_left, seconds_train):
            return False
        self.compiled = compile_blocks(self.model) > 0
        return self.compiled

    def drop_compiled(self) -> None:
        """Train eager again (``policy.compile: auto`` found the compiled blocks slower)."""
        uncompile_blocks(self.model)
        self.compiled = False

    @property
    def trained(self) -> dict[str, torch.nn.Parameter]:
        """What the optimizer steps, by name: the adapters (lora) or the fp32 masters (full / mxfp8); this rank's
        parts of them."""
        return self.master.master if self.master is not None else self.trainable

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

    def _forward(self, model, step: Step):
        """One micro-batch's (logprobs, entropy) through a whole ``model`` (the policy's or the reference)."""
        return lambda mb: self._logprobs(model, mb, step.replay, step.adapters, step.temperature, step.entropy)

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
        home, batch = batch.input_ids.device, batch.to(self.device)  # results go back where the batch came from
        model, adapters = self.model, self.adapters
        if reference:
            replay, adapters = False, None
            if self.cfg.mode != "lora":
                if self.ref_model is None:
                    raise ConfigError(f"reference logprobs in mode {self.cfg.mode!r} need PolicyConfig.reference=True")
                model = self.ref_model
        step = Step(batch, replay, adapters, temperature, entropy)
        # the frozen reference copy is whole on every rank: it runs outside the pipeline stages
        with self._memory_named("forward (logprobs)", batch):
            lp, ent = self.layout.forward(step, self._forward(model, step), stages=model is self.model)
        return lp.to(home), (ent.to(home) if ent is not None else None)

    def logprobs_with_reference(
        self, batch: Batch, replay: bool = True, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs with R3 replay, the reference model's logprobs) of ``batch``. LoRA in one process: one forward
        over both, the reference rows without adapters and routing themselves (-1 replay rows); else two forwards."""
        if self.cfg.mode != "lora" or self.layout.ranks > 1:
            policy = self.forward_logprobs(batch, replay=replay, temperature=temperature)[0]
            return policy, self.forward_logprobs(batch, reference=True, temperature=temperature)[0]
        b = len(batch)
        routed = batch.replay if replay and batch.replay is not None else None
        both = Batch(
            torch.cat([batch.input_ids, batch.input_ids]),
            torch.cat([batch.attention_mask, batch.attention_mask]),
            torch.cat([batch.loss_mask, batch.loss_mask]),
            None if routed is None else torch.cat([routed, torch.full_like(routed, -1)]),
            {"adapter_slots": torch.tensor([self.adapters] * b + [-1] * b, device=batch.input_ids.device)},
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
        trained = self.trained
        for p in [*trained.values(), *self.trainable.values()]:
            p.grad = None
        self.model.train()
        step = Step(batch.to(self.device), replay, self.adapters, temperature, entropy)
        try:
            with self._memory_named("forward and backward of a training step", batch, before_step=True):
                total, metrics = self.layout.backward(step, self._forward(self.model, step), loss_fn)
        finally:
            self.model.eval()
        if self.master is not None:
            self.master.grads_to_master()
        self.layout.reduce_grads(trained)
        grad_norm = self.layout.clip_grads(trained, self.cfg.optim.grad_clip or math.inf)
        lr = self.optimizer.param_groups[0]["lr"]
        done = {"loss": total, "grad_norm": grad_norm, "lr": lr}
        if not (math.isfinite(total) and math.isfinite(grad_norm)):
            self._skip(done)
            return {**done, "skipped": 1.0, "nan_skipped": float(self.nan_skipped), **metrics}
        with self._memory_named("optimizer step", batch):
            self.optimizer.step()
        self._check_weights(done)
        self.scheduler.step()
        if self.master is not None:
            self.master.master_to_model()
        self.nan_streak = 0
        self.step += 1
        return {**done, "skipped": 0.0, "nan_skipped": float(self.nan_skipped), **metrics}

    @contextmanager
    def _memory_named(self, stage: str, batch: Batch, before_step: bool = False):
        """Out of memory inside: raise ``OutOfMemory`` naming this rank, ``stage`` and ``batch``'s size, and what to
        lower. ``before_step``: the weights are still those before the step; one process saves them (several ranks
        cannot: the others are inside the step's collectives, and the launcher stops them)."""
        try:
            yield
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            traceback.clear_frames(e.__traceback__)  # the failed step's tensors, held by its frames' locals
            for p in [*self.trained.values(), *self.trainable.values()]:
                p.grad = None
            w = self.layout.world
            where = f"trainer rank {w.rank} of {w.size}" if w.size > 1 else "the trainer"
            if w.size > 1:
                where += f" (pipeline rank {w.stage}, expert slice {w.ep_rank}, data-parallel rank {w.dp_rank})"
            rows, cols = batch.input_ids.shape
            mb = self.cfg.micro_batch_size
            saved = ""
            if before_step and w.size == 1:
                saved = self.save_stop_checkpoint()
            elif self.stop_checkpoint_dir is not None:  # the others are inside the step: no save; the last is kept
                kept = self.stop_checkpoint_dir if self.stop_checkpoint_dir.exists() else "none yet"
                saved = f"; nothing saved (last good checkpoint: {kept})"
            raise OutOfMemory(
                f"{where} ran out of memory in the {stage} of a batch of {rows} rows x {cols} tokens "
                f"({int(batch.attention_mask.bool().sum())} real), micro-batches of {mb} rows ({_first_line(e)}); "
                f"lower policy.micro_batch_size (now {mb}) or the lengths (rollout.max_tokens, "
                f"rollout.max_model_len){saved}"
            ) from None

    def _skip(self, done: dict[str, float]) -> None:
        """A non-finite loss or gradient: drop the gradients; stop after ``max_nan_steps`` in a row."""
        self.nan_skipped += 1
        self.nan_streak += 1
        for p in self.trained.values():
            p.grad = None
        if self.nan_streak >= self.cfg.max_nan_steps:
            raise TrainingStopped(
                f"{self.nan_streak} consecutive steps had a non-finite loss or gradient (loss {done['loss']}, "
                f"grad norm {done['grad_norm']}) at step {self.step}{self.save_stop_checkpoint()}"
            )

    def _check_weights(self, done: dict[str, float]) -> None:
        """After the optimizer step: a non-finite weight cannot be undone: stop, and never save or sync it."""
        bad = self.nonfinite_weight()
        if bad is None:
            return
        where = ""
        if self.stop_checkpoint_dir is not None:
            kept = self.stop_checkpoint_dir if self.stop_checkpoint_dir.exists() else "none yet"
            where = f"; nothing saved (last good checkpoint: {kept})"
        raise TrainingStopped(
            f"optimizer step {self.step + 1} made weight {bad!r} non-finite (loss {done['loss']}, grad norm "
            f"{done['grad_norm']}, lr {done['lr']}){where}"
        )

    def nonfinite_weight(self) -> str | None:
        """The name of the first trained tensor (adapter or fp32 master) holding NaN or inf, else None (each rank
        checks its shards; the ranks agree on the first bad name)."""
        state, names = self.trainable_state(), self.all_names
        first = first_nonfinite([local(t) for t in state.values()])  # one host read for every tensor
        bad = list(state)[first] if first is not None else None
        first = self.layout.agreed_min(names.index(bad) if bad is not None else len(names))
        return names[first] if first < len(names) else None

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The trained weights and the optimizer's ``state_dict``, every tensor whole, on every rank (gathered from
        the ranks when the policy is sharded: a collective)."""
        own, opt = self.trainable_state(), self.optimizer.state_dict()
        names = list(own)
        parts = [(f"w/{n}", n, t) for n, t in own.items()]
        parts += [(f"o/{k}/{names[i]}", names[i], v) for i, st in opt["state"].items() for k, v in st.items()]
        weights, state = {}, {}
        for key, t in self.layout.everywhere(parts):
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

    def sync_tensors(self, dense: str | None = None):
        """The named tensors an engine needs for the current weights, one at a time (see ``moerl.sync``; ``dense``:
        the dtype of an engine without adapters or MX weights)."""
        from moerl.sync.weights import policy_tensors

        return policy_tensors(self, dense)

    def save_shards(self, directory) -> None:
        """Write this rank's part of the trained state under ``directory`` (a collective; see
        ``moerl.parallel.shards``)."""
        from moerl.parallel.shards import save_shards

        save_shards(self.layout, self.trained, self.optimizer.state_dict()["state"], Path(directory))

    def load(self, path) -> dict:
        """Restore the state saved at ``path`` (see ``moerl.trainer.checkpoint``); returns the caller's state."""
        from moerl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(path, self)

    def close(self) -> None:
        """Nothing to release in one process (a sharded policy lets its other ranks go)."""

    def gathered(self):
        """A context in which the model's parameters are whole (sharded policies gather them: a collective). With
        pipeline stages rank 0 gets a whole model built from every stage's weights (the other ranks None)."""
        return self.layout.gathered(self.trainable_state(), self._fresh_model)

    def _fresh_model(self) -> torch.nn.Module:
        """A whole model of this policy's kind, in the compute dtype (its trained weights are copied in after)."""
        model = load_model(self.checkpoint, dtype=self.dtype).eval()
        if self.cfg.mode == "lora":
            attach_lora(model, self.cfg.lora, dtype=torch.float32)
        return model

    def save_stop_checkpoint(self) -> str:
        """Before a TrainingStopped: save the current state to ``stop_checkpoint_dir`` (with ``stop_state``) if its
        weights are finite; returns the sentence the error message ends with."""
        if self.stop_checkpoint_dir is None:
            return ""
        bad = self.nonfinite_weight()
        if bad is not None:
            return f"; weight {bad!r} is non-finite: nothing saved (last good checkpoint: {self.stop_checkpoint_dir})"
        if not self.layout.world.driver:  # rank 0 writes it; this rank writes its shards with it
            from moerl.trainer.checkpoint import shards_of_save

            self.save_shards(shards_of_save(self.stop_checkpoint_dir))
            return ""
        from moerl.trainer.checkpoint import save_checkpoint

        save_checkpoint(self.stop_checkpoint_dir, self, state=self.stop_state)
        return f"; checkpoint of the last good state saved to {self.stop_checkpoint_dir}"

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores as weights: the adapters (lora) or the fp32 masters (full / mxfp8)."""
        return {n: p.detach() for n, p in self.trained.items()}


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says an allocation failed: CUDA's OutOfMemoryError, a CPU allocator's refusal, Python's."""
    text = str(e)
    return (
        isinstance(e, torch.OutOfMemoryError | MemoryError)
        or "can't allocate memory" in text
        or ("out of memory" in text.lower())
    )


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__
