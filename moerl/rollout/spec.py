"""What builds one rollout engine, in this process, in an engine process or in a Ray actor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moerl.device import resolve_device
from moerl.engine import EngineConfig, LLMEngine
from moerl.precision import compute_dtype


@dataclass(slots=True)
class EngineSpec:
    """What builds one engine, in this process or another: JSON-serialisable."""

    model: str
    config: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "auto"  # auto | bfloat16 | float32 (moerl.precision), resolved where the engine runs
    device: str = "auto"  # auto | cpu | cuda | cuda:N (moerl.device), resolved where the engine runs
    mx_scale_mode: str | None = None  # mxfp8 policies: quantize the engine's GEMMs the trainer's way
    threads: int = 0  # torch threads of an engine process (0: leave torch's default)
    vllm_args: dict = field(default_factory=dict)  # engine=vllm: more vllm.LLM arguments
    kind: str = "native"  # native | vllm (a Ray engine actor builds either)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EngineSpec:
        return cls(**{**data, "config": EngineConfig(**data["config"])})


def build_native(spec: EngineSpec) -> LLMEngine:
    """The native engine ``spec`` describes (the same function builds it in process and in an engine process)."""
    device = resolve_device(spec.device, key="rollout.device")
    dtype = compute_dtype(spec.dtype, device, key="rollout.dtype")
    engine = LLMEngine(spec.model, spec.config, dtype=dtype, device=device)
    if spec.mx_scale_mode is not None:
        from moerl.model.mx import apply_mxfp8

        apply_mxfp8(engine.model, spec.mx_scale_mode, keep=True)
    return engine
