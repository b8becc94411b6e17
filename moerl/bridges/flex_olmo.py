"""FlexOlmo: OLMo-2's post-sublayer norms (``x + norm(f(x))``, no input norm), q/k RMSNorm over the whole
projection, a softmax top-k router (optionally renormalised), every layer MoE."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules
from moerl.bridges.registry import register
from moerl.model.config import ModelConfig

ARCH = "FlexOlmoForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    f["head_dim"] = f["hidden_size"] // f["num_heads"]  # FlexOlmo has no head_dim field
    bias = c.opt("attention_bias", bool, False)
    return ModelConfig(
        **f,
        intermediate_size=0,
        num_experts=c.req("num_experts", int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("intermediate_size", int),
        moe_layers=list(range(f["num_layers"])),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        norm_placement="post",
        norm_topk_prob=c.opt("norm_topk_prob", bool, False),
    )


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


BRIDGE = register(
    Bridge(
        architectures=(ARCH,),
        model_type="flex_olmo",
        config_from_hf=config_from_hf,
        preset_config=preset_config,
        rules=(
            Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
            *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
        ),
    )
)
