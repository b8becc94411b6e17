"""The CPU engine's eager decode step as kernel calls bound once per batch size.

An engine's own bf16 CPU model on AMX or AVX512-BF16 (``kernels.bf16_dot``; ``moerl.cpu.install``) runs a decode
step as eight C kernel calls a layer (q / k / v, q / k norm + RoPE, paged attention, o_proj, residual + norm, router,
routed experts, residual + next norm). Through the modules each call pays tens of microseconds of Python around it (its
checks, its buffers, its arguments made again), a large share of a small model's step. Here the arguments are made once
for a batch size, pointing into buffers kept with them, and a step copies its inputs in and makes the calls in turn: the
same kernels, in the same order, on the same values as the modules' forward, so the logits and the chosen experts are
that forward's bit for bit (tests/test_direct.py). LoRA slots join the same calls as they join the modules' (each row's
slot copied into the bound slots).

The step is assembled from the layers' modules: each of the CPU backend's modules binds its own calls (``bind``) and
names what of its configuration it cannot (``bound_refusal``: a projection's bias, a router's rule, experts other than
packed SiLU ones, ...); a module of another class is refused as such. The layers themselves must be pre-norm attention
then a MoE without shared experts, residual multipliers of 1 (``refusal`` says why another model is not bound).
Anything refused runs the modules. Weights and adapters written in place are seen (their versions are checked
each step, and the kept panels and factors made again); a module swapped since (``moerl.model.swap``), another
thread count or a cache allocated again binds again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moerl.cpu.binding import Binding
from moerl.cpu.kernels import bf16_dot, kernel
from moerl.model.moe import MoE
from moerl.model.rope import rope_cos_sin
from moerl.model.transformer import DecoderLayer, MoEModel

# the engine's paged KV cache (``moerl.engine.kv_cache.KVCache``), which the engine that asks for this step passes in:
# the backend sits below the engine and never imports it
KVCache = Any

TABLE_STEP = 16  # the bound tables' width grows by this many blocks
MAX_BOUND = 64  # batch sizes kept bound at once (each ~0.5-1 ms to bind, its buffers a few hundred KiB at 64 rows)


def refusal(model: MoEModel, cache: KVCache) -> str | None:
    """Why ``model``'s decode steps cannot run bound (None: they can)."""
    cfg, dtype = model.config, model.dtype
    if model.backend != "cpu" or kernel() is None or dtype not in (torch.float32, torch.bfloat16):
        return "not an engine's own fp32 or bf16 CPU model"
    if dtype == torch.bfloat16 and not bf16_dot():
        return "a bf16 model on a CPU without AMX or AVX512-BF16"
    if cache.dtype != dtype:
        return "a cache in another dtype than the model's"
    if cfg.embedding_multiplier != 1.0 or cfg.logits_scaling != 1.0:
        return "an embedding or logits multiplier"
    for layer in model.layers:
        why = _layer_refusal(layer, dtype)
        if why:
            return f"layer {layer.layer if isinstance(layer, DecoderLayer) else '?'}: {why}"
    return _module_refusal("norm", model.norm, dtype)


def _layer_refusal(layer, dtype: torch.dtype) -> str | None:
    if not isinstance(layer, DecoderLayer) or layer.post_norm or layer.residual_multiplier != 1.0:
        return "not a pre-norm decoder layer without a residual multiplier"
    if layer.parallel:
        return "attention and MLP of one normed input (a parallel block)"
    if layer.shortcut is not None:
        return "a MoE output carried past the next layer (LongCat-Flash's pairs)"
    if layer.mlp_out_norm:
        return "a norm of the MoE's output"
    if layer.mask_kind == "chunked":
        return "chunked attention"
    if layer.mask_kind not in ("full", "sliding") or not layer.is_moe:
        return "not attention then a MoE"
    if layer.rope_kind == "temperature":
        return "temperature tuning of the queries"
    if layer.rope_kind != "full":  # the step rotates by one table
        return "a RoPE of the sliding layers' own"
    for name in ("input_layernorm", "self_attn", "post_attention_layernorm"):
        why = _module_refusal(name, getattr(layer, name), dtype)
        if why:
            return why
    moe = layer.mlp
    if not isinstance(moe, MoE) or moe.shared_experts is not None:
        return "shared experts, or another MoE class"
    for name in ("router", "experts"):
        why = _module_refusal(f"mlp.{name}", getattr(moe, name), dtype)
        if why:
            return why
    return None


def _module_refusal(name: str, module, dtype: torch.dtype) -> str | None:
    """Why ``module`` (at ``name``) binds no calls: not the backend's, or its own ``bound_refusal``."""
    if not hasattr(module, "bound_refusal"):
        return f"{name} is a {type(module).__name__}, not the CPU backend's"
    return module.bound_refusal(dtype)


class DirectDecode:
    """Decode steps of ``model`` over ``cache`` as bound kernel calls (see the module docstring); ``capture``: return
    the chosen experts."""

    def __init__(self, model: MoEModel, cache: KVCache, capture: bool):
        self.model, self.cache, self.capture = model, cache, capture
        self._bound: dict[tuple[int, bool], Binding | None] = {}
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

    def _bind(self, b: int, width: int, lora: bool) -> Binding | None:
        """The calls of a step of ``b`` rows over tables ``width`` blocks wide (``lora``: with each row's adapter),
        each module adding its own, or None where the adapters cannot join them as the modules' calls do (``why``)."""
        model = self.model
        layers, cfg, dt = model.layers, model.config, model.dtype
        hid, k, d = cfg.hidden_size, cfg.top_k, layers[0].self_attn.head_dim
        i64 = dict(dtype=torch.int64)
        step = Binding(
            b,
            width,
            self.cache,
            torch.empty(b, hid, dtype=dt),
            torch.zeros(-(-b // 16) * 16, hid, dtype=dt),
            torch.zeros(b, **i64),
            torch.zeros(b, **i64),
            torch.zeros(b, width, **i64),
            torch.empty(b, d, dtype=dt),
            torch.empty(b, d, dtype=dt),
            torch.zeros(len(layers), b, k, **i64),
            torch.zeros(len(layers), b, k, dtype=torch.float32),
            torch.full((b,), -1, **i64) if lora else None,
        )
        x, h = step.x, step.h
        x2, a, out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        step.keep += [x2, a, out]
        layers[0].input_layernorm.bind(step, x, h[:b])
        for i, layer in enumerate(layers):
            if not layer.self_attn.bind(step, h, a):
                self.why = step.why
                return None
            layer.post_attention_layernorm.bind_add(step, x, a, x2, h[:b])
            layer.mlp.router.bind(step, h[:b], step.gate[i], step.idx[i])
            layer.mlp.experts.bind(step, h[:b], step.idx[i], step.gate[i], out)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            nxt.bind_add(step, x2, out, x, h[:b])
        return step
