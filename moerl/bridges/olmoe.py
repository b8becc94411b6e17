"""OLMoE: q/k RMSNorm over the whole projection (not per head), optional q/k/v clipping, every layer MoE."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules
from moerl.model.config import ModelConfig

ARCH = "OlmoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    f["head_dim"] = f["hidden_size"] // f["num_heads"]  # OLMoE has no head_dim field
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
        clip_qkv=c.opt("clip_qkv", float),
        norm_topk_prob=c.opt("norm_topk_prob", bool, False),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    cfg = common_preset(p, ARCH, "olmoe", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "intermediate_size": p.moe_intermediate_size,
        "norm_topk_prob": False,
        "clip_qkv": None,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    del cfg["head_dim"]  # OLMoE derives it: hidden_size // num_attention_heads
    return cfg


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="olmoe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
)
