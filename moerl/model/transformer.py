"""The generic MoE decoder: attention (GQA / MLA, qk-norm, sliding window, sinks), dense MLP and MoE layers.

Plain PyTorch, no parallelism inside: plans in ``moerl.parallel`` wrap it from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moerl.errors import ConfigError, ReplayError
from moerl.model.config import ModelConfig
from moerl.model.indexer import Indexer
from moerl.model.linear import Linear
from moerl.model.mixers import build_recurrent, is_recurrent
from moerl.model.moe import MLP, MoE, mlp_activation
from moerl.model.rope import apply_rope, inv_freq_and_scale, rope_cos_sin


class KVCacheView(Protocol):
    """What attention needs from a KV cache for one forward (the rollout engine implements it)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k/v [B, C, Hkv, d]; return every visible key/value, head-major [B, Hkv, S, d]."""
        ...

    def mask(self, sliding: bool) -> torch.Tensor:
        """Boolean [B, 1, C, S]: which cached keys each new query may attend to."""
        ...

    def update_index(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store this step's indexer keys [B, C, d] (DeepSeek sparse attention); return every visible one [B, S, d]."""
        ...


def layer_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The norm of the decoder layers and the final norm: RMSNorm, or LayerNorm with a bias (``cfg.norm``)."""
    return RMSNorm(dim, cfg.rms_norm_eps) if cfg.norm == "rms" else nn.LayerNorm(dim, eps=cfg.rms_norm_eps)


class RMSNorm(nn.Module):
    """RMSNorm (fused kernel: statistics in fp32, one rounding to the input dtype after the weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def attend(q, k, v, mask: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, T, d], k [B, Hkv, S, d], v [B, Hkv, S, dv], mask bool [B, 1, T, S] -> [B, T, Hq * dv].

    ``mask`` None means plain causal (T == S). ``sinks`` [Hq]: a learned logit per head that joins the softmax
    and is then dropped (GPT-OSS). Long queries use SDPA; short ones (decode) and sinks use explicit matmuls with
    fp32 scores, which on CPU is several times faster than bf16 SDPA for one query row.
    """
    b, hq, t, _ = q.shape
    if sinks is None and (mask is None or t > 8):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).flatten(2)
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


class Attention(nn.Module):
    """Grouped-query attention with RoPE and the per-architecture options of ModelConfig."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.rope_dim = 0 if layer in cfg.nope_layers else (cfg.rope_dim or d)  # 0: a layer without RoPE
        self.output_gate = cfg.attn_output_gate  # q_proj yields [q | gate] per head
        self.q_proj = Linear(h, nh * d * (2 if self.output_gate else 1), bias=cfg.qkv_bias)
        self.k_proj = Linear(h, nkv * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, nkv * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(nh * d, h, bias=cfg.o_bias)
        self.qk_norm, self.qk_norm_after_rope = cfg.qk_norm, cfg.qk_norm_after_rope
        self.interleave = cfg.rope_interleave
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(nh * d if full else d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(nkv * d if full else d, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv
        self.sinks = nn.Parameter(torch.zeros(nh)) if cfg.attention_sinks else None
        self.scale = cfg.attn_scale or d**-0.5
        self.sliding = cfg.layer_types[layer] == "sliding"
        self.layer = layer

    def forward(self, x, cos, sin, mask, cache: KVCacheView | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
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
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
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
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
            mask = cache.mask(self.sliding)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        out = attend(q.transpose(1, 2), k, v, mask, self.scale, self.sinks)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))


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
        self.sliding = cfg.layer_types[layer] == "sliding"
        self.layer = layer
        # DeepSeek sparse attention: each query attends to the keys its indexer chooses (moerl.model.indexer), or,
        # in GLM-5's shared layers, the keys the last indexer layer before it chose
        self.reuses_keys = layer in cfg.index_shared_layers
        self.indexer = Indexer(cfg) if cfg.index_topk and not self.reuses_keys else None

    def forward(self, x, cos, sin, mask, cache: KVCacheView | None = None, chosen: list | None = None) -> torch.Tensor:
        """``chosen``: a model with shared indexer layers passes one list through a forward's layers; an indexer
        layer leaves its narrowed mask there for the shared layers after it."""
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q = q_low = self.q_proj(x)
        else:
            q_low = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_low)
        q = q.view(b, t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, self.interleave)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.interleave).expand(-1, -1, self.num_heads, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        if cache is not None:  # the cache holds per-head k/v expanded from the latent
            k, v = cache.update(self.layer, k, v)
            mask = cache.mask(self.sliding)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.indexer is not None:
            keys = self.indexer.keys(x, cos, sin)
            if cache is not None:
                keys = cache.update_index(self.layer, keys)
            elif mask is None:
                mask = build_mask(None, 1, t, None, x.device)
            mask = self.indexer.select(x, q_low, cos, sin, keys, mask)
            if chosen is not None:
                chosen[:] = [mask]
        elif self.reuses_keys:
            if not chosen:
                raise ConfigError(
                    f"layer {self.layer} keeps the keys an earlier indexer layer chose (index_shared_layers), and "
                    "none ran before it in this forward: a pipeline stage must start at a layer with an indexer"
                )
            mask = chosen[0]
        return self.o_proj(attend(q.transpose(1, 2), k, v, mask, self.scale))


class DecoderLayer(nn.Module):
    """Attention then MLP / MoE, each in a residual branch: ``x + m * f(norm(x))`` (pre-norm, the default) or
    ``x + m * norm(f(x))`` (post-sublayer norms, OLMo-2 placement); ``m`` is the residual multiplier.

    A layer of one block (Nemotron-H's) keeps one half and one norm, ``input_layernorm``: a mixer alone (its index in
    ``mixer_only_layers``) or an MLP / MoE alone (layer type "none": no ``self_attn``)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.post_norm = cfg.norm_placement == "post"
        kind = cfg.layer_types[layer]
        self.mask_kind = None if kind == "none" else ("linear" if is_recurrent(kind) else kind)
        self.has_mlp = layer not in cfg.mixer_only_layers
        if not self.post_norm:
            self.input_layernorm = layer_norm(cfg, cfg.hidden_size)
        if is_recurrent(kind):  # Gated DeltaNet, Mamba-1 and -2 (moerl.model.mixers)
            self.self_attn = build_recurrent(cfg, layer)
        elif kind != "none":
            self.self_attn = (MLAttention if cfg.attention == "mla" else Attention)(cfg, layer)
        if self.has_mlp and self.mask_kind is not None:
            self.post_attention_layernorm = layer_norm(cfg, cfg.hidden_size)
        if self.post_norm:
            self.post_feedforward_layernorm = layer_norm(cfg, cfg.hidden_size)
        self.residual_multiplier = cfg.residual_multiplier
        self.is_moe = layer in cfg.moe_layer_set
        if self.is_moe:
            self.mlp = MoE(cfg)
        elif self.has_mlp:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, mlp_activation(cfg))
        self.layer = layer
        # ``block`` compiled for training (moerl.trainer.compile); None: eager
        self.compiled: Callable | None = None

    def mix(self, x, cos, sin, mask, cache=None, chosen=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention half of the layer: (the residual stream after attention, the MLP's input; None in a layer
        without an MLP). ``chosen``: the keys indexer layers chose, in a model with shared indexer layers."""
        m = self.residual_multiplier
        if self.mask_kind is None:  # an MLP / MoE alone
            return x, self.input_layernorm(x)
        more = {} if chosen is None else {"chosen": chosen}
        if self.post_norm:
            a = self.post_attention_layernorm(self.self_attn(x, cos, sin, mask, cache, **more))
        else:
            a = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, **more)
        x = x + (a if m == 1.0 else m * a)  # no extra op per layer where there is no multiplier
        if not self.has_mlp:
            return x, None
        return x, (x if self.post_norm else self.post_attention_layernorm(x))

    def forward(
        self, x, cos, sin, mask, replay=None, cache=None, chosen=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # a training forward whose input carries a gradient: LoRA's first layer (frozen embeddings below it) runs
        # eager rather than compiling a second graph for an input without one
        if self.compiled is not None and cache is None and self.training and x.requires_grad:
            return self.compiled(x, cos, sin, mask, replay, None, chosen)
        return self.block(x, cos, sin, mask, replay, cache, chosen)

    def block(
        self, x, cos, sin, mask, replay=None, cache=None, chosen=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer: (its output, the MoE's chosen experts [N, k] or None)."""
        m = self.residual_multiplier
        x, h = self.mix(x, cos, sin, mask, cache, chosen)
        idx = None
        if h is None:
            return x, idx
        if self.is_moe:
            out, idx = self.mlp(h.flatten(0, 1), replay)
            out = out.view_as(x)
        else:
            out = self.mlp(h)
        if self.post_norm:
            out = self.post_feedforward_layernorm(out)
        return x + (out if m == 1.0 else m * out), idx


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V] in the model dtype (None from a pipeline stage before the last)
    routed: torch.Tensor | None = None  # [B, T, L_moe, k] int64 chosen experts, when capture or replay
    hidden: torch.Tensor | None = None  # [B, T, H] a pipeline stage's output to the next


def build_mask(attention_mask: torch.Tensor | None, b: int, t: int, window: int | None, device) -> torch.Tensor:
    """Boolean [B, 1, T, T]: causal, padded keys hidden, optional sliding window (i - j < window).

    ``attention_mask`` [B, T]: 0 = padding, else the token's sequence within a packed row (1, 2, ...): a token
    sees only keys of its own sequence (0/1 masks: every real key). Every query sees itself, so fully padded rows
    stay finite instead of becoming NaN.
    """
    i = torch.arange(t, device=device)
    mask = i[None, :] <= i[:, None]
    if window:
        mask = mask & (i[:, None] - i[None, :] < window)
    mask = mask.expand(b, 1, t, t)
    if attention_mask is not None:
        seg = attention_mask[:, None]
        query, key = seg[..., :, None], seg[..., None, :]
        mask = mask & (key != 0) & ((query == key) | (query == 0))
    return mask | torch.eye(t, dtype=torch.bool, device=device)


class MoEModel(nn.Module):
    """Decoder-only MoE language model built from a ModelConfig.

    ``forward`` can capture each MoE layer's chosen experts and can replay given ones (R3).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = layer_norm(cfg, cfg.hidden_size)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)
        )
        # a tied head's bias (Ernie-4.5): the checkpoint's lm_head.bias
        self.lm_head_bias = (
            nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.tie_word_embeddings and cfg.lm_head_bias else None
        )
        self.moe_layer_ids = [i for i, layer in enumerate(self.layers) if layer.is_moe]
        # a pipeline stage (moerl.parallel.pipeline) keeps only its layers: the others are placeholders, the
        # embedding lives on the first stage, the norm and head on the last
        self.hf_config: dict | None = None  # set by the bridge loader; export writes it back
        # the adapter slots' context (``set(adapters, batch, seq)``), installed by a mode that attaches adapters
        # (moerl.model.lora.attach_lora); the plain model only hands it each forward's ``adapters``
        self.adapter_ctx = None
        self.init_rope()
        if dtype is not None:
            self.to(dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype if self.norm is not None else self.embed_tokens.weight.dtype

    def init_rope(self) -> None:
        """Compute the rotary table: fp32, on the CPU (a plain attribute, so ``to(dtype)`` leaves it fp32)."""
        cfg = self.config
        dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else (cfg.rope_dim or cfg.head_dim)
        self.inv_freq, self.rope_scale = inv_freq_and_scale(cfg.rope, dim, cfg.max_position_embeddings)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init: normal(0, std) matrices and experts, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)
        for layer in self.layers:
            if layer.is_moe and layer.mlp.router.e_score_correction_bias is not None:
                layer.mlp.router.e_score_correction_bias.zero_()

    def experts_k_major(self) -> None:
        """Every MoE layer's expert weights in the decode layout of ``Experts.k_major`` (the CPU engine's own model)."""
        for i in self.moe_layer_ids:
            self.layers[i].mlp.experts.k_major()

    def set_expert_path(self, grouped: bool) -> None:
        """Pick the grouped-GEMM expert path (default) or the per-expert reference loop."""
        for i in self.moe_layer_ids:
            self.layers[i].mlp.experts.grouped = grouped

    def check_replay(self, replay: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """``replay`` for a forward of [B=b, T=t] tokens, checked (shape, expert range: ReplayError naming them) and
        given its last row (-1) when it has T-1: int64 [b, t, L_moe, k]."""
        n_moe, k = len(self.moe_layer_ids), self.config.top_k
        e = self.config.num_experts + self.config.zero_experts  # a zero-computation expert is replayed as any other
        if (
            replay.ndim != 4
            or replay.shape[0] != b
            or replay.shape[1] not in (t, t - 1)
            or replay.shape[2:]
            != (
                n_moe,
                k,
            )
        ):
            raise ReplayError(
                f"replay has shape {tuple(replay.shape)}; this forward needs "
                f"[B={b}, T={t} or T-1={t - 1}, L_moe={n_moe}, k={k}]"
            )
        replay = replay.long()
        bad = (replay < -1) | (replay >= e)
        if bad.any():
            col = int(bad.nonzero()[0, 2])
            value = int(replay[..., col, :][bad[..., col, :]][0])
            raise ReplayError(
                f"replay[..., {col}, :] (model layer {self.moe_layer_ids[col]}) holds expert {value}, "
                f"outside [0, {e}) (-1 means: use the router's own choice)"
            )
        if replay.shape[1] == t - 1:  # the last token has no recorded row: it routes itself
            replay = torch.cat([replay, replay.new_full((b, 1, n_moe, k), -1)], dim=1)
        return replay

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        replay: torch.Tensor | None = None,
        capture: bool = False,
        adapters: int | torch.Tensor | None = None,
        cache: KVCacheView | None = None,
        logits_index: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Logits for ``input_ids`` [B, T].

        positions: [B, T] rotary positions (default 0..T-1). attention_mask: [B, T], 1 = token, 0 = padding; packed
        rows number their sequences 1, 2, ... (tokens attend within their own; ``positions`` restart per sequence).
        replay: [B, T or T-1, L_moe, k] expert indices to use instead of the router's top-k (-1: own choice).
        capture: return the chosen experts of every MoE layer as ``routed``.
        adapters: LoRA slot for every token (int), per sequence ([B]) or per token ([B, T]), -1 = none; None = base
        model only.
        cache: a KV cache view (the rollout engine): attention reads and writes it and takes its masks.
        logits_index: [B] one position per row: logits come back as [B, V] for those positions only.
        hidden: [B, T, H] the previous pipeline stage's output, in place of the embedded ``input_ids``; a stage
        without the final norm returns its hidden states as ``ModelOutput.hidden``.
        """
        b, t = input_ids.shape if hidden is None else hidden.shape[:2]
        if self.adapter_ctx is not None:
            self.adapter_ctx.set(adapters, b, t)
        elif adapters is not None:
            raise ValueError("adapters given but this model has no LoRA attached (moerl.model.lora.attach_lora)")
        if positions is None:
            positions = torch.arange(t, device=(input_ids if hidden is None else hidden).device).expand(b, t)
        if replay is not None:
            replay = self.check_replay(replay, b, t).flatten(0, 1)
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if hidden is None and self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions, x.dtype)
        window = self.config.sliding_window if self.config.sliding_window and self.config.sliding_window < t else None
        plain = attention_mask is None or cache is not None  # no padding: the causal kernel, no mask tensor
        masks = {
            "full": None if plain else build_mask(attention_mask, b, t, None, x.device),
            "sliding": None if plain and window is None else build_mask(attention_mask, b, t, window, x.device),
            "linear": attention_mask,  # the sequences themselves: states restart at each
            None: None,  # a layer without a mixer
        }
        routed = []
        chosen = [] if self.config.index_shared_layers else None  # the keys indexer layers chose (GLM-5's sharing)
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer):  # another pipeline stage's layer
                continue
            col = len(routed)
            x, idx = layer(
                x,
                cos,
                sin,
                masks[layer.mask_kind],
                replay[:, col] if replay is not None and layer.is_moe else None,
                cache,
                chosen,
            )
            if idx is not None:
                routed.append(idx)
        keep = (capture or replay is not None) and routed
        routed = torch.stack(routed, dim=1).view(b, t, len(routed), -1) if keep else None
        if self.norm is None:
            return ModelOutput(None, routed, hidden=x)
        if logits_index is not None:
            x = x[torch.arange(b, device=x.device), logits_index]
        x = self.norm(x)
        logits = (
            self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed_tokens.weight, self.lm_head_bias)
        )
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return ModelOutput(logits, routed)
