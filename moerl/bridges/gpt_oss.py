"""GPT-OSS: attention sinks, alternating sliding/full layers, biases everywhere, top-k -> softmax router with
bias, clamped SwiGLU experts stored 3D as [E, H, 2I] with gate/up columns interleaved."""

import torch

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_fields, common_preset, layer_types
from moerl.model.config import ModelConfig

ARCH = "GptOssForCausalLM"


def config_from_hf(c: HFConfig) -> ModelConfig:
    f = common_fields(c)
    bias = c.opt("attention_bias", bool, True)
    types, window = layer_types(c, f["num_layers"])
    return ModelConfig(
        **f,
        intermediate_size=0,
        num_experts=c.req("num_local_experts", int),
        top_k=c.first(("num_experts_per_tok", "experts_per_token"), int),
        moe_intermediate_size=c.req("intermediate_size", int),
        moe_layers=list(range(f["num_layers"])),
        qkv_bias=bias,
        o_bias=bias,
        layer_types=types,
        sliding_window=window,
        attention_sinks=True,
        topk_before_softmax=True,
        router_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        swiglu_alpha=c.opt("swiglu_alpha", float, 1.702),
        swiglu_limit=c.opt("swiglu_limit", float, 7.0),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    return common_preset(p, ARCH, "gpt_oss", bos, eos, pad) | {
        "num_local_experts": p.num_experts,
        "intermediate_size": p.moe_intermediate_size,
        "attention_bias": True,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.num_layers)],
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
    }


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up alternating -> [..., 2I] gate first, then up."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="gpt_oss",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule(
            "model.layers.{i}.mlp.experts.gate_up_proj",
            "layers.{i}.mlp.experts.gate_up_proj",
            load=lambda t, cfg: _deinterleave(t).transpose(1, 2),
            save=lambda t, cfg: _interleave(t.transpose(1, 2)),
            # LoRA B [..., 2I, r]: the same gate / up de-interleave, on the rows
            rows=lambda b, cfg: _deinterleave(b.transpose(-1, -2)).transpose(-1, -2),
            rows_save=lambda b, cfg: _interleave(b.transpose(-1, -2)).transpose(-1, -2),
        ),
        Rule(
            "model.layers.{i}.mlp.experts.gate_up_proj_bias",
            "layers.{i}.mlp.experts.gate_up_proj_bias",
            load=lambda t, cfg: _deinterleave(t),
            save=lambda t, cfg: _interleave(t),
        ),
        Rule(
            "model.layers.{i}.mlp.experts.down_proj",
            "layers.{i}.mlp.experts.down_proj",
            load=lambda t, cfg: t.transpose(1, 2),
            save=lambda t, cfg: t.transpose(1, 2),
            rows=lambda b, cfg: b,  # a transpose of the layout: the rows of [E, H, I] keep their order
            rows_save=lambda b, cfg: b,
        ),
    ),
)
