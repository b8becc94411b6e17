"""Parts several bridges share, and the derivation with them: DeepSeek's multi-head latent attention fields, the
Qwen hybrids' config and tensor rules (Qwen3.5-MoE, Qwen3-Next), Qwen3-Next's fused linear-attention projections."""

from __future__ import annotations

import torch

from moerl.bridges.base import (
    LINEAR_ATTENTION_RULES,
    Fused,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    expert_rules,
    layer_types,
    linear_attention_fields,
    minus_one,
    partial_rope_dim,
    plus_one,
)
from moerl.model.config import ModelConfig
from moerl.model.rope import yarn_softmax_mscale

# -- DeepSeek-V2 / V3: multi-head latent attention ------------------------------------------------------------------


def mla_fields(c: HFConfig, rope, rope_interleave: bool) -> dict:
    """The multi-head latent attention fields DeepSeek-V2 and V3 share (and their YaRN softmax scale)."""
    nope, rope_dim = c.req("qk_nope_head_dim", int), c.req("qk_rope_head_dim", int)
    bias = c.opt("attention_bias", bool, False)
    return dict(
        attention="mla",
        qkv_bias=bias,
        o_bias=bias,
        q_lora_rank=c.opt("q_lora_rank", int),
        kv_lora_rank=c.req("kv_lora_rank", int),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=c.req("v_head_dim", int),
        rope_interleave=rope_interleave,
        attn_scale=(nope + rope_dim) ** -0.5 * yarn_softmax_mscale(rope),
    )


def mla_preset(p: Preset) -> dict:
    """The latent-attention fields of a DeepSeek preset config.json (V2 and V3 alike)."""
    return {
        "q_lora_rank": p.hidden_size // 2,
        "kv_lora_rank": p.hidden_size // 4,
        "qk_nope_head_dim": p.head_dim,
        "qk_rope_head_dim": p.head_dim // 2,
        "v_head_dim": p.head_dim,
        "head_dim": p.head_dim // 2,  # transformers reads the rotary dim from head_dim
        "num_key_value_heads": p.num_heads,  # MLA: every head has its own k/v from the latent
        "attention_bias": False,
    }


# -- the Qwen hybrids: Gated DeltaNet layers and gated full attention -----------------------------------------------


def hybrid_config(c: HFConfig, **mlp) -> ModelConfig:
    """The config of a Qwen hybrid (Qwen3.5-MoE, Qwen3-Next) but for its MLP layout (``mlp``: intermediate_size,
    moe_layers, norm_topk_prob)."""
    f = common_fields(c)
    n = f["num_layers"]
    if c.opt("layer_types", list) is None:  # the config's own default: every interval-th layer full attention
        every = c.opt("full_attention_interval", int, 4)
        c = HFConfig(c.data | {"layer_types": hybrid_pattern(n, every)}, c.source)
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


def hybrid_pattern(n: int, every: int) -> list[str]:
    return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]


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


# -- Qwen3-Next: linear-attention input projections fused per key head ----------------------------------------------


def _group_sizes(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(key heads, key head dim, value heads per key head, value head dim)."""
    nk = cfg.linear_num_key_heads
    return nk, cfg.linear_key_head_dim, cfg.linear_num_value_heads // nk, cfg.linear_value_head_dim


def split_qkvz(t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """[nk * (2 dk + 2 r dv), H], grouped per key head -> q | k | v (moerl's in_proj_qkv) and z, head-major."""
    nk, dk, r, dv = _group_sizes(cfg)
    q, k, v, z = t.reshape(nk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z)]
    return [torch.cat(flat[:3]), flat[3]]


def join_qkvz(parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    nk, dk, r, dv = _group_sizes(cfg)
    qkv, z = parts
    q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])
    grouped = [x.reshape(nk, -1, qkv.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(grouped, dim=1).reshape(-1, qkv.shape[-1])


def split_ba(t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """[nk * 2r, H], grouped per key head -> b, a ([nv, H] each, head-major)."""
    nk, _, r, _ = _group_sizes(cfg)
    b, a = t.reshape(nk, 2 * r, -1).split([r, r], dim=1)
    return [b.reshape(-1, t.shape[-1]), a.reshape(-1, t.shape[-1])]


def join_ba(parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    nk, _, r, _ = _group_sizes(cfg)
    b, a = (x.reshape(nk, r, -1) for x in parts)
    return torch.cat([b, a], dim=1).reshape(-1, b.shape[-1])


PREFIX = "model.layers.{i}.linear_attn"
FUSED = (
    Fused(
        f"{PREFIX}.in_proj_qkvz.weight",
        (f"{PREFIX}.in_proj_qkv.weight", f"{PREFIX}.in_proj_z.weight"),
        split_qkvz,
        join_qkvz,
    ),
    Fused(
        f"{PREFIX}.in_proj_ba.weight", (f"{PREFIX}.in_proj_b.weight", f"{PREFIX}.in_proj_a.weight"), split_ba, join_ba
    ),
)
