"""The InferenceEngine protocol: generate, push weights, load adapters. The native engine implements it as is; the
pool of native engines (in process or in engine processes) implements it for the loop."""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

from moerl.engine import EngineConfig, Request, RequestOutput
from moerl.errors import ConfigError


@runtime_checkable
class InferenceEngine(Protocol):
    """A rollout backend. Outputs carry sampled-token logprobs, routed experts and the weight version."""

    weight_version: int

    def generate(self, requests: list[Request]) -> list[RequestOutput]: ...

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def discard_staged(self) -> None: ...

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def commit_weights(self, version: int) -> None: ...

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def add_adapter(self, name: str, source: str | os.PathLike | dict[str, torch.Tensor]) -> None: ...


def make_engine(
    kind: str,
    model,
    config: EngineConfig | None = None,
    placement: str = "inprocess",
    num_engines: int = 1,
    weight_transport: str = "auto",
    timeout_s: float = 300.0,
    **spec,
):
    """Rollout engines by name, ``num_engines`` of them behind one InferenceEngine: ``native`` (moerl's own), in this
    process or each in its own process (``placement``; weights reach those by ``weight_transport``, see
    ``moerl.rollout.transport``; one that makes no progress for ``timeout_s`` is named as hung); or ``vllm``
    (always in vLLM's own processes). ``spec``: the rest of :class:`EngineSpec`."""
    from moerl.rollout.pool import EnginePool
    from moerl.rollout.spec import EngineSpec

    spec = EngineSpec(str(model), config or EngineConfig(), **spec)
    if kind == "vllm":
        from moerl.rollout.vllm import VLLMEngine

        return VLLMEngine(spec, lora=spec.config.max_loras > 0, num_engines=num_engines, timeout_s=timeout_s)
    if kind != "native":
        raise ConfigError(f"rollout engine {kind!r}: allowed: native, vllm")
    return EnginePool(spec, placement, num_engines, transport=weight_transport, timeout_s=timeout_s)
