"""Bridges by HF ``architectures`` name (and by ``model_type`` as an alias for the CLI)."""

from __future__ import annotations

from moerl.bridges.base import Bridge
from moerl.errors import UnknownArchitectureError

_BRIDGES: dict[str, Bridge] = {}


def register(bridge: Bridge) -> Bridge:
    for arch in bridge.architectures:
        _BRIDGES[arch] = bridge
    return bridge


def supported() -> list[str]:
    """HF architecture names moerl can load."""
    _load_families()
    return sorted(_BRIDGES)


def bridge_for_arch(arch: str) -> Bridge:
    """Bridge by HF architecture (``Qwen3MoeForCausalLM``) or model_type (``qwen3_moe``)."""
    _load_families()
    if arch in _BRIDGES:
        return _BRIDGES[arch]
    for bridge in _BRIDGES.values():
        if bridge.model_type in (arch, f"{arch}_text"):  # qwen3_5_moe: the text model of qwen3_5_moe
            return bridge
    raise UnknownArchitectureError(
        f"unknown architecture {arch!r}; supported: {', '.join(supported())} "
        f"(or their model_type: {', '.join(sorted({b.model_type for b in _BRIDGES.values()}))})"
    )


def text_architecture(model_type: str) -> str | None:
    """The causal-LM architecture of a text model_type: a bridge's, else transformers' (then derived)."""
    _load_families()
    for bridge in _BRIDGES.values():
        if bridge.model_type == model_type:
            return bridge.architectures[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def get_bridge(hf_config: dict, source: str = "config.json") -> Bridge:
    """The bridge for a config.json dict, from its ``architectures`` list."""
    archs = hf_config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise UnknownArchitectureError(
            f"{source}: field 'architectures' is missing or not a list; supported: {', '.join(supported())}"
        )
    _load_families()
    if archs[0] in _BRIDGES:
        return _BRIDGES[archs[0]]
    from moerl.bridges.derived import derived_bridge  # no bridge file: derive one and prove it first

    try:
        return derived_bridge(hf_config)
    except UnknownArchitectureError as e:
        raise UnknownArchitectureError(
            f"{source}: no bridge file for architecture {archs[0]!r} (bridges: {', '.join(supported())}), and {e}"
        ) from None


def _load_families() -> None:
    # importing a family module registers its bridge
    from moerl.bridges import (  # noqa: F401
        deepseek_v2,
        deepseek_v3,
        ernie4_5_moe,
        flex_olmo,
        gpt_oss,
        granitemoe,
        hunyuan_v1_moe,
        mixtral,
        olmoe,
        phimoe,
        qwen2_moe,
        qwen3_5_moe,
        qwen3_moe,
        qwen3_next,
    )
