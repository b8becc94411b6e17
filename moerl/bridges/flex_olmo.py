"""FlexOlmo: OLMo-2's post-sublayer norms (``x + norm(f(x))``, no input norm), q/k RMSNorm over the whole
projection, a softmax top-k router (optionally renormalised), every layer MoE."""

import dataclasses

from moerl.bridges import olmoe
from moerl.bridges.base import Bridge, HFConfig, Preset, common_preset
from moerl.model.config import ModelConfig

ARCH = "FlexOlmoForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    """OLMoE's mapping (the same fields, the same tensor names) with the norms after each sublayer."""
    return dataclasses.replace(olmoe.config_from_hf(c), norm_placement="post")


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    cfg = common_preset(p, ARCH, "flex_olmo", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "intermediate_size": p.moe_intermediate_size,
        "norm_topk_prob": False,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    }
    del cfg["head_dim"]
    return cfg


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="flex_olmo",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=olmoe.BRIDGE.rules,
)
