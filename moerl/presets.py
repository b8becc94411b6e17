"""Model-size presets and ``init_model``: a random MoE checkpoint of any supported architecture."""

from __future__ import annotations

import os

import torch

from moerl.bridges import HFConfig, Preset, bridge_for_arch, export_model
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig
from moerl.model.transformer import MoEModel
from moerl.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_tokenizer, vocab_size

_VOCAB = 128  # the char tokenizer's 100 ids, rounded up

PRESETS = {
    # ~1M parameters (Qwen3-MoE): fast enough to train on a laptop CPU in minutes
    "tiny": Preset(
        "tiny",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=64,
        intermediate_size=256,
        vocab_size=_VOCAB,
    ),
    # ~57M parameters (Qwen3-MoE)
    "small": Preset(
        "small",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=16,
        top_k=2,
        moe_intermediate_size=256,
        intermediate_size=1024,
        vocab_size=_VOCAB,
    ),
}
assert vocab_size() <= _VOCAB


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_config(arch: str, preset_name: str, overrides: dict | None = None) -> tuple[dict, ModelConfig]:
    """The config.json fields and the ModelConfig of ``arch`` at ``preset_name`` size."""
    bridge = bridge_for_arch(arch)
    hf = bridge.preset_config(preset(preset_name), BOS_ID, EOS_ID, PAD_ID) | (overrides or {})
    return hf, bridge.config_from_hf(HFConfig(hf, f"{arch} preset {preset_name!r}"))


def init_model(
    arch: str,
    preset_name: str,
    out_dir: str | os.PathLike | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    overrides: dict | None = None,
) -> MoEModel:
    """A randomly initialised model of ``arch`` at ``preset_name`` size, its config.json fields updated from
    ``overrides``; written as a HF checkpoint (config.json, safetensors, char tokenizer) when ``out_dir`` is given."""
    hf, cfg = preset_config(arch, preset_name, overrides)
    model = MoEModel(cfg, dtype)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    model.hf_config = hf
    if out_dir is not None:
        save_tokenizer(out_dir, model_max_length=cfg.max_position_embeddings)
        export_model(model, out_dir, tokenizer_dir=out_dir)
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
