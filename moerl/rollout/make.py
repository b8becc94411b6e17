"""Rollout engines by name: native (moerl's own, in this process or in engine processes) or vLLM."""

from __future__ import annotations

from moerl.engine import EngineConfig
from moerl.errors import ConfigError
from moerl.rollout.engine import InferenceEngine


def make_engine(
    kind: str,
    model,
    config: EngineConfig | None = None,
    placement: str = "inprocess",
    num_engines: int = 1,
    weight_transport: str = "auto",
    timeout_s: float = 300.0,
    **spec,
) -> InferenceEngine:
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
