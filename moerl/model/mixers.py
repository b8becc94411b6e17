"""The token mixers a decoder layer holds in its ``self_attn`` slot, by ``ModelConfig.layer_types`` kind.

Attention kinds (``full``, ``sliding``, ``chunked``: ``moerl.model.attention``, grouped-query or latent as
``ModelConfig.attention`` says) keep paged keys in the engine; recurrent kinds keep, per sequence, a conv window and a
state in a slot (``moerl.engine.kv_cache.LinearStates``). A recurrent mixer is a module called as
``mixer(x, cos, sin, mask, cache)`` (``mask``: the forward's ``attention_mask``, its packed sequences; ``cache``: the
engine's step view) with a ``state_shapes(cfg)`` giving its slot's (conv window, state) shapes. Adding one is its
file, a line in ``RECURRENT`` and its config fields (``moerl/bridges/README.md``).
"""

from __future__ import annotations

from torch import nn

from moerl.model.attention import Attention, MLAttention
from moerl.model.config import RECURRENT_KINDS, ModelConfig
from moerl.model.linear_attention import GatedDeltaNet
from moerl.model.mamba import Mamba2
from moerl.model.mamba1 import Mamba1
from moerl.model.moa import MixtureOfAttention

# layer kind -> the recurrent mixer class (Gated DeltaNet: Qwen3-Next / Qwen3.5; Mamba-2: Granite-4.0-H, Nemotron-H;
# Mamba-1: Jamba)
RECURRENT: dict[str, type[nn.Module]] = {"linear": GatedDeltaNet, "mamba": Mamba2, "mamba1": Mamba1}


assert tuple(RECURRENT) == RECURRENT_KINDS  # the kinds ModelConfig accepts are the mixers built here


def is_recurrent(kind: str) -> bool:
    """Whether a layer of ``kind`` keeps a per-sequence state instead of paged keys."""
    return kind in RECURRENT


def keeps_keys(kind: str) -> bool:
    """Whether a layer of ``kind`` keeps paged keys (attention: not a recurrent layer, not one without a mixer)."""
    return kind in ("full", "sliding", "chunked")


def recurrent_layers(cfg: ModelConfig) -> list[int]:
    """The indices of ``cfg``'s recurrent layers."""
    return [i for i, kind in enumerate(cfg.layer_types) if kind in RECURRENT]


def build_mixer(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s token mixer, by its ``layer_types`` kind: attention (``full`` / ``sliding`` / ``chunked``:
    latent attention where ``cfg.attention`` says ``mla``, a mixture of attention heads where it says ``moa``) or a
    recurrent mixer."""
    kind = cfg.layer_types[layer]
    if kind in RECURRENT:
        return RECURRENT[kind](cfg, layer)
    return {"mla": MLAttention, "moa": MixtureOfAttention}.get(cfg.attention, Attention)(cfg, layer)


def state_shapes(cfg: ModelConfig, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Layer ``layer``'s slot: its conv window's shape [C, K-1] (model dtype) and its state's (fp32)."""
    return RECURRENT[cfg.layer_types[layer]].state_shapes(cfg)
