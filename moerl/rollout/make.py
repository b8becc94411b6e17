"""Rollout engines by name: native (moerl's own, in this process or in engine processes) or vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moerl.engine import EngineConfig
from moerl.rollout.engine import InferenceEngine

if TYPE_CHECKING:
    from moerl.rollout.spec import EngineSpec


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
    """Rollout engines by name, ``num_engines`` of them behind one InferenceEngine (an ``EnginePool``): ``native``
    (moerl's own), in this process or each in its own process (``placement``; weights reach those by
    ``weight_transport``, see ``moerl.rollout.transport``; one that makes no progress for ``timeout_s`` is named as
    hung); or ``vllm`` (each in vLLM's own processes). ``spec``: the rest of :class:`EngineSpec`. The values are
    checked as the run config checks its ``rollout`` section."""
    from moerl.rollout.pool import EnginePool
    from moerl.rollout.spec import EngineSpec
    from moerl.run_config import RolloutSection

    RolloutSection(
        engine=kind, placement=placement, num_engines=num_engines, weight_transport=weight_transport
    ).check_placement("local")
    spec = EngineSpec(str(model), config or EngineConfig(), **spec)
    if kind == "vllm":
        return EnginePool(spec, "vllm", num_engines, handles=vllm_engines(spec, num_engines, timeout_s))
    return EnginePool(spec, placement, num_engines, transport=weight_transport, timeout_s=timeout_s)


def vllm_engines(spec: EngineSpec, num_engines: int, timeout_s: float) -> list:
    """``num_engines`` vLLM engines started one after the other (on a CPU each bound to its own cores), sharing one
    staging buffer, each behind a handle that works side by side with the others; all closed if one fails to
    start."""
    from moerl.rollout.local import LocalEngine
    from moerl.rollout.vllm import VLLMEngine, say_what_it_serves
    from moerl.rollout.vllm_args import cpu_binds

    lora = spec.config.max_loras > 0
    say_what_it_serves(spec, lora)
    handles, staging = [], None
    try:
        for i, bind in enumerate(cpu_binds(num_engines, spec.threads)):
            engine = VLLMEngine(spec, lora, timeout_s, index=i, bind=bind, staging=staging)
            staging = engine.staging
            handles.append(LocalEngine(engine, i, side_by_side=True))
    except BaseException:
        for h in handles:
            h.close()
        raise
    return handles
