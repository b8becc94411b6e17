"""Attention mixers: grouped-query attention (GQA: qk-norm, sliding window or chunks, sinks, an output gate in q_proj
or of its own projection, partial / no RoPE, temperature tuning, a head count and a RoPE of its own per layer) and
multi-head latent attention (MLA, with DeepSeek sparse attention's indexer), the ``full``, ``sliding`` and ``chunked``
layer kinds of ``moerl.model.mixers``; each reads and writes the engine's paged KV cache through ``KVCacheView``."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig
from moerl.model.indexer import Indexer
from moerl.model.linear import Linear
from moerl.model.norms import RMSNorm, unit_rms
from moerl.model.rope import apply_rope


class KVCacheView(Protocol):
    """What attention needs from a KV cache for one forward (the rollout engine implements it). A view whose
    ``runs_layers`` is true runs each decoder layer itself (``run_layer``: the engine's decode step compiled layer by
    layer), handing the layer a view of its own."""

    runs_layers: bool

    def run_layer(self, layer, x, cos, sin, replay, passed) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``layer``'s ``block`` over this step (a DecoderLayer's output and chosen experts)."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k/v [B, C, Hkv, d]; return every visible key/value, head-major [B, Hkv, S, d]."""
        ...

    def mask(self, kind: str) -> torch.Tensor:
        """Boolean [B, 1, C, S]: which cached keys each new query of a ``kind`` layer (full, sliding, chunked) may
        attend to."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, scale: float, sinks
    ) -> torch.Tensor | None:
        """Store k / v and return q [B, C, Hq, d]'s attention [B, C, Hq * dv] of a ``kind`` layer (full, sliding,
        chunked) read from the cache in place, or None where the cache has no such path for this step (then
        ``update`` and ``mask``)."""
        ...

    def update_index(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store this step's indexer keys [B, C, d] (DeepSeek sparse attention); return every visible one [B, S, d]."""
        ...


# CPU SDPA in bf16 pays a fixed set-up per (row, head) whatever the length: up to this many keys the same attention in
# fp32 is faster, forward + backward, and its bf16 inputs are exact in fp32
FP32_SDPA_MAX_KEYS = 192


def attend(q, k, v, mask: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, d], k [B, Hkv, S, d], v [B, Hkv, S, dv], mask bool [B, 1, T, S] -> [B, T, Hq * dv].

    ``mask`` None means plain causal (T == S). ``sinks`` [Hq]: a learned logit per head that joins the softmax
    and is then dropped (GPT-OSS). Long queries use SDPA (on a CPU in fp32 up to ``FP32_SDPA_MAX_KEYS`` keys, the
    result rounded to q's dtype); short ones (decode) and sinks use explicit matmuls with fp32 scores, which on CPU
    is several times faster than bf16 SDPA for one query row.
    """
    b, hq, t, _ = q.shape
    if sinks is None and (mask is None or t > 8):
        dtype = q.dtype
        if q.device.type == "cpu" and dtype == torch.bfloat16 and k.shape[2] <= FP32_SDPA_MAX_KEYS:
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out.to(dtype).transpose(1, 2).flatten(2)
    if mask is None:
        mask = build_mask(None, 1, t, None, q.device)
    # head-first batches [Hkv, B, ...]: keys from the engine's head-major cache are contiguous that way
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    qh = q.reshape(b, hkv, g * t, -1).transpose(0, 1)
    scores = (qh @ k.transpose(0, 1).transpose(-1, -2)).float().view(hkv, b, g, t, s) * scale
    scores = scores.masked_fill(~mask.view(1, mask.shape[0], 1, t, s), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hkv, 1, g, 1, 1).expand(hkv, b, g, t, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = probs.to(v.dtype).view(hkv, b, g * t, s) @ v.transpose(0, 1)  # [Hkv, B, g*T, dv]
    return out.view(hkv, b, g, t, dv).permute(1, 3, 0, 2, 4).reshape(b, t, hq * dv)


def cached_attention(module, q, k, v, mask, cache: KVCacheView | None, sinks=None) -> torch.Tensor:
    """Attention [B, T, Hq * dv] of q [B, T, Hq, d] over k / v [B, T, Hkv, d] in ``module``'s layer (its ``layer``,
    ``kind``, ``scale`` and ``core``): an fp32 CPU decode step reads the engine's pools in place; else the visible keys
    and values gathered from the cache under its mask, or this forward's own under ``mask``."""
    out = cache.attend(module.layer, q, k, v, module.kind, module.scale, sinks) if cache is not None else None
    if out is None:
        if cache is not None:
            k, v = cache.update(module.layer, k, v)
            mask = cache.mask(module.kind)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        out = module.core(q.transpose(1, 2), k, v, mask, module.scale, sinks)
    return out


class Attention(nn.Module):
    """Grouped-query attention with RoPE and the per-architecture options of ModelConfig."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.heads(layer), cfg.kv_heads(layer), cfg.head_size(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.v_dim = dv = cfg.v_head_dim or d  # value heads of their own size (MiMo-V2-Flash's)
        self.value_scale = cfg.attn_value_scale
        rope_dim = cfg.layer_rope(layer)[1]
        self.rope_dim = 0 if layer in cfg.nope_layers else (rope_dim or d)  # 0: a layer without RoPE
        self.output_gate = cfg.attn_output_gate  # q_proj yields [q | gate] per head
        self.q_proj = Linear(h, nh * d * (2 if self.output_gate else 1), bias=cfg.qkv_bias)
        # a gate of its own projection: one per head or per channel, through sigmoid or softplus
        self.gate_kind, self.gate_act = cfg.attn_gate, cfg.attn_gate_act
        if self.gate_kind != "none":
            self.gate_proj = Linear(h, nh * (dv if self.gate_kind == "element" else 1), bias=False)
        self.k_proj = Linear(h, nkv * d, bias=cfg.qkv_bias)
        # Gemma 4's full layers take their keys, before norm and RoPE, as their values
        self.k_eq_v = cfg.attn_k_eq_v and cfg.layer_types[layer] == "full"
        if not self.k_eq_v:
            self.v_proj = Linear(h, nkv * dv, bias=cfg.qkv_bias)
        self.v_norm = cfg.v_norm
        self.o_proj = Linear(nh * dv, h, bias=cfg.o_bias)
        self.qk_norm, self.qk_norm_after_rope = cfg.qk_norm, cfg.qk_norm_after_rope
        self.interleave = cfg.rope_interleave
        if cfg.qk_norm in ("head", "full"):
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(nh * d if full else d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(nkv * d if full else d, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv
        self.kind = cfg.layer_types[layer]  # full | sliding | chunked: the keys a query sees
        self.sliding = self.kind == "sliding"
        # Llama 4's: its unit-RMS q / k norm on the layers with RoPE, its temperature tuning on the others
        self.l2_norm = cfg.qk_norm == "l2" and self.rope_dim > 0
        self.unit_eps = cfg.rms_norm_eps  # the weightless norms' (q / k: l2, values: v_norm)
        self.temperature = cfg.attn_temperature_scale > 0 and self.rope_dim == 0
        sinks = cfg.attention_sinks and (self.sliding or not cfg.sinks_sliding_only)
        self.sinks = nn.Parameter(torch.zeros(nh)) if sinks else None
        self.scale = cfg.attn_scale or d**-0.5
        self.layer = layer
        # attention over the q / k / v this layer made (``attend``'s signature): split-sequence training puts one that
        # exchanges heads for tokens in its place (moerl.parallel.context)
        self.core = attend

    def forward(self, x, cos, sin, mask, cache: KVCacheView | None = None) -> torch.Tensor:
        """``cos`` / ``sin``: the rotary tables of the layer's positions; a layer with temperature tuning (which has no
        RoPE) takes its queries' scales [B, T] fp32 as ``cos`` (``MoEModel.rope_tables``)."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, t, self.num_heads, 2, self.head_dim).unbind(3)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.v_dim)
        if self.v_norm:
            v = unit_rms(v, self.unit_eps)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        q, k = self._norm_and_rotate(q, k, cos, sin)
        if self.temperature:
            q = (q * cos[:, :, None, None]).to(q.dtype)
        out = cached_attention(self, q, k, v, mask, cache, self.sinks)
        if self.gate_kind != "none":
            return self.o_proj(self._gated(out, x))
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _gated(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention ``out`` [B, T, heads * d] times the gate of its own projection of the layer's input ``x``
        (the activation in fp32: softplus and sigmoid saturate in bf16)."""
        g = self.gate_proj(x).float()
        g = (F.softplus(g) if self.gate_act == "softplus" else torch.sigmoid(g)).to(out.dtype)
        if self.gate_kind == "head":
            return (out.unflatten(-1, (self.num_heads, self.v_dim)) * g.unsqueeze(-1)).flatten(-2)
        return out * g

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` (a backend's attention may make them in one call)."""
        k = self.k_proj(x)
        return self.q_proj(x), k, (k if self.k_eq_v else self.v_proj(x))

    def _norm_and_rotate(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [B, T, heads, D] normed (where the model norms them per head) and rotated (a backend's attention
        may do both in one call, in place)."""
        if self.qk_norm == "head" and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        r = self.rope_dim
        qk = torch.cat([q, k], dim=2)  # rotate q and k heads in one pass
        # interleaved pairs come out in rotate-half order: q and k alike, so q . k is unchanged
        if r == self.head_dim:
            qk = apply_rope(qk, cos, sin, self.interleave)
        elif r:  # partial rotary: only the first r dims of each head rotate
            qk = torch.cat([apply_rope(qk[..., :r], cos, sin, self.interleave), qk[..., r:]], dim=-1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
        if self.qk_norm_after_rope:  # HunYuan-MoE-V1 (refused with interleaved pairs: they come out reordered)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.l2_norm:  # a per-dim norm: the rotate-half order interleaved pairs come out in does not change it
            q, k = unit_rms(q, self.unit_eps), unit_rms(k, self.unit_eps)
        return q, k


MLA_NORM_EPS = 1e-6  # the latent norms' epsilon: fixed in DeepSeek's reference code, whatever rms_norm_eps says


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V3): low-rank q and a shared compressed kv latent."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.kv_lora_rank = nh, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_dim = self.nope + self.rope_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * qk_dim, bias=False)
        else:
            self.q_proj = Linear(h, nh * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(nh * self.v_dim, h, bias=cfg.o_bias)
        self.interleave = cfg.rope_interleave
        self.scale = cfg.attn_scale or qk_dim**-0.5
        # LongCat-Flash's: the low-rank query and the normed kv latent times sqrt(hidden / rank); the query's factor
        # taken into the softmax scale, the latent's before kv_b_proj (the values take it too, the rotated keys not)
        self.latent_scale = (h / cfg.kv_lora_rank) ** 0.5 if cfg.mla_lora_scale else None
        if cfg.mla_lora_scale:
            self.scale *= (h / cfg.q_lora_rank) ** 0.5
        self.kind = cfg.layer_types[layer]
        self.sliding = self.kind == "sliding"
        self.layer = layer
        # DeepSeek sparse attention: each query attends to the keys its indexer chooses (moerl.model.indexer), or,
        # in GLM-5's shared layers, the keys the last indexer layer before it chose
        self.reuses_keys = layer in cfg.index_shared_layers
        self.hands_keys = bool(cfg.index_shared_layers) and not self.reuses_keys
        self.indexer = Indexer(cfg) if cfg.index_topk and not self.reuses_keys else None
        self.core = attend  # as Attention's

    def forward(self, x, cos, sin, mask, cache: KVCacheView | None = None, passed=None) -> torch.Tensor:
        """``passed``: what layers hand later ones within the forward (``moerl.model.transformer.Handoff``); an
        indexer layer leaves its narrowed mask there (``keys``) for the shared layers after it."""
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q = q_low = self.q_proj(x)
        else:
            q_low = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_low)
        q = q.view(b, t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.latent_scale is not None:
            latent = latent * self.latent_scale
        kv = self.kv_b_proj(latent).view(b, t, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, self.interleave)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.interleave).expand(-1, -1, self.num_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        if cache is not None:  # the cache holds per-head k/v expanded from the latent
            k, v = cache.update(self.layer, k, v)
            mask = cache.mask(self.kind)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.indexer is not None:
            keys = self.indexer.keys(x, cos, sin)
            if cache is not None:
                keys = cache.update_index(self.layer, keys)
            elif mask is None:
                mask = build_mask(None, 1, t, None, x.device)
            mask = self.indexer.select(x, q_low, cos, sin, keys, mask)
            if self.hands_keys and passed is not None:
                passed.keys = mask
        elif self.reuses_keys:
            if passed is None or passed.keys is None:
                raise ConfigError(
                    f"layer {self.layer} keeps the keys an earlier indexer layer chose (index_shared_layers), and "
                    "none ran before it in this forward: a pipeline stage must start at a layer with an indexer"
                )
            mask = passed.keys
        return self.o_proj(self.core(q.transpose(1, 2), k, v, mask, self.scale, None))


def build_mask(
    attention_mask: torch.Tensor | None,
    b: int,
    t: int,
    window: int | None,
    device,
    chunk: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [B, 1, T, T]: causal, padded keys hidden, optional sliding window (i - j < window) or chunks (keys in
    the query's own aligned chunk of ``chunk`` positions, by ``positions`` [B, T]: they restart with each sequence).

    ``attention_mask`` [B, T]: 0 = padding, else the token's sequence within a packed row (1, 2, ...): a token
    sees only keys of its own sequence (0/1 masks: every real key). Every query sees itself, so fully padded rows
    stay finite instead of becoming NaN.
    """
    i = torch.arange(t, device=device)
    mask = i[None, :] <= i[:, None]
    if window:
        mask = mask & (i[:, None] - i[None, :] < window)
    mask = mask.expand(b, 1, t, t)
    if chunk:
        if positions is None:
            positions = i.expand(b, t)
        part = torch.div(positions, chunk, rounding_mode="floor")
        mask = mask & (part[:, None, :, None] == part[:, None, None, :])
    if attention_mask is not None:
        seg = attention_mask[:, None]
        query, key = seg[..., :, None], seg[..., None, :]
        mask = mask & (key != 0) & ((query == key) | (query == 0))
    return mask | torch.eye(t, dtype=torch.bool, device=device)
