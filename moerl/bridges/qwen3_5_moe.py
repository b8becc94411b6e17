"""Qwen3.5-MoE (text): a hybrid of Gated DeltaNet linear-attention layers and gated full-attention layers (an
output gate from q_proj, partial RoPE, per-head q/k norms), 1 + w RMSNorms, softmax -> top-k routing with the top
k renormalised, and a shared expert behind a sigmoid gate in every layer."""

from moerl.bridges.base import (
    LINEAR_ATTENTION_RULES,
    Bridge,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    common_preset,
    expert_rules,
    layer_types,
    linear_attention_fields,
    minus_one,
    partial_rope_dim,
    plus_one,
)
from moerl.bridges.registry import register
from moerl.model.config import ModelConfig

ARCH = "Qwen3_5MoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    n = c.req("num_hidden_layers", int)
    moe = c.req("moe_intermediate_size", int)  # no dense MLP layer: every layer is MoE
    return hybrid_config(c, intermediate_size=moe, moe_layers=list(range(n)), norm_topk_prob=True)


def hybrid_config(c: HFConfig, **mlp) -> ModelConfig:
    """The config of a Qwen hybrid (Qwen3.5-MoE, Qwen3-Next) but for its MLP layout (``mlp``: intermediate_size,
    moe_layers, norm_topk_prob)."""
    f = common_fields(c)
    n = f["num_layers"]
    if c.opt("layer_types", list) is None:  # the config's own default: every interval-th layer full attention
        every = c.opt("full_attention_interval", int, 4)
        c = HFConfig(c.data | {"layer_types": _pattern(n, every)}, c.source)
    types, _ = layer_types(c, n, linear=True)
    bias = c.opt("attention_bias", bool, False)
    return ModelConfig(
        **f,
        **mlp,
        num_experts=c.req("num_experts", int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("moe_intermediate_size", int),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="head",
        attn_output_gate=True,
        rope_dim=partial_rope_dim(c, f["head_dim"], default=0.25),  # the config's own default
        layer_types=types,
        shared_expert_size=c.req("shared_expert_intermediate_size", int),
        shared_expert_gate=True,
        **linear_attention_fields(c),
    )


def _pattern(n: int, every: int) -> list[str]:
    return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "qwen3_5_moe_text", bos, eos, pad) | {
        "num_experts": p.num_experts,
        "moe_intermediate_size": p.moe_intermediate_size,
        "shared_expert_intermediate_size": p.moe_intermediate_size,
        "layer_types": _pattern(p.num_layers, 4),
        "linear_num_key_heads": p.num_kv_heads,
        "linear_num_value_heads": p.num_heads,
        "linear_key_head_dim": p.head_dim,
        "linear_value_head_dim": p.head_dim,
        "linear_conv_kernel_dim": 4,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
    }


NORMS = ("input_layernorm", "post_attention_layernorm")

HYBRID_RULES = (
    *(Rule(f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight", load=plus_one, save=minus_one) for n in NORMS),
    *(
        Rule(
            f"model.layers.{{i}}.self_attn.{n}.weight",
            f"layers.{{i}}.self_attn.{n}.weight",
            load=plus_one,
            save=minus_one,
        )
        for n in ("q_norm", "k_norm")
    ),
    Rule("model.norm.weight", "norm.weight", load=plus_one, save=minus_one),
    *LINEAR_ATTENTION_RULES,
    Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    Rule("model.layers.{i}.mlp.shared_expert.{x}", "layers.{i}.mlp.shared_experts.{x}"),
    Rule("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_experts_gate.weight"),
    *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
)

BRIDGE = register(
    Bridge(
        architectures=(ARCH,),
        model_type="qwen3_5_moe_text",
        config_from_hf=config_from_hf,
        preset_config=preset_config,
        rules=HYBRID_RULES,
    )
)
