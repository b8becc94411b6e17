"""Bridge files by HF ``architectures`` name: a static table, each file imported the first time its architecture is
asked for (``model_type`` is an alias for the CLI). A new family is its file in moerl/bridges/ (``BRIDGE =
Bridge(...)``) and its line in ``FAMILIES``. A checkpoint of an architecture without one: ``moerl.bridges.find``."""

from __future__ import annotations

import importlib

from moerl.bridges.base import Bridge
from moerl.errors import UnknownArchitectureError

FAMILIES = {  # architecture -> its bridge file (a module of moerl.bridges, or a dotted module path)
    "DbrxForCausalLM": "dbrx",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "FlexOlmoForCausalLM": "flex_olmo",
    "GptOssForCausalLM": "gpt_oss",
    "GraniteMoeForCausalLM": "granitemoe",
    "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
    "JetMoeForCausalLM": "jetmoe",
    "LongcatFlashForCausalLM": "longcat_flash",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "PhimoeForCausalLM": "phimoe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_BRIDGES: dict[str, Bridge] = {}  # the bridge files loaded so far, by architecture


def bridge_file(arch: str) -> Bridge | None:
    """The bridge of architecture ``arch`` from its file (imported now if it was not), or None: no file."""
    if arch not in _BRIDGES and arch in FAMILIES:
        module = FAMILIES[arch]
        _BRIDGES[arch] = importlib.import_module(module if "." in module else f"moerl.bridges.{module}").BRIDGE
    return _BRIDGES.get(arch)


def supported() -> list[str]:
    """HF architecture names moerl has a bridge file for."""
    return sorted(set(FAMILIES) | set(_BRIDGES))


def bridge_for_arch(arch: str) -> Bridge:
    """Bridge by HF architecture (``Qwen3MoeForCausalLM``) or model_type (``qwen3_moe``)."""
    if (bridge := bridge_file(arch)) is not None:
        return bridge
    bridges = [bridge_file(a) for a in supported()]
    for bridge in bridges:
        if bridge.model_type in (arch, f"{arch}_text"):  # qwen3_5_moe: the text model of qwen3_5_moe
            return bridge
    raise UnknownArchitectureError(
        f"unknown architecture {arch!r}; supported: {', '.join(supported())} "
        f"(or their model_type: {', '.join(sorted({b.model_type for b in bridges}))})"
    )


def text_architecture(model_type: str) -> str | None:
    """The causal-LM architecture of a text model_type: a bridge file's, else transformers' (then derived)."""
    for arch in supported():
        if bridge_file(arch).model_type == model_type:
            return arch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
