"""Ernie-4.5-MoE: interleaved rotary pairs, biases on every linear (and the tied head), a softmax router whose
selection adds a correction bias and whose weights are normalised with a floor, MoE layers from a start / end /
interval pattern, shared experts."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

ARCH = "Ernie4_5_MoeForCausalLM"


def _moe_layers(c: HFConfig, n: int) -> list[int]:
    start = c.opt("moe_layer_start_index", int, 1)
    end = c.opt("moe_layer_end_index", int, n - 1)
    end = n - 1 if end == -1 else end
    step = c.opt("moe_layer_interval", int, 1)
    if step < 1:
        raise ConfigError(f"{c.source}: field 'moe_layer_interval' is {step}; must be >= 1")
    return [i for i in range(n) if (i + 1) % step == 0 and start <= i <= end]


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    f["tie_word_embeddings"] = c.opt("tie_word_embeddings", bool, True)
    bias = c.opt("use_bias", bool, False)
    moe_size = c.req("moe_intermediate_size", int)
    return ModelConfig(
        **f,
        intermediate_size=c.req("intermediate_size", int),
        num_experts=c.first(("moe_num_experts", "num_experts"), int),
        top_k=c.first(("moe_k", "num_experts_per_tok"), int),
        moe_intermediate_size=moe_size,
        moe_layers=_moe_layers(c, f["num_layers"]),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        lm_head_bias=bias,
        rope_interleave=True,
        score_correction_bias=True,
        norm_topk_prob=True,
        norm_topk_min=c.opt("moe_norm_min", float, 1e-12),
        shared_expert_size=moe_size * c.opt("moe_num_shared_experts", int, 0),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "ernie4_5_moe", bos, eos, pad) | {
        "moe_num_experts": p.num_experts,
        "moe_k": p.top_k,
        "moe_intermediate_size": p.moe_intermediate_size,
        "intermediate_size": p.intermediate_size,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": p.num_layers - 1,
        "moe_layer_interval": 1,
        "moe_norm_min": 1e-12,
        "use_bias": False,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="ernie4_5_moe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        Rule(  # stored [1, E]
            "model.layers.{i}.mlp.moe_statics.e_score_correction_bias",
            "layers.{i}.mlp.router.e_score_correction_bias",
            load=lambda t, cfg: t.reshape(-1),
            save=lambda t, cfg: t.reshape(1, -1),
        ),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
)
