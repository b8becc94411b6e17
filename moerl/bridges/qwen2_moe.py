"""Qwen2-MoE (Qwen1.5-MoE): q/k/v bias, a shared expert behind a sigmoid gate, softmax -> top-k router."""

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

ARCH = "Qwen2MoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    n = f["num_layers"]
    types, window = layer_types(c, n)
    if c.opt("layer_types", list) is None and c.opt("use_sliding_window", bool, False):
        # before v5 the window sat on layers below max_window_layers with an odd (i + 1)
        limit = c.opt("max_window_layers", int, n)
        types = ["sliding" if (i + 1) % 2 and i < limit else "full" for i in range(n)]
        window = c.req("sliding_window", int)
    return ModelConfig(
        **f,
        intermediate_size=c.req("intermediate_size", int),
        num_experts=c.first(("num_experts", "num_local_experts"), int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("moe_intermediate_size", int),
        moe_layers=sparse_layers(n, c.opt("decoder_sparse_step", int, 1), c.opt("mlp_only_layers", list, [])),
        qkv_bias=c.opt("qkv_bias", bool, True),
        layer_types=types,
        sliding_window=window,
        norm_topk_prob=c.opt("norm_topk_prob", bool, False),
        shared_expert_size=c.req("shared_expert_intermediate_size", int),
        shared_expert_gate=True,
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "qwen2_moe", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "moe_intermediate_size": p.moe_intermediate_size,
        "shared_expert_intermediate_size": p.moe_intermediate_size * 2,
        "intermediate_size": p.intermediate_size,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": True,
        "use_sliding_window": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="qwen2_moe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        Rule("model.layers.{i}.mlp.shared_expert.{x}", "layers.{i}.mlp.shared_experts.{x}"),
        Rule("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_experts_gate.weight"),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
)
