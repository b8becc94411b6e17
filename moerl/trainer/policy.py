"""Policy: the trained model in its training mode (``moerl.modes``), its optimizer and its LR schedule."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from moerl.allocator import reuse_freed_memory
from moerl.bridges import load_model
from moerl.device import resolve_device
from moerl.dynamo import first_compile, graph_key, price, remembered_seconds
from moerl.errors import ConfigError
from moerl.finite import first_nonfinite
from moerl.modes import MODES
from moerl.parallel.layout import LayoutConfig, held_stages, parallelize, storage_dtype
from moerl.parallel.pipeline import Step
from moerl.parallel.world import World, local
from moerl.precision import compute_dtype
from moerl.trainer import compile as blocks_compile
from moerl.trainer.batch import Batch
from moerl.trainer.compile import BLOCKS, compile_blocks, pays, uncompile_blocks
from moerl.trainer.compile import check as check_compile
from moerl.trainer.config import PolicyConfig
from moerl.trainer.faults import check_weights, memory_named, skip_nonfinite
from moerl.trainer.in_backward import StepInBackward
from moerl.trainer.logprobs import batch_head, packed_logprobs, token_logprobs
from moerl.trainer.optim import MasterWeights, adamw, lr_schedule
from moerl.trainer.packing import plan_packing

LossFn = Callable[[torch.Tensor, Batch, torch.Tensor | None], tuple[torch.Tensor, dict[str, float]]]


class Policy:
    """The model being trained. ``forward_logprobs`` gives fp32 per-token logprobs (R3 replay optional);
    ``train_step`` runs micro-batches, accumulates gradients, clips, steps AdamW and the LR schedule.

    What trains and how (``self.mode``, ``moerl.modes``): lora's fp32 adapters on a frozen base (the reference:
    adapters off), or the model's own weights with fp32 masters and optimizer state (full, mxfp8; an optional frozen
    reference copy). The router is fp32 in every mode.

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
        self.mode = mode = MODES[cfg.mode]
        # a rank reads its pipeline stages and its share of the experts only; a whole reference copy needs them all
        part = not (cfg.reference and mode.reference_copy)
        share = (world.ep_rank, world.ep) if world.ep > 1 and part else None
        stages = held_stages(world) if part and build is None else None
        self.checkpoint_reads: list[tuple[str, int]] = []  # (tensor, bytes) this rank read of the checkpoint
        build = build or partial(load_model, checkpoint, experts=share, reads=self.checkpoint_reads, keep=stages)
        self.model = build(dtype=storage_dtype(world, mode.masters, dtype), device=self.device).eval()
        if self.device.type == "cpu":  # CPU training's fused backward ops (moerl.cpu.training), swapped in
            from moerl.cpu.training import install_training

            install_training(self.model)
        mode.prepare(self.model, cfg)
        self.ref_model = mode.reference(self.model, cfg, dtype)  # replicated when the policy is sharded
        all_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        head = partial(batch_head, chunk=cfg.logits_chunk)  # a pipeline's last stage: its logprobs in chunks
        split = LayoutConfig(
            mode.masters,
            dtype,
            cfg.micro_batch_size,
            head,
            cfg.activation_checkpointing,
            cfg.token_budget,
            cfg.packing,
            stages.plan if stages is not None else None,
            cfg.cpu_offload,
        )
        self.layout = parallelize(self.model, world, split)
        # of the whole model: a rank loaded with its stages only asks the others
        self.all_names = all_names if stages is None else self.layout.pipeline.whole_names(all_names)
        self.trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        check_compile(cfg.compile, self.layout.ranks, mode)
        self.compiled = cfg.compile is True and compile_blocks(self.model) > 0
        self.compile_pending = self.compiled  # the next training step compiles them (said on the console)
        self._graph_key: tuple[tuple, str] | None = None  # (the call it is for, the key)
        self._call: tuple = (False, False, 1.0)  # the last train_step's: replayed, entropy, temperature
        self.master = MasterWeights(self.trainable, self.layout.initial, cfg.cpu_offload) if mode.masters else None
        self.layout.initial = {}  # the masters hold them now
        self.optimizer = adamw(list(self.trained.values()), cfg.optim)
        self.scheduler = lr_schedule(self.optimizer, cfg.optim, 0)
        if cfg.optimizer_in_backward and self.layout.ranks > 1:
            raise ConfigError(
                f"policy.optimizer_in_backward=true on {self.layout.ranks} ranks: not built (sharded and replicated "
                "gradients are reduced over the ranks after the backward); set it to false, or train in one process"
            )
        self.in_backward = StepInBackward(self) if cfg.optimizer_in_backward else None
        self.step = 0
        self.nan_skipped = 0
        self.nan_streak = 0
        self.stop_checkpoint_dir: Path | None = None  # where to save before TrainingStopped
        self.stop_state: dict = {}  # the caller's state saved with it (the loop's step)
        # the RNG streams saved with it, taken where stop_state was reached (None: those of the save's moment)
        self.stop_rng: dict | None = None
        self.before_update: Callable[[], None] | None = None  # called as each train_step begins (the loop's Ctrl-C)

    def state_dict(self) -> dict:
        """The policy's state beside its tensors (those: ``full_state``, or each rank's ``save_shards``), JSON-able:
        mode, counters, the optimizer's groups and the schedule's position."""
        return {
            "mode": self.mode.name,
            "step": self.step,
            "nan_skipped": self.nan_skipped,
            "nan_streak": self.nan_streak,
            "param_groups": self.optimizer.state_dict()["param_groups"],
            "scheduler": {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict, parts: dict[str, torch.Tensor]) -> None:
        """Restore ``state`` (``state_dict``'s) and the trained tensors ``parts`` (``weights/{name}`` and
        ``optim/{name}/{key}``, laid out as this rank holds them). The optimizer's hyperparameters and the schedule's
        shape come from ``self.cfg`` (a resume may change them); its position from ``state``."""
        names = list(self.trained)  # the optimizer's order
        moments = {}
        for i, name in enumerate(names):
            keys = sorted(k.rsplit("/", 1)[1] for k in parts if k.startswith(f"optim/{name}/"))
            if keys:
                moments[i] = {k: parts[f"optim/{name}/{k}"] for k in keys}
        for name, p in self.trained.items():
            p.copy_(parts[f"weights/{name}"])
        if self.master is not None:
            self.master.master_to_model()
        self.optimizer.load_state_dict({"state": moments, "param_groups": self.optimizer.state_dict()["param_groups"]})
        self.scheduler = lr_schedule(self.optimizer, self.cfg.optim, state["scheduler"]["last_epoch"])
        self.step, self.nan_skipped, self.nan_streak = state["step"], state["nan_skipped"], state["nan_streak"]

    def compile_if_it_pays(self, steps_left: int, seconds_train: float) -> bool:
        """``policy.compile: auto``: compile the training blocks now if ``steps_left`` steps of ``seconds_train``
        each repay it (``moerl.trainer.compile.pays``; one process, not mxfp8: see ``compile.check``). True if this
        call compiled them. Blocks recomputed in the backward (``activation_checkpointing``) stay eager."""
        if self.compiled or self.cfg.compile != "auto" or self.layout.ranks > 1 or self.mode.untraced:
            return False
        if self.cfg.activation_checkpointing != "none":
            return False
        if not pays(steps_left, seconds_train, self.compile_price()[0]):
            return False
        self.compiled = self.compile_pending = compile_blocks(self.model) > 0
        return self.compiled

    def compile_price(self) -> tuple[float, str]:
        """(seconds, how known) compiling the training blocks costs: what their first call took when this graph
        last compiled here, else ``COMPILE_SECONDS`` (``moerl.dynamo.price``)."""
        return price(remembered_seconds(self.graph_key), blocks_compile.COMPILE_SECONDS)

    @property
    def graph_key(self) -> str:
        """The training blocks' graph identity across runs (``moerl.dynamo.graph_key``): the model, the mode and how
        the last step called them (replay, entropy, temperature: each traces its own graph)."""
        if self._graph_key is None or self._graph_key[0] != self._call:
            self._graph_key = self._call, graph_key(BLOCKS, self.model, self.cfg.mode, self.cfg.packing, *self._call)
        return self._graph_key[1]

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
        """The engine adapter slot the policy's forwards use (lora), else None."""
        return self.mode.adapter_slot

    def _logprobs(self, model, mb: Batch, step: Step):
        adapters = step.adapters
        if adapters is not None and "adapter_slots" in mb.extras:  # a slot per row (-1: none), see below
            adapters = mb.extras["adapter_slots"]
        # rows without padding have nothing to pack, and attend plainly causally
        pk = plan_packing(mb.attention_mask) if self.cfg.packing and not step.unpadded else None
        how = (step.replay, adapters, step.temperature, step.entropy, self.cfg.logits_chunk)
        if pk is not None:
            return packed_logprobs(model, mb, pk, *how)
        return token_logprobs(model, mb, *how, causal=step.unpadded)

    def _forward(self, model, step: Step):
        """One micro-batch's (logprobs, entropy) through a whole ``model`` (the policy's or the reference)."""
        run = self.layout.runner(model)
        return lambda mb: self._logprobs(run, mb, step)

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
        unpadded = bool(batch.attention_mask.all())  # on the host, where the batch comes from: no device sync
        home, batch = batch.input_ids.device, batch.to(self.device)  # results go back where the batch came from
        model, adapters = self.model, self.adapters
        if reference:
            replay, adapters = False, None
            if self.adapters is None:  # no adapters to turn off: the frozen copy
                if self.ref_model is None:
                    raise ConfigError(f"reference logprobs in mode {self.cfg.mode!r} need PolicyConfig.reference=True")
                model = self.ref_model
        step = Step(batch, replay, adapters, temperature, entropy, unpadded)
        # the frozen reference copy is whole on every rank: it runs outside the pipeline stages
        with memory_named(self, "forward (logprobs)", batch):
            lp, ent = self.layout.forward(step, self._forward(model, step), stages=model is self.model)
        return lp.to(home), (ent.to(home) if ent is not None else None)

    def logprobs_with_reference(
        self, batch: Batch, replay: bool = True, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs with R3 replay, the reference model's logprobs) of ``batch``. LoRA in one process: one forward
        over both, the reference rows without adapters and routing themselves (-1 replay rows); else two forwards."""
        if self.adapters is None or self.layout.ranks > 1:
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
            lengths=None if batch.lengths is None else batch.lengths * 2,
        )
        lp = self.forward_logprobs(both, replay=routed is not None, temperature=temperature)[0]
        return lp[:b], lp[b:]

    def train_step(
        self,
        batch: Batch,
        loss_fn: LossFn,
        replay: bool = True,
        temperature: float = 1.0,
        entropy: bool | str = False,
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (micro-batched). ``loss_fn(logprobs, micro_batch, entropy)`` returns
        (loss, metrics), normalised by the whole batch (``micro_batch.total_tokens`` / ``total_seqs``) so the
        accumulated gradient is the full batch's. A non-finite loss or gradient skips the step. ``entropy``: each
        token's entropy for the loss, differentiable (True) or its value alone (``logprobs.ENTROPY_METRIC``)."""
        if self.before_update is not None:
            self.before_update()
        trained = self.trained
        for p in [*trained.values(), *self.trainable.values()]:
            p.grad = None
        self.model.train()
        unpadded = bool(batch.attention_mask.all())  # on the host, where the batch comes from: no device sync
        step = Step(batch.to(self.device), replay, self.adapters, temperature, entropy, unpadded)
        in_backward = self.in_backward
        if in_backward is not None:
            self._one_micro_batch(step.batch)
        self._call = (replay and batch.replay is not None, entropy, temperature)
        compiling, self.compile_pending = self.compile_pending, False
        try:
            with memory_named(self, "forward and backward of a training step", batch, before_step=True):
                with first_compile(
                    BLOCKS, "policy.compile", self.cfg.compile, compiling, self.graph_key if compiling else None
                ):
                    with in_backward.armed() if in_backward is not None else nullcontext():
                        total, metrics = self.layout.backward(step, self._forward(self.model, step), loss_fn)
        finally:
            self.model.eval()
        lr = self.optimizer.param_groups[0]["lr"]
        if in_backward is not None:  # every tensor stepped already, each as its gradient came
            done = {"loss": total, "grad_norm": in_backward.grad_norm(), "lr": lr}
        else:
            if self.master is not None:
                self.master.grads_to_master()
            self.layout.reduce_grads(trained)
            grad_norm = self.layout.clip_grads(trained, self.cfg.optim.grad_clip or math.inf)
            done = {"loss": total, "grad_norm": grad_norm, "lr": lr}
        if not (math.isfinite(total) and math.isfinite(done["grad_norm"])):
            skip_nonfinite(self, done)
            return {**done, "skipped": 1.0, "nan_skipped": float(self.nan_skipped), **metrics}
        if in_backward is None:
            with memory_named(self, "optimizer step", batch):
                self.optimizer.step()
        check_weights(self, done)
        self.scheduler.step()
        if self.master is not None and in_backward is None:
            self.master.master_to_model()
        for p in trained.values():  # spent: kept, they would hold memory through the weight sync and the rollouts
            p.grad = None
        self.nan_streak = 0
        self.step += 1
        return {**done, "skipped": 0.0, "nan_skipped": float(self.nan_skipped), **metrics}

    def _one_micro_batch(self, batch: Batch) -> None:
        """Refuse a step of more than one micro-batch (``policy.optimizer_in_backward`` steps each tensor in the
        backward: a second micro-batch's gradient would arrive after its step)."""
        n = self.layout.micro_batches(batch)
        if n > 1:
            cfg = self.cfg
            raise ConfigError(
                f"policy.optimizer_in_backward=true: this step's {len(batch)} sequences "
                f"({int(batch.attention_mask.sum())} tokens) split into {n} micro-batches under "
                f"policy.micro_batch_size={cfg.micro_batch_size} and policy.max_tokens_per_micro_batch="
                f"{cfg.token_budget}, and each tensor steps in the backward of one; raise them (0: no limit), "
                "or set optimizer_in_backward: false"
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

    def sync_tensors(self, dense: str | None = None, part_bytes: int = 256 * 2**20):
        """The named tensors an engine needs for the current weights, one at a time (see ``moerl.sync``; ``dense``:
        the dtype of an engine without adapters or MX weights; ``part_bytes``: the most a part of a weight split over
        ranks by rows holds, ``moerl.sync.parts``)."""
        return self.layout.stream(self.mode.own_tensors(self, dense, part_bytes))

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
        self.mode.trained_modules(model, self.cfg)
        return model

    def save_stop_checkpoint(self) -> str:
        """Before a TrainingStopped: save the current state to ``stop_checkpoint_dir`` (with ``stop_state`` and the
        RNG streams ``stop_rng``) if its weights are finite; returns the sentence the error message ends with."""
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

        save_checkpoint(self.stop_checkpoint_dir, self, state=self.stop_state, rng=self.stop_rng)
        return f"; checkpoint of the last good state saved to {self.stop_checkpoint_dir}"

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores as weights: the adapters (lora) or the fp32 masters (full / mxfp8)."""
        return {n: p.detach() for n, p in self.trained.items()}
