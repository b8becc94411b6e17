"""DeepSeek-V2: multi-head latent attention (rotary pairs interleaved), a softmax router, greedy or group-limited
top-k (a group scores its best expert), routed scaling without renormalisation, shared experts, first-k dense."""

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, expert_rules
from moerl.bridges.shared import mla_fields, mla_preset
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

ARCH = "DeepseekV2ForCausalLM"
TOPK_METHODS = ("greedy", "group_limited_greedy")


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    method = c.opt("topk_method", str, "greedy")
    if method not in TOPK_METHODS:
        raise ConfigError(
            f"{c.source}: field 'topk_method' is {method!r}; DeepSeek-V2 allows: {', '.join(TOPK_METHODS)}"
        )
    if c.opt("norm_topk_prob", bool, False):  # transformers' V2 router never renormalises; the original code did
        raise ConfigError(
            f"{c.source}: field 'norm_topk_prob' is true: not built for DeepSeek-V2 (transformers ignores it)"
        )
    groups = method == "group_limited_greedy"
    moe_size = c.req("moe_intermediate_size", int)
    return ModelConfig(
        **f,
        **mla_fields(c, f["rope"], rope_interleave=True),
        intermediate_size=c.req("intermediate_size", int),
        num_experts=c.first(("n_routed_experts", "num_local_experts"), int),
        top_k=c.req("num_experts_per_tok", int),
        moe_intermediate_size=moe_size,
        moe_layers=list(range(c.opt("first_k_dense_replace", int, 0), f["num_layers"])),
        routed_scaling_factor=c.opt("routed_scaling_factor", float, 1.0),
        n_group=c.opt("n_group", int, 1) if groups else 1,
        topk_group=c.opt("topk_group", int, 1) if groups else 1,
        group_score="max" if groups else "top2_sum",
        shared_expert_size=moe_size * c.opt("n_shared_experts", int, 0),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    cfg = common_preset(p, ARCH, "deepseek_v2", bos, eos, pad) | {
        "n_routed_experts": p.num_experts,
        "n_shared_experts": 1,
        "moe_intermediate_size": p.moe_intermediate_size,
        "intermediate_size": p.intermediate_size,
        "first_k_dense_replace": 1,
        "topk_method": "group_limited_greedy" if p.num_experts % 4 == 0 else "greedy",
        "n_group": 4 if p.num_experts % 4 == 0 else 1,
        "topk_group": 2 if p.num_experts % 4 == 0 else 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    return cfg | mla_preset(p)


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="deepseek_v2",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *expert_rules("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
)
