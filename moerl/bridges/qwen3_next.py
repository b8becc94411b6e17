"""Qwen3-Next: the Qwen hybrid of Qwen3.5-MoE (``moerl.bridges.qwen3_5_moe``) with its linear-attention input
projections fused per key head (``in_proj_qkvz``: q, k, v, z of each key head's group; ``in_proj_ba``: b, a), split
into moerl's (Qwen3.5's) projections on load and fused back on export, and dense MLP layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say."""

from moerl.bridges.base import Bridge, HFConfig, Preset, sparse_layers
from moerl.bridges.qwen3_5_moe import preset_config as hybrid_preset
from moerl.bridges.shared import FUSED, HYBRID_RULES, hybrid_config
from moerl.model.config import ModelConfig

ARCH = "Qwen3NextForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    n = c.req("num_hidden_layers", int)
    return hybrid_config(
        c,
        intermediate_size=c.req("intermediate_size", int),
        moe_layers=sparse_layers(n, c.opt("decoder_sparse_step", int, 1), c.opt("mlp_only_layers", list, [])),
        norm_topk_prob=c.opt("norm_topk_prob", bool, True),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return hybrid_preset(p, bos, eos, pad) | {
        "architectures": [ARCH],
        "model_type": "qwen3_next",
        "intermediate_size": p.intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="qwen3_next",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=HYBRID_RULES,
    fused=FUSED,
)
