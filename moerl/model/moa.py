"""A mixture of attention heads (JetMoE's MoA, ``ModelConfig.attention`` "moa"): each token's router chooses
``top_k`` of ``num_experts`` attention experts; each expert is a query projection to ``num_kv_heads`` heads and an
output projection back, over keys and values every expert shares (one ``k_proj`` / ``v_proj``). A token's
``top_k x num_kv_heads`` query heads attend as grouped-query heads do (expert slot j's head h reads key head h), and
its outputs are the gate-weighted sum of its experts' output projections, plus a bias.

The router is the MoE's (fp32, its replay path): R3 records and replays its choice as a column of the layer's own,
before the MoE's (``DecoderLayer.routes``). The keys and values are plain GQA ones, so the engine's paged cache, its
masks and split-sequence attention (``core``) serve it unchanged."""

from __future__ import annotations

import torch
from torch import nn

from moerl.model.attention import KVCacheView, attend, cached_attention
from moerl.model.config import ModelConfig
from moerl.model.grouped import Groups, group_mm
from moerl.model.linear import Linear
from moerl.model.moe import Router
from moerl.model.rope import apply_rope


class AttentionExperts(nn.Module):
    """E attention experts: ``q_proj`` [E, Hkv * d, H] and ``o_proj`` [E, H, Hkv * d], each applied to the (token,
    slot) pairs sorted by expert as one grouped GEMM (a mode swaps the class: ``moerl.model.mx``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, inner = cfg.num_experts, cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Parameter(torch.empty(e, inner, h))
        self.o_proj = nn.Parameter(torch.empty(e, h, inner))

    def queries(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """x [pairs, H] -> [pairs, Hkv * d]."""
        return group_mm(x, self.q_proj.transpose(1, 2), groups)

    def outputs(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """x [pairs, Hkv * d] -> [pairs, H]."""
        return group_mm(x, self.o_proj.transpose(1, 2), groups)


class MixtureOfAttention(nn.Module):
    """Attention whose queries and outputs come from routed experts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, nkv, d = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        self.num_kv_heads, self.head_dim, self.top_k = nkv, d, cfg.top_k
        self.num_heads = nkv * cfg.top_k
        self.num_experts = cfg.num_experts
        self.router = Router(cfg)
        self.experts = AttentionExperts(cfg)
        self.k_proj = Linear(h, nkv * d, bias=False)
        self.v_proj = Linear(h, nkv * d, bias=False)
        self.bias = nn.Parameter(torch.zeros(h)) if cfg.o_bias else None
        self.interleave = cfg.rope_interleave
        self.scale = cfg.attn_scale or d**-0.5
        self.kind = cfg.layer_types[layer]
        self.layer = layer
        self.core = attend  # as Attention's: split-sequence training swaps it (moerl.parallel.context)

    def forward(
        self, x, cos, sin, mask, cache: KVCacheView | None = None, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (output [B, T, H], the chosen attention experts [B * T, k]); ``replay`` [B * T, k]: experts
        to use instead of the router's (-1: its own choice)."""
        b, t, hidden = x.shape
        k, nkv, d = self.top_k, self.num_kv_heads, self.head_dim
        flat = x.reshape(-1, hidden)
        weights, idx = self.router(flat, replay)
        # the (token, slot) pairs sorted by expert: one grouped GEMM per projection
        order = idx.reshape(-1).argsort(stable=True)
        token, groups = order // k, Groups(idx.reshape(-1)[order], self.num_experts)
        q = self.experts.queries(flat.index_select(0, token), groups)
        q = torch.empty_like(q).index_copy_(0, order, q)  # back to slot order [B * T * k, Hkv * d]
        # query heads ordered (key head, slot): slot j's head h is head h * k + j, which GQA pairs with key head h
        q = q.view(b, t, k, nkv, d).transpose(2, 3).reshape(b, t, nkv * k, d)
        key = self.k_proj(x).view(b, t, nkv, d)
        v = self.v_proj(x).view(b, t, nkv, d)
        q, key = apply_rope(q, cos, sin, self.interleave), apply_rope(key, cos, sin, self.interleave)
        out = cached_attention(self, q, key, v, mask, cache)
        # [B, T, Hkv * k * d] in (key head, slot) order -> each slot's heads together, in the pairs' order
        out = out.view(b, t, nkv, k, d).transpose(2, 3).reshape(b * t * k, nkv * d).index_select(0, order)
        y = self.experts.outputs(out, groups)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        y = torch.zeros_like(flat).index_add_(0, token, y)
        if self.bias is not None:
            y = y + self.bias
        return y.view(b, t, hidden), idx
