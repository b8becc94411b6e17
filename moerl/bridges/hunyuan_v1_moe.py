"""HunYuan-MoE-V1: per-head q/k RMSNorm after the rotation, a softmax top-k router (renormalised) under
``gate.wg``, an always-on shared MLP (``shared_mlp``), every layer MoE."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

ARCH = "HunYuanMoEV1ForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    for key in ("num_experts", "moe_topk"):
        if isinstance(c.data.get(key), list):  # per-layer expert counts: the generic decoder has one per model
            raise ConfigError(f"{c.source}: field {key!r} is a per-layer list; not built (one value for all layers)")
    size = c.req("intermediate_size", int)
    bias = c.opt("attention_bias", bool, False)
    return ModelConfig(
        **f,
        intermediate_size=0,
        num_experts=c.first(("num_experts", "num_local_experts"), int),
        top_k=c.first(("moe_topk", "num_experts_per_tok"), int),
        moe_intermediate_size=size,
        moe_layers=list(range(f["num_layers"])),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        qk_norm_after_rope=True,
        norm_topk_prob=True,
        shared_expert_size=size,
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "hunyuan_v1_moe", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "moe_topk": p.top_k,
        "intermediate_size": p.moe_intermediate_size,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="hunyuan_v1_moe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.wg.weight", "layers.{i}.mlp.router.weight"),
        Rule("model.layers.{i}.mlp.shared_mlp.{x}", "layers.{i}.mlp.shared_experts.{x}"),
        Rule("model.layers.{i}.self_attn.query_layernorm.weight", "layers.{i}.self_attn.q_norm.weight"),
        Rule("model.layers.{i}.self_attn.key_layernorm.weight", "layers.{i}.self_attn.k_norm.weight"),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
)
