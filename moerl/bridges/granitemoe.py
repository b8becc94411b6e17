"""GraniteMoe: multipliers on the embeddings, the residual branches and the attention scores, logits divided by
a scaling, a top-k-then-softmax router, experts stored fused as ``input_linear`` [E, 2I, H] (gate rows first) and
``output_linear`` [E, H, I]."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset
from moerl.model.config import ModelConfig

ARCH = "GraniteMoeForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    bias = c.opt("attention_bias", bool, False)
    return ModelConfig(
        **f,
        intermediate_size=0,
        num_experts=c.req("num_local_experts", int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=c.req("intermediate_size", int),
        moe_layers=list(range(f["num_layers"])),
        qkv_bias=bias,
        o_bias=bias,
        topk_before_softmax=True,
        attn_scale=c.opt("attention_multiplier", float, 1.0),
        embedding_multiplier=c.opt("embedding_multiplier", float, 1.0),
        residual_multiplier=c.opt("residual_multiplier", float, 1.0),
        logits_scaling=c.opt("logits_scaling", float, 1.0),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "granitemoe", bos, eos, pad) | {
        "num_local_experts": p.num_experts,
        "intermediate_size": p.moe_intermediate_size,
        "attention_multiplier": p.head_dim**-0.5,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "logits_scaling": 6.0,
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="granitemoe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    peft_experts="model.layers.{i}.block_sparse_moe.experts",
    rules=(
        Rule("model.layers.{i}.block_sparse_moe.router.layer.weight", "layers.{i}.mlp.router.weight"),
        Rule("model.layers.{i}.block_sparse_moe.input_linear.weight", "layers.{i}.mlp.experts.gate_up_proj"),
        Rule("model.layers.{i}.block_sparse_moe.output_linear.weight", "layers.{i}.mlp.experts.down_proj"),
    ),
)
