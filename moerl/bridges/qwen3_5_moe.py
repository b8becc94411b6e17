"""Qwen3.5-MoE (text): a hybrid of Gated DeltaNet linear-attention layers and gated full-attention layers (an
output gate from q_proj, partial RoPE, per-head q/k norms), 1 + w RMSNorms, softmax -> top-k routing with the top
k renormalised, and a shared expert behind a sigmoid gate in every layer."""

from moerl.bridges.base import (
    Bridge,
    HFConfig,
    Preset,
    common_preset,
)
from moerl.bridges.shared import HYBRID_RULES, hybrid_config, hybrid_pattern
from moerl.model.config import ModelConfig

ARCH = "Qwen3_5MoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    n = c.req("num_hidden_layers", int)
    moe = c.req("moe_intermediate_size", int)  # no dense MLP layer: every layer is MoE
    return hybrid_config(c, intermediate_size=moe, moe_layers=list(range(n)), norm_topk_prob=True)


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "qwen3_5_moe_text", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "moe_intermediate_size": p.moe_intermediate_size,
        "shared_expert_intermediate_size": p.moe_intermediate_size,
        "layer_types": hybrid_pattern(p.num_layers, 4),
        "linear_num_key_heads": p.num_kv_heads,
        "linear_num_value_heads": p.num_heads,
        "linear_key_head_dim": p.head_dim,
        "linear_value_head_dim": p.head_dim,
        "linear_conv_kernel_dim": 4,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="qwen3_5_moe_text",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=HYBRID_RULES,
)
