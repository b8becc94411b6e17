"""Qwen3-MoE: per-head q/k RMSNorm, softmax -> top-k router, optional dense layers by step or list."""

from moerl.bridges.base import (
    Bridge,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    common_preset,
    expert_rules,
    layer_types,
    sparse_layers,
)
from moerl.model.config import ModelConfig

ARCH = "Qwen3MoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    n = f["num_layers"]
    bias = c.opt("attention_bias", bool, False)
    types, window = layer_types(c, n, all_sliding=c.opt("use_sliding_window", bool, False))
    return ModelConfig(
        **f,
        intermediate_size=c.req("intermediate_size", int),
        num_experts=c.first(("num_experts", "num_local_experts"), int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("moe_intermediate_size", int),
        moe_layers=sparse_layers(n, c.opt("decoder_sparse_step", int, 1), c.opt("mlp_only_layers", list, [])),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        layer_types=types,
        sliding_window=window,
        norm_topk_prob=c.opt("norm_topk_prob", bool, False),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "qwen3_moe", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "moe_intermediate_size": p.moe_intermediate_size,
        "intermediate_size": p.intermediate_size,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="qwen3_moe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
)
