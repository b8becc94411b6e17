"""The policy's configuration: what trains (the mode and its LoRA / MX settings), the optimizer and schedule, the
micro-batch, dtype and device; every value checked here, once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moerl.device import device_name
from moerl.errors import ConfigError
from moerl.model.lora import LoraConfig
from moerl.model.mx import SCALE_MODES
from moerl.modes import mode_of
from moerl.precision import dtype_name
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
        mode = mode_of(self.mode, key="PolicyConfig.mode")
        dtype_name(self.dtype, key="PolicyConfig.dtype")  # auto: bf16 where native, else fp32 (moerl.precision)
        device_name(self.device, key="policy.device")  # what this host lacks is refused where the policy is built
        if self.micro_batch_size < 1:
            raise ConfigError(f"PolicyConfig.micro_batch_size={self.micro_batch_size}: must be >= 1")
        if self.max_nan_steps < 1:
            raise ConfigError(f"PolicyConfig.max_nan_steps={self.max_nan_steps}: must be >= 1")
        if self.mx_scale_mode not in SCALE_MODES:
            raise ConfigError(f"PolicyConfig.mx_scale_mode={self.mx_scale_mode!r}: allowed: {', '.join(SCALE_MODES)}")
        check_compile(self.compile, ranks=1, mode=mode)
