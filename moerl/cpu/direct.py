"""The CPU engine's eager decode step as kernel calls bound once per batch size.

An engine's own bf16 CPU model on AMX or AVX512-BF16 (``packed.bf16_dot``; ``moerl.cpu.install``) runs a decode
step as eight C kernel calls a layer (q / k / v, q / k norm + RoPE, paged attention, o_proj, residual + norm, router,
routed experts, residual + next norm). Through the modules each call pays tens of microseconds of Python around it (its
checks, its buffers, its arguments made again), a large share of a small model's step. Here the arguments are made once
for a batch size, pointing into buffers kept with them, and a step copies its inputs in and makes the calls in turn: the
same kernels, in the same order, on the same values as the modules' forward, so the logits and the chosen experts are
that forward's bit for bit (tests/test_direct.py). LoRA slots join the same calls as they join the modules' (each row's
slot copied into the bound slots).

The model it binds (``refusal`` says why another is not): every layer pre-norm RMSNorm attention (q / k / v and
o_proj on the bf16 dot products without biases, per-head q / k norms or none, full rotate-half RoPE) then a MoE of
packed SiLU experts (no shared or zero experts, no biases) under a softmax top-k router of one call
(``moerl.cpu.moe.KernelRouter``), residual multipliers of 1; adapters, where attached, on all of q / k / v or
none. Anything else runs the modules. Weights and adapters written in place are seen (their versions are checked
each step, and the kept panels and factors made again); a module swapped since (``moerl.model.swap``), another
thread count or a cache allocated again binds again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moerl.cpu.attention import KernelAttention
from moerl.cpu.experts import KernelExperts, KernelLoraExperts
from moerl.cpu.linear import KernelLinear, KernelLoraLinear, fused_bf16_args
from moerl.cpu.moe import KernelRouter
from moerl.model.attention import Attention
from moerl.model.moe import MoE
from moerl.model.norms import RMSNorm
from moerl.model.packed import (
    add_rms_norm_args,
    bf16_dot,
    bf16_linear_args,
    fused_linear,
    kernel,
    linear_panels,
    moe_buffers,
    moe_decode_args,
    norm_rope_args,
    paged_args,
    paged_scratch,
    rms_norm_args,
    router_args,
    router_work,
)
from moerl.model.rope import rope_cos_sin
from moerl.model.transformer import DecoderLayer, MoEModel

if TYPE_CHECKING:  # the engine's cache, which the engine that asks for this step passes in
    from moerl.engine.kv_cache import KVCache

TABLE_STEP = 16  # the bound tables' width grows by this many blocks
MAX_BOUND = 64  # batch sizes kept bound at once (each ~0.5-1 ms to bind, its buffers a few hundred KiB at 64 rows)


def refusal(model: MoEModel, cache: KVCache) -> str | None:
    """Why ``model``'s decode steps cannot run bound (None: they can)."""
    cfg = model.config
    if model.backend != "cpu" or kernel() is None or model.dtype not in (torch.float32, torch.bfloat16):
        return "not an engine's own fp32 or bf16 CPU model"
    if model.dtype == torch.bfloat16 and not bf16_dot():
        return "a bf16 model on a CPU without AMX or AVX512-BF16"
    if cache.dtype != model.dtype:
        return "a cache in another dtype than the model's"
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
    if not all(isinstance(n, RMSNorm) for n in norms) or type(a) is not KernelAttention or type(moe) is not MoE:
        return "another norm, attention or MoE class"
    projections = (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
    on_bf16_dot = a.q_proj.weight.dtype == torch.bfloat16  # fp32: torch's GEMM, as the modules' F.linear
    kinds = (KernelLinear, KernelLoraLinear)
    if any(type(m) not in kinds or m.has_panels != on_bf16_dot or m.bias is not None for m in projections):
        return "a projection with a bias, or a bf16 one not on the bf16 dot products"
    if any(type(m) is KernelLoraLinear and not on_bf16_dot for m in projections):
        return "adapters on projections off the bf16 dot products"
    if len({type(m) for m in projections[:3]}) > 1:
        return "adapters on some of q / k / v only"
    if a.output_gate or a.clip_qkv is not None:
        return "an attention output gate, or clipped q / k / v"
    if not a.rope_in_one_call:
        return "q / k norms other than per head before RoPE, or interleaved or partial RoPE"
    r, e = moe.router, moe.experts
    if not (type(r) is KernelRouter and r.softmax_top_k):
        return "a router other than one call of a softmax top-k (moerl.cpu.moe.KernelRouter)"
    if moe.shared_experts is not None or type(e) not in (KernelExperts, KernelLoraExperts):
        return "shared experts, or another experts class"
    if not (e.has_panels and e.grouped and e.plain_silu) or e.down_proj.dtype != a.q_proj.weight.dtype:
        return "experts not packed SiLU ones without biases, or in another dtype than the projections'"
    return None


@dataclass(slots=True)
class _Bound:
    """One batch size's buffers and its kernel calls."""

    rows: int
    width: int  # the tables' blocks a row
    x: torch.Tensor  # [rows, H] the residual stream
    h: torch.Tensor  # [rows rounded up to 16, H] each norm's output (the kernel reads 16 rows a block)
    pos: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64: the pool row this step's key goes to
    tables: torch.Tensor  # [rows, width] int64
    cos: torch.Tensor  # [rows, D]
    sin: torch.Tensor
    idx: torch.Tensor  # [L, rows, k] int64: each layer's chosen experts
    gate: torch.Tensor  # [L, rows, k] fp32
    adapters: torch.Tensor | None  # [rows] int64 each row's LoRA slot (None: bound without adapters)
    calls: list = field(default_factory=list)  # (callable, arguments) in order
    keep: list = field(default_factory=list)  # what the calls point into


class DirectDecode:
    """Decode steps of ``model`` over ``cache`` as bound kernel calls (see the module docstring); ``capture``: return
    the chosen experts."""

    def __init__(self, model: MoEModel, cache: KVCache, capture: bool):
        self.model, self.cache, self.capture = model, cache, capture
        self._bound: dict[tuple[int, bool], _Bound | None] = {}
        self._stamp: tuple | None = None
        self._watched: list[torch.Tensor] = []
        self._swaps: int | None = None
        self.why: str | None = None  # ``refusal`` of the model as the last step saw it

    def step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, adapters=None):
        """One decode step for rows ``ids`` / ``positions`` [B, 1] with block tables [B, nb] and LoRA slots
        ``adapters`` (as ``MoEModel.forward`` takes them): (logits [B, V], the chosen experts [B, 1, L, k] or None
        without capture), or None where the modules must run it (``why``)."""
        if not self._ready():
            return None
        model, bs = self.model, self.cache.block_size
        b, nb = tables.shape
        ctx = model.adapter_ctx
        if ctx is not None:
            ctx.set(adapters, b, 1)
        lora = ctx is not None and ctx.active
        key = (b, lora)
        bound = self._bound.get(key)
        if (bound is None and key not in self._bound) or (bound is not None and bound.width < nb):
            if len(self._bound) >= MAX_BOUND:  # a run whose batch takes many sizes: bind them again as they come
                self._bound.clear()
            bound = self._bound[key] = self._bind(b, -(-nb // TABLE_STEP) * TABLE_STEP, lora)
        if bound is None:  # adapters that do not join the calls as one (``why``): the modules', until they change
            return None
        pos = positions.view(b)
        torch.index_select(model.embed_tokens.weight, 0, ids.view(b), out=bound.x)
        bound.pos.copy_(pos)
        bound.tables[:, :nb].copy_(tables)
        bound.slots.copy_(tables.gather(1, (pos // bs)[:, None]).view(b) * bs + pos % bs)
        if lora:
            bound.adapters.copy_(ctx.row_slots(b))
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

    def runs(self) -> bool:
        """Whether the model as it is now runs its decode steps bound (``refusal``: ``why``)."""
        return self._ready()

    def _ready(self) -> bool:
        """Whether the model as it is now runs bound (``refusal``, asked again after a module swap); the bound calls
        dropped where a weight, an adapter, the cache's pools or the thread count changed since the last step."""
        swaps = getattr(self.model, "swaps", 0)
        if swaps != self._swaps:
            self._swaps, self.why = swaps, refusal(self.model, self.cache)
            self._watched = [*self.model.parameters(), *self.model.buffers()]
        if self.why is not None:
            return False
        stamp = (
            swaps,
            torch.get_num_threads(),
            *(t._version for t in self._watched),
            *(t.data_ptr() for t in (*self._watched, *self.cache.k, *self.cache.v)),
        )
        if stamp != self._stamp:
            self._bound.clear()
            self._stamp = stamp
        return True

    def _bind(self, b: int, width: int, lora: bool) -> _Bound | None:
        """The calls of a step of ``b`` rows over tables ``width`` blocks wide (``lora``: with each row's adapter),
        or None where the adapters cannot join them as the modules' calls do."""
        model, cache = self.model, self.cache
        layers, cfg, dt = model.layers, model.config, model.dtype
        hid, k, d = cfg.hidden_size, cfg.top_k, layers[0].self_attn.head_dim
        padded = -(-b // 16) * 16
        i64 = dict(dtype=torch.int64)
        bound = _Bound(
            b,
            width,
            torch.empty(b, hid, dtype=dt),
            torch.zeros(padded, hid, dtype=dt),
            torch.zeros(b, **i64),
            torch.zeros(b, **i64),
            torch.zeros(b, width, **i64),
            torch.empty(b, d, dtype=dt),
            torch.empty(b, d, dtype=dt),
            torch.zeros(len(layers), b, k, **i64),
            torch.zeros(len(layers), b, k, dtype=torch.float32),
            torch.full((b,), -1, **i64) if lora else None,
        )
        lib, calls, keep, shared = kernel(), bound.calls, bound.keep, {}
        keep.append(shared)

        def buf(name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            # one buffer a name and shape for every layer: the layers run one after another
            return shared.setdefault((name, shape, dtype), torch.empty(shape, dtype=dtype))

        x, h, slots = bound.x, bound.h, bound.adapters
        x2, a, out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        hq, hkv = layers[0].self_attn.num_heads, layers[0].self_attn.num_kv_heads
        scratch = torch.empty(paged_scratch(hq // hkv, d, width, cache.block_size))
        route = torch.empty(router_work(layers[0].mlp.router.num_experts))
        keep += [x2, a, out, scratch, route]
        norm0 = layers[0].input_layernorm
        calls.append((lib.moerl_rms_norm, rms_norm_args(x, norm0.weight, h[:b], norm0.eps)))
        for i, layer in enumerate(layers):
            attn, moe = layer.self_attn, layer.mlp
            hq, hkv = attn.num_heads, attn.num_kv_heads
            made = self._qkv(attn, h, b, slots if lora else None, calls, keep, buf)
            if made is None:
                return None
            q, kk, v = made
            qw, kw = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm == "head" else (None, None)
            eps = attn.q_norm.eps if qw is not None else 0.0
            calls.append((lib.moerl_norm_rope, norm_rope_args(q, kk, qw, kw, eps, bound.cos, bound.sin)))
            window = cache.sliding_window if attn.sliding and cache.sliding_window else 0
            sinks = attn.sinks.float().contiguous() if attn.sinks is not None else None
            seen = buf("seen", padded, hq * d, dtype=dt)
            pools = (cache.k[attn.layer], cache.v[attn.layer], bound.tables, bound.pos, sinks)
            new = (kk.view(b, -1), v.view(b, -1), bound.slots)
            args = paged_args(q.view(b, -1), hq, pools, cache.block_size, window, attn.scale, seen, scratch, new)
            calls.append((lib.moerl_paged_decode, args))
            self._o_proj(attn.o_proj, seen, b, a, slots if lora else None, calls, keep, buf)
            post = layer.post_attention_layernorm
            calls.append((lib.moerl_add_rms_norm, add_rms_norm_args(x, a, post.weight, post.eps, x2, h[:b])))
            experts, idx, gate = moe.experts, bound.idx[i], bound.gate[i]
            r = moe.router
            calls.append(
                (
                    lib.moerl_router_topk,
                    router_args(h[:b], r.weight, r.bias, r.norm_topk_prob, r.scale, gate, idx, route),
                )
            )
            gate_up, down = experts.panels("gate_up"), experts.panels("down")
            adapters = None
            if lora and type(experts) is KernelLoraExperts:
                made = experts.decode_lora(slots)
                adapters = made[1]
                keep.append(made)
            work, ints = moe_buffers(b, k, gate_up, down, adapters)
            work, ints = buf("work", *work.shape), buf("ints", *ints.shape, dtype=ints.dtype)
            args = moe_decode_args(h[:b], idx, gate, gate_up, down, out, work, ints, adapters)
            calls.append((lib.moerl_moe_decode, args))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            calls.append((lib.moerl_add_rms_norm, add_rms_norm_args(x2, out, nxt.weight, nxt.eps, x, h[:b])))
            keep.append(sinks)
        return bound

    def _qkv(self, attn: Attention, h: torch.Tensor, b: int, slots: torch.Tensor | None, calls: list, keep: list, buf):
        """The calls of q / k / v for rows ``h`` (``slots``: each row's adapter): on the bf16 dot products one call
        from their panels side by side (``fused_projections``' call, adapters joined), else torch's GEMM each (fp32,
        the modules' ``F.linear``). Returns q, k, v [b, heads, d] (views of what the calls write), or None where the
        adapters do not run as one call (``why``). ``buf(name, *shape, dtype=)``: a buffer the layers share."""
        layers, d, dt = (attn.q_proj, attn.k_proj, attn.v_proj), attn.head_dim, h.dtype
        if not attn.q_proj.has_panels:
            outs = [buf(f"qkv {i}", b, m.out_features, dtype=dt) for i, m in enumerate(layers)]
            calls += [(partial(torch.mm, out=y), (h[:b], m.weight.t())) for m, y in zip(layers, outs, strict=True)]
            return [y.view(b, -1, d) for y in outs]
        panels, _ = fused_linear(attn, layers)
        qkv = buf("qkv", b, panels.shape[1] * panels.shape[3], dtype=dt)
        adapters = xa = None
        if slots is not None and type(attn.q_proj) is KernelLoraLinear:
            loras = [m.lora for m in layers]
            made = fused_bf16_args(attn, loras, panels, slots)
            if made is None:
                self.why = "q / k / v adapters that do not run as one call (their scales or ranks differ)"
                return None
            adapters, xa = made[1], buf("xa", b, made[1].r)
            keep.append(made)
        calls.append((kernel().moerl_bf16_linear, bf16_linear_args(h, b, panels, qkv, adapters, xa)))
        return [t.view(b, -1, d) for t in qkv.split([m.out_features for m in layers], dim=1)]

    def _o_proj(self, o, seen: torch.Tensor, b: int, a: torch.Tensor, slots, calls: list, keep: list, buf) -> None:
        """The call of o_proj from attention's rows ``seen`` into ``a``: on the bf16 dot products (its adapters
        joined), else torch's GEMM (fp32)."""
        if not o.has_panels:
            calls.append((partial(torch.mm, out=a), (seen[:b], o.weight.t())))
            return
        panels, adapters, xa = linear_panels(o, o.weight), None, None
        if slots is not None and type(o) is KernelLoraLinear:
            panels, *made = o.bf16_lora_args(slots)
            adapters, xa = made[1], buf("xa", b, made[1].r)
            keep.append(made)
        calls.append((kernel().moerl_bf16_linear, bf16_linear_args(seen, b, panels, a, adapters, xa)))
