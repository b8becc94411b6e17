"""Rotary position embedding: inverse frequencies for the scaling variants, and its application."""

from __future__ import annotations

import math

import torch

from moerl.model.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32) and the factor cos/sin are multiplied by."""
    base = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_freq = 1.0 / (rope.theta**base)
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "proportional":  # the first angles at the whole head's frequencies, the others still (0)
        angles = int(rope.proportion * dim // 2)
        return torch.cat([inv_freq[:angles], inv_freq.new_zeros(dim // 2 - angles)]) / rope.factor, 1.0
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings or max_positions
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: interpolate low frequencies, keep high ones, blend between with a linear ramp
    factor = rope.factor
    old_len = rope.original_max_position_embeddings or max_positions
    if rope.attention_factor is not None:
        attn_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the original (extrapolated) frequency is kept
    inv_freq = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    return inv_freq, attn_factor


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax-scale factor mscale(factor, mscale_all_dim) ** 2 (1.0 when not yarn)."""
    if rope.kind != "yarn" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [B, T, dim] for integer positions [B, T], computed in fp32 then cast."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [B, T, heads, d] (d = rotated dims) by cos/sin [B, T, d] in the rotate-half convention.

    ``interleaved`` inputs hold pairs (x0, x1), (x2, x3), ...: they are de-interleaved first, so the output is
    laid out as rotate-half (what DeepSeek's checkpoints expect).
    """
    if interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
