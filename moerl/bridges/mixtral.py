"""Mixtral: softmax over the top-k logits (renormalised), experts w1/w3/w2 under block_sparse_moe."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules, layer_types
from moerl.model.config import ModelConfig

ARCH = "MixtralForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    types, window = layer_types(c, f["num_layers"], all_sliding=True)
    return ModelConfig(
        **f,
        intermediate_size=0,
        num_experts=c.req("num_local_experts", int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("intermediate_size", int),
        moe_layers=list(range(f["num_layers"])),
        layer_types=types,
        sliding_window=window,
        norm_topk_prob=True,  # softmax -> top-k -> renormalise == softmax over the top-k logits
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "mixtral", bos, eos, pad) | {
        "num_local_experts": p.num_experts,
        "intermediate_size": p.moe_intermediate_size,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="mixtral",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.router.weight"),
        *expert_rules("block_sparse_moe", "w1", "w3", "w2"),
    ),
)
