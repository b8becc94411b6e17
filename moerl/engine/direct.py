"""The CPU engine's eager decode step as kernel calls bound once per batch size.

An engine's own bf16 CPU model on AMX (``MoEModel.decode_layout``) runs a decode step as seven C kernel calls a
layer (q / k / v, q / k norm + RoPE, paged attention, o_proj, residual + norm, routed experts, residual + next norm)
and the router's few torch ops. Through the modules each call pays tens of microseconds of Python around it (its
checks, its buffers, its arguments made again): a third of small's step (BENCHMARKS.md, issue 42's fifteenth
session). Here the arguments are made once for a batch size, pointing into buffers kept with them, and a step copies
its inputs in and makes the calls in turn: the same kernels, in the same order, on the same values as the modules'
forward, so the logits and the chosen experts are that forward's bit for bit (tests/test_direct.py).

The model it binds (``refusal`` says why another is not): every layer pre-norm RMSNorm attention (q / k / v and
o_proj on AMX without biases, per-head q / k norms or none, full rotate-half RoPE) then a MoE of packed SiLU experts
(no shared or zero experts, no biases) under a softmax top-k router, residual multipliers of 1; no LoRA attached, no
replayed experts. Anything else runs the modules. Weights synced in place are seen (their versions are checked each
step and the panels made again); a module swapped since (``moerl.model.swap``), another thread count or a cache
re-allocated binds again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moerl.engine.kv_cache import KVCache
from moerl.model.attention import Attention
from moerl.model.linear import Linear
from moerl.model.moe import Experts, MoE
from moerl.model.norms import RMSNorm
from moerl.model.packed import (
    add_rms_norm_args,
    amx,
    amx_linear_args,
    fused_linear,
    kernel,
    linear_panels,
    moe_buffers,
    moe_decode_args,
    norm_rope_args,
    paged_args,
    paged_scratch,
    rms_norm_args,
)
from moerl.model.rope import rope_cos_sin
from moerl.model.transformer import DecoderLayer, MoEModel

TABLE_STEP = 16  # the bound tables' width grows by this many blocks


def refusal(model: MoEModel, cache: KVCache) -> str | None:
    """Why ``model``'s decode steps cannot run bound (None: they can)."""
    cfg = model.config
    if not model.laid_out or kernel() is None or not amx() or model.dtype != torch.bfloat16:
        return "not an engine's own bf16 CPU model on AMX"
    if cache.dtype != torch.bfloat16 or model.adapter_ctx is not None:
        return "a cache not in bf16, or LoRA attached"
    if cfg.embedding_multiplier != 1.0 or cfg.logits_scaling != 1.0 or not isinstance(model.norm, RMSNorm):
        return "an embedding or logits multiplier, or a final norm other than RMSNorm"
    for layer in model.layers:
        why = _layer_refusal(layer)
        if why:
            return f"layer {layer.layer if isinstance(layer, DecoderLayer) else '?'}: {why}"
    return None


def _layer_refusal(layer) -> str | None:
    if not isinstance(layer, DecoderLayer) or layer.post_norm or layer.residual_multiplier != 1.0:
        return "not a pre-norm decoder layer without a residual multiplier"
    if layer.mask_kind not in ("full", "sliding") or not layer.is_moe:
        return "not attention then a MoE"
    a, moe = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(isinstance(n, RMSNorm) for n in norms) or type(a) is not Attention or type(moe) is not MoE:
        return "another norm, attention or MoE class"
    projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
    if any(type(m) is not Linear or not m.packed or m.bias is not None for m in projections):
        return "a projection not on AMX, or with a bias"
    if a.output_gate or a.clip_qkv is not None or a.qk_norm not in ("head", "none") or a.qk_norm_after_rope:
        return "an attention output gate, clipped q / k / v, or q / k norms other than per head before RoPE"
    if a.interleave or a.rope_dim != a.head_dim or a.head_dim % 2:
        return "interleaved or partial RoPE"
    r, e = moe.router, moe.experts
    fast = r.scoring == "softmax" and not r.topk_before_softmax and r.e_score_correction_bias is None
    if not fast or r.n_group > 1 or moe.shared_experts is not None or type(e) is not Experts:
        return "a router other than softmax top-k, or shared experts"
    if not e.packed or e.activation != "silu" or not e.gated or e.zero or e.gate_up_proj_bias is not None:
        return "experts not packed SiLU ones"
    if e.down_proj_bias is not None or e.down_proj.dtype != torch.bfloat16:
        return "experts with a bias, or not in bf16"
    return None


@dataclass(slots=True)
class _Bound:
    """One batch size's buffers and its kernel calls."""

    rows: int
    width: int  # the tables' blocks a row
    x: torch.Tensor  # [rows, H] the residual stream
    h: torch.Tensor  # [rows rounded up to 16, H] each norm's output (AMX reads 16 rows a block)
    pos: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64: the pool row this step's key goes to
    tables: torch.Tensor  # [rows, width] int64
    cos: torch.Tensor  # [rows, D]
    sin: torch.Tensor
    idx: torch.Tensor  # [L, rows, k] int64: each layer's chosen experts
    gate: torch.Tensor  # [L, rows, k] fp32
    calls: list  # (callable, arguments) in order
    keep: list  # the buffers the calls point into


class DirectDecode:
    """Decode steps of ``model`` over ``cache`` as bound kernel calls (see the module docstring); ``capture``: return
    the chosen experts."""

    def __init__(self, model: MoEModel, cache: KVCache, capture: bool):
        self.model, self.cache, self.capture = model, cache, capture
        self._bound: dict[int, _Bound] = {}
        self._stamp: tuple | None = None
        self._params: list[torch.Tensor] = []
        self._swaps: int | None = None
        self.why: str | None = None  # ``refusal`` of the model as the last ``ready`` saw it

    def ready(self) -> bool:
        """Whether the next decode step runs bound (the model as it is now, ``refusal``); binds again where a weight,
        the cache's pools, the modules or the thread count changed since the last step."""
        swaps = getattr(self.model, "swaps", 0)
        if swaps != self._swaps:
            self._swaps, self.why = swaps, refusal(self.model, self.cache)
            self._params = list(self.model.parameters())
        if self.why is not None:
            return False
        stamp = (
            swaps,
            torch.get_num_threads(),
            *(p._version for p in self._params),
            *(t.data_ptr() for t in (*self._params, *self.cache.k, *self.cache.v)),
        )
        if stamp != self._stamp:
            self._bound.clear()
            self._stamp = stamp
        return True

    def step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor):
        """One decode step for rows ``ids`` / ``positions`` [B, 1] with block tables [B, nb] (after ``ready``):
        logits [B, V] and the chosen experts [B, 1, L, k] (None without capture)."""
        b, nb = tables.shape
        bound = self._bound.get(b)
        if bound is None or bound.width < nb:
            bound = self._bound[b] = self._bind(b, -(-nb // TABLE_STEP) * TABLE_STEP)
        model, bs = self.model, self.cache.block_size
        pos = positions.view(b)
        torch.index_select(model.embed_tokens.weight, 0, ids.view(b), out=bound.x)
        bound.pos.copy_(pos)
        bound.tables[:, :nb].copy_(tables)
        bound.slots.copy_(tables.gather(1, (pos // bs)[:, None]).view(b) * bs + pos % bs)
        cos, sin = rope_cos_sin(model.inv_freq, model.rope_scale, positions, model.dtype)
        bound.cos.copy_(cos.view(b, -1))
        bound.sin.copy_(sin.view(b, -1))
        for call, args in bound.calls:
            call(*args)
        head = model.lm_head
        h = bound.h[:b]
        logits = head(h) if head is not None else F.linear(h, model.embed_tokens.weight, model.lm_head_bias)
        routed = bound.idx.transpose(0, 1).reshape(b, 1, *bound.idx.shape[::2]) if self.capture else None
        return logits, routed

    def _bind(self, b: int, width: int) -> _Bound:
        model, cache = self.model, self.cache
        layers = model.layers
        cfg = model.config
        hid, k = cfg.hidden_size, cfg.top_k
        padded = -(-b // 16) * 16
        dt = model.dtype
        first = layers[0].self_attn
        bound = _Bound(
            b,
            width,
            torch.empty(b, hid, dtype=dt),
            torch.zeros(padded, hid, dtype=dt),
            torch.zeros(b, dtype=torch.int64),
            torch.zeros(b, dtype=torch.int64),
            torch.zeros(b, width, dtype=torch.int64),
            torch.empty(b, first.head_dim, dtype=dt),
            torch.empty(b, first.head_dim, dtype=dt),
            torch.zeros(len(layers), b, k, dtype=torch.int64),
            torch.zeros(len(layers), b, k, dtype=torch.float32),
            [],
            [],
        )
        lib, calls = kernel(), bound.calls
        x, h = bound.x, bound.h
        x2, a, out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        norm0 = layers[0].input_layernorm
        calls.append((lib.moerl_rms_norm, rms_norm_args(x, norm0.weight, h[:b], norm0.eps)))
        scratch = None
        for i, layer in enumerate(layers):
            attn, moe = layer.self_attn, layer.mlp
            hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            panels, _ = fused_linear(attn, (attn.q_proj, attn.k_proj, attn.v_proj))
            qkv = torch.empty(b, panels.shape[1] * panels.shape[3], dtype=dt)
            calls.append((lib.moerl_amx_linear, amx_linear_args(h, b, panels, qkv)))
            q, kk, v = (t.view(b, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
            qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm == "head" else (None, None)
            eps = attn.q_norm.eps if qw is not None else 0.0
            calls.append((lib.moerl_norm_rope, norm_rope_args(q, kk, qw, kw, eps, bound.cos, bound.sin)))
            if scratch is None:
                scratch = torch.empty(paged_scratch(hq // hkv, d, width, cache.block_size))
            window = cache.sliding_window if attn.sliding and cache.sliding_window else 0
            sinks = attn.sinks.float().contiguous() if attn.sinks is not None else None
            seen = torch.empty(padded, hq * d, dtype=dt)
            pools = (cache.k[attn.layer], cache.v[attn.layer], bound.tables, bound.pos, sinks)
            new = (kk.view(b, -1), v.view(b, -1), bound.slots)
            args = paged_args(q.view(b, -1), hq, pools, cache.block_size, window, attn.scale, seen, scratch, new)
            calls.append((lib.moerl_paged_decode, args))
            o_panels = linear_panels(attn.o_proj, attn.o_proj.weight)
            calls.append((lib.moerl_amx_linear, amx_linear_args(seen, b, o_panels, a)))
            post = layer.post_attention_layernorm
            calls.append((lib.moerl_add_rms_norm, add_rms_norm_args(x, a, post.weight, post.eps, x2, h[:b])))
            experts, idx, gate = moe.experts, bound.idx[i], bound.gate[i]
            calls.append((_route, (moe.router, h[:b], idx, gate)))
            gate_up, down = experts._panels("gate_up"), experts._panels("down")
            work, ints = moe_buffers(b, k, gate_up, down)
            calls.append((lib.moerl_moe_decode, moe_decode_args(h[:b], idx, gate, gate_up, down, out, work, ints)))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            calls.append((lib.moerl_add_rms_norm, add_rms_norm_args(x2, out, nxt.weight, nxt.eps, x, h[:b])))
            bound.keep += [qkv, sinks, seen, work, ints]
        bound.keep += [x2, a, out, scratch]
        return bound


def _route(router, h: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor) -> None:
    """The router's own rule (``Router.forward``) on rows ``h``, its choice and weights into ``idx`` / ``gate``."""
    w, chosen = router(h)
    idx.copy_(chosen)
    gate.copy_(w)
