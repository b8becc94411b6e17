"""Qwen3-Next: the Qwen hybrid of Qwen3.5-MoE (``moerl.bridges.qwen3_5_moe``) with its linear-attention input
projections fused per key head (``in_proj_qkvz``: q, k, v, z of each key head's group; ``in_proj_ba``: b, a), split
into moerl's (Qwen3.5's) projections on load and fused back on export, and dense MLP layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say."""

import torch

from moerl.bridges.base import Bridge, Fused, HFConfig, Preset, sparse_layers
from moerl.bridges.qwen3_5_moe import HYBRID_RULES, hybrid_config
from moerl.bridges.qwen3_5_moe import preset_config as hybrid_preset
from moerl.bridges.registry import register
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

BRIDGE = register(
    Bridge(
        architectures=(ARCH,),
        model_type="qwen3_next",
        config_from_hf=config_from_hf,
        preset_config=preset_config,
        rules=HYBRID_RULES,
        fused=FUSED,
    )
)
