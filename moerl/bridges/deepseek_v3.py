"""DeepSeek-V3: multi-head latent attention, sigmoid router with a selection-only bias, group-limited top-k,
routed scaling, a shared expert, first-k dense layers, interleaved rotary pairs, YaRN with mscale."""

from moerl.bridges.base import (
    Bridge,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    common_preset,
    expert_rules,
    mtp_layer,
    sparse_layers,
)
from moerl.bridges.shared import mla_fields, mla_preset
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

ARCH = "DeepseekV3ForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    scoring = c.opt("scoring_func", str, "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"{c.source}: field 'scoring_func' is {scoring!r}; DeepSeek-V3 allows: sigmoid")
    method = c.opt("topk_method", str, "noaux_tc")
    if method != "noaux_tc":  # the router below is noaux_tc's (selection bias, groups scored by their top-2 sum)
        raise ConfigError(f"{c.source}: field 'topk_method' is {method!r}; DeepSeek-V3 allows: noaux_tc")
    moe_size = c.req("moe_intermediate_size", int)
    return ModelConfig(
        **f,
        **mla_fields(c, f["rope"], rope_interleave=c.opt("rope_interleave", bool, True)),
        intermediate_size=c.req("intermediate_size", int),
        num_experts=c.first(("n_routed_experts", "num_local_experts"), int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=moe_size,
        moe_layers=sparse_layers(
            f["num_layers"], c.opt("moe_layer_freq", int, 1), first_dense=c.opt("first_k_dense_replace", int, 0)
        ),
        scoring="sigmoid",
        score_correction_bias=True,
        norm_topk_prob=c.opt("norm_topk_prob", bool, True),
        routed_scaling_factor=c.opt("routed_scaling_factor", float, 1.0),
        n_group=c.opt("n_group", int, 1),
        topk_group=c.opt("topk_group", int, 1),
        shared_expert_size=moe_size * c.opt("n_shared_experts", int, 0),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    cfg = common_preset(p, ARCH, "deepseek_v3", bos, eos, pad) | {
        "n_routed_experts": p.num_experts,
        "n_shared_experts": 1,
        "moe_intermediate_size": p.moe_intermediate_size,
        "intermediate_size": p.intermediate_size,
        "first_k_dense_replace": 1,
        "n_group": 4 if p.num_experts % 4 == 0 else 1,
        "topk_group": 2 if p.num_experts % 4 == 0 else 1,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",  # as in the released config.json (vLLM reads these two)
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    return cfg | mla_preset(p)


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="deepseek_v3",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        Rule("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.router.e_score_correction_bias"),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
    ignore=mtp_layer,
)
