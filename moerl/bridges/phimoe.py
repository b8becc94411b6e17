"""PhiMoE (Phi-3.5-MoE): LayerNorm with bias, an lm_head bias, attention biases, optional sliding window on every
layer, and sparsemixer routing (top-2) in its deterministic eval form; R3 replays the chosen experts with the
same weight rule around them (``Router._sparsemixer_weights``)."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules, layer_types
from moerl.model.config import ModelConfig

ARCH = "PhimoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    types, window = layer_types(c, f["num_layers"], all_sliding=True)
    bias = c.opt("attention_bias", bool, False)
    return ModelConfig(
        **f,
        intermediate_size=0,
        num_experts=c.req("num_local_experts", int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("intermediate_size", int),
        moe_layers=list(range(f["num_layers"])),
        layer_types=types,
        sliding_window=window,
        qkv_bias=bias,
        o_bias=bias,
        norm="layer",
        lm_head_bias=c.opt("lm_head_bias", bool, False),
        scoring="sparsemixer",
        sparsemixer_eps=c.opt("router_jitter_noise", float, 0.01),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "phimoe", bos, eos, pad) | {
        "num_local_experts": p.num_experts,
        "num_experts_per_tok": 2,
        "intermediate_size": p.moe_intermediate_size,
        "router_jitter_noise": 0.01,
        "input_jitter_noise": 0.0,
        "attention_bias": True,
        "lm_head_bias": True,
        "sliding_window": None,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="phimoe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.router.weight"),
        *expert_rules("block_sparse_moe", "w1", "w3", "w2"),
    ),
)
