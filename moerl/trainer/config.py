"""The policy's configuration: what trains (the mode and its LoRA / MX settings), the optimizer and schedule, the
micro-batch, dtype and device; every value checked here, once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moerl.config import finite, require
from moerl.device import device_name
from moerl.model.lora import LoraConfig
from moerl.model.mx import SCALE_MODES
from moerl.modes import MODES, mode_of
from moerl.parallel.checkpointing import CHECKPOINTING
from moerl.precision import DTYPE_NAMES, dtype_name
from moerl.trainer.compile import check as check_compile
from moerl.trainer.optim import SCHEDULES


@dataclass(slots=True)
class OptimConfig:
    lr: float = 1e-5  # AdamW learning rate (peak, with a schedule)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.999  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    schedule: Literal[SCHEDULES] = "constant"  # constant | cosine (after warmup_steps of linear warm-up)
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    total_steps: int = 1000  # cosine: the step where the learning rate reaches lr * min_lr_ratio
    min_lr_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr

    def __post_init__(self) -> None:
        lr, wd, b1, b2, eps, clip, floor = (
            self.lr, self.weight_decay, self.beta1, self.beta2, self.eps, self.grad_clip, self.min_lr_ratio
        )  # fmt: skip
        rules = (
            # AdamW moves each weight by about lr per step: above 1 it is never meant, and large values overflow
            ("lr", lr, finite(lr) and 0 < lr <= 1, "must lie in (0, 1]"),
            ("weight_decay", wd, finite(wd) and wd >= 0, "must be finite and >= 0"),
            ("beta1", b1, finite(b1) and 0 <= b1 < 1, "must lie in [0, 1)"),
            ("beta2", b2, finite(b2) and 0 <= b2 < 1, "must lie in [0, 1)"),
            ("eps", eps, finite(eps) and eps > 0, "must be finite and > 0"),
            ("grad_clip", clip, finite(clip) and clip >= 0, "must be finite and >= 0 (0 = off)"),
            ("schedule", self.schedule, self.schedule in SCHEDULES, f"allowed: {', '.join(SCHEDULES)}"),
            ("warmup_steps", self.warmup_steps, self.warmup_steps >= 0, "must be >= 0"),
            ("total_steps", self.total_steps, self.total_steps >= 1, "must be >= 1"),
            ("min_lr_ratio", floor, finite(floor) and 0 <= floor <= 1, "must lie in [0, 1]"),
        )
        require("optim.{}", rules)


# a micro-batch's tokens where the config leaves it (policy.max_tokens_per_micro_batch: null): a default run's step
# in one or a few micro-batches (small micro-batches pay each forward's fixed costs many times over), a long
# sequence's activations bounded
TOKENS_PER_MICRO_BATCH = 16384


@dataclass(slots=True)
class PolicyConfig:
    # what trains: lora (adapters, base frozen) | full (bf16 / fp32 compute) | mxfp8
    mode: Literal[tuple(MODES)] = "lora"
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # sequences per forward / backward at most (gradients accumulate over a mini-batch); 0: as many as
    # max_tokens_per_micro_batch lets in
    micro_batch_size: int = 0
    # tokens per forward / backward at most (a packed micro-batch's tokens, an unpacked one's rows x width), at least
    # rollout.max_model_len; the data ranks' shares balanced by tokens. null: 16384, or rollout.max_model_len where
    # longer; 0: micro_batch_size alone cuts them
    max_tokens_per_micro_batch: int | None = None
    # compute dtype (lora: the frozen base; full: the model copy): auto | bfloat16 | float32
    dtype: Literal[DTYPE_NAMES] = "auto"
    device: str = "auto"  # auto (CUDA where present) | cpu | cuda | cuda:N (moerl.device)
    reference: bool = False  # full / mxfp8: keep a frozen copy for reference logprobs (lora: adapters off)
    max_nan_steps: int = 3  # consecutive non-finite steps that stop training
    mx_scale_mode: Literal[SCALE_MODES] = "rceil"  # mxfp8: floor | rceil
    packing: bool = True  # forwards run on the micro-batch's sequences packed into fewer rows (moerl.trainer.packing)
    # tokens whose logits exist at once: the head, log-softmax, logprob and entropy run in chunks of this many
    # tokens, each computed again in the backward (moerl.trainer.logprobs); 0: a micro-batch's logits all at once
    logits_chunk: int = 2048
    # each decoder block's activations computed again in the backward instead of kept (moerl.parallel.checkpointing):
    # none | full (only the blocks' inputs kept) | selective (their attention outputs kept too)
    activation_checkpointing: Literal[CHECKPOINTING] = "none"
    # full / mxfp8: the fp32 masters, their gradients and the optimizer state in host memory, the optimizer step run
    # there (FSDP2's CPUOffloadPolicy for sharded weights); the GPU keeps the weights in the compute dtype. On a CPU
    # policy the host is the device: nothing moves
    cpu_offload: bool = False
    # AdamW steps each trained tensor in the backward, as soon as its gradient is whole, and frees that gradient: a
    # step never holds the whole model's gradients (a full fine-tune's largest share once its blocks are recomputed;
    # moerl.trainer.in_backward). One process, a step of one micro-batch, no clipping (policy.optim.grad_clip: 0); a
    # non-finite gradient skips the tensors from it on, not those stepped before it
    optimizer_in_backward: bool = False
    # the training forward / backward compiled by decoder block (moerl.trainer.compile): auto (the loop decides from
    # its first steps' times, and keeps them where faster) | True | False
    compile: bool | Literal["auto"] = "auto"

    @property
    def token_budget(self) -> int:
        """``max_tokens_per_micro_batch`` as a number (null: ``TOKENS_PER_MICRO_BATCH``; a run config sets it to its
        context window where that is longer)."""
        budget = self.max_tokens_per_micro_batch
        return TOKENS_PER_MICRO_BATCH if budget is None else budget

    def __post_init__(self) -> None:
        mode = mode_of(self.mode, key="PolicyConfig.mode")
        dtype_name(self.dtype, key="PolicyConfig.dtype")  # auto: bf16 where native, else fp32 (moerl.precision)
        device_name(self.device, key="policy.device")  # what this host lacks is refused where the policy is built
        rules = (
            ("micro_batch_size", self.micro_batch_size, self.micro_batch_size >= 0, "must be >= 0"),
            (
                "max_tokens_per_micro_batch",
                self.max_tokens_per_micro_batch,
                self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 0,
                "must be >= 0 (0: micro_batch_size alone cuts the micro-batches; null: 16384 or the context window)",
            ),
            (
                "micro_batch_size",
                self.micro_batch_size,
                self.micro_batch_size >= 1 or self.max_tokens_per_micro_batch != 0,
                "0 (no row limit) needs a token limit: set policy.max_tokens_per_micro_batch",
            ),
            ("max_nan_steps", self.max_nan_steps, self.max_nan_steps >= 1, "must be >= 1"),
            ("logits_chunk", self.logits_chunk, self.logits_chunk >= 0, "must be >= 0 (0: all at once)"),
            (
                "activation_checkpointing",
                self.activation_checkpointing,
                self.activation_checkpointing in CHECKPOINTING,
                f"allowed: {', '.join(CHECKPOINTING)}",
            ),
            (
                "activation_checkpointing",
                self.activation_checkpointing,
                self.activation_checkpointing == "none" or self.compile is not True,
                "with policy.compile=true: compiled blocks that recompute in the backward are not built; set "
                "policy.compile to auto or false (auto stays eager under checkpointing)",
            ),
            (
                "cpu_offload",
                self.cpu_offload,
                not self.cpu_offload or mode.masters,
                f"with policy.mode={self.mode}: not built (its trained adapters and their optimizer state are small: "
                "they stay on the GPU); set it to false, or train in full or mxfp8 mode",
            ),
            (
                "optimizer_in_backward",
                self.optimizer_in_backward,
                not self.optimizer_in_backward or self.optim.grad_clip == 0,
                f"with policy.optim.grad_clip={self.optim.grad_clip}: clipping needs the whole model's gradient norm "
                "before any tensor steps; set policy.optim.grad_clip: 0, or optimizer_in_backward: false",
            ),
            (
                "mx_scale_mode",
                self.mx_scale_mode,
                self.mx_scale_mode in SCALE_MODES,
                f"allowed: {', '.join(SCALE_MODES)}",
            ),
        )
        require("PolicyConfig.{}", rules)
        check_compile(self.compile, ranks=1, mode=mode)
