"""The generic MoE decoder: layers of a token mixer (``moerl.model.mixers``: attention, Gated DeltaNet, Mamba) and a
dense MLP or MoE, each in a residual branch.

Plain PyTorch, no parallelism inside: plans in ``moerl.parallel`` wrap it from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moerl.errors import ReplayError
from moerl.model.attention import KVCacheView, build_mask
from moerl.model.config import ModelConfig
from moerl.model.mixers import build_mixer, is_recurrent
from moerl.model.moe import MLP, MoE, mlp_activation
from moerl.model.norms import RMSNorm, layer_norm
from moerl.model.rope import inv_freq_and_scale, rope_cos_sin


class Handoff:
    """What a layer hands a later one within one forward: ``keys``, the keys the last indexer layer chose (GLM-5's
    shared layers), and ``carried``, by the layer that adds it, a MoE output carried past a layer (LongCat-Flash's
    shortcut). An object rather than a container: FSDP copies a module's container inputs as it casts them, and a
    later layer must see what an earlier one left."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.carried: dict[int, torch.Tensor] = {}


class DecoderLayer(nn.Module):
    """Attention then MLP / MoE, each in a residual branch: ``x + m * f(norm(x))`` (pre-norm, the default),
    ``x + m * norm(f(x))`` (post-sublayer norms, OLMo-2 placement), ``x + m * norm2(f(norm1(x)))`` (sandwich
    norms: AFMoE, Gemma) or ``x + m * attn(norm(x)) + m * mlp(norm(x))`` (a parallel block: Cohere); ``m`` is the
    residual multiplier. The MLP's input norm is ``post_attention_layernorm`` pre-norm, ``pre_feedforward_layernorm``
    in a sandwich, where ``post_attention_layernorm`` norms the attention's output as it does post-norm.

    A layer of one block (Nemotron-H's) keeps one half and one norm, ``input_layernorm``: a mixer alone (its index in
    ``mixer_only_layers``) or an MLP / MoE alone (layer type "none": no ``self_attn``)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.pre_norm = cfg.norm_placement in ("pre", "sandwich", "parallel")  # the sublayers' inputs normed
        self.parallel = cfg.norm_placement == "parallel"  # attention and MLP both of one normed input
        self.post_norm = cfg.norm_placement in ("post", "sandwich")  # their outputs normed
        kind = cfg.layer_types[layer]
        self.mask_kind = None if kind == "none" else ("linear" if is_recurrent(kind) else kind)
        self.has_mlp = layer not in cfg.mixer_only_layers
        if self.pre_norm:
            self.input_layernorm = layer_norm(cfg, cfg.hidden_size)
        if kind != "none":  # attention, Gated DeltaNet, Mamba-1 and -2 (moerl.model.mixers)
            self.self_attn = build_mixer(cfg, layer)
        if self.has_mlp and self.mask_kind is not None and not self.parallel:
            self.post_attention_layernorm = layer_norm(cfg, cfg.hidden_size)
        self.is_moe = layer in cfg.moe_layer_set
        # JetMoE's attention routes its queries too (attention "moa"): R3 columns, the attention's before the MoE's
        self.routes_attention = cfg.attention_routes(layer)
        self.routes = int(self.routes_attention) + int(self.is_moe)
        # Gemma 4's MoE layers: the MoE block takes the residual stream and norms its MLP's input itself
        self.block_norms_input = self.is_moe and cfg.moe_beside_mlp
        if self.pre_norm and self.post_norm and self.has_mlp and not self.block_norms_input:
            self.pre_feedforward_layernorm = layer_norm(cfg, cfg.hidden_size)
        # the MLP / MoE's output normed: post-norm layers and sandwiches, and MoE layers where the model says so
        self.mlp_out_norm = self.post_norm or (self.is_moe and cfg.moe_output_norm)
        if self.mlp_out_norm:
            self.post_feedforward_layernorm = layer_norm(cfg, cfg.hidden_size)
        # LongCat-Flash's layers in pairs (moe_shortcut): the first's MoE runs beside its dense MLP on the same input
        # and its output is carried past the second layer, which adds it at its end ("out" / "in")
        self.shortcut = None if not cfg.moe_shortcut else ("out" if self.is_moe else "in")
        if self.shortcut == "out":
            self.dense_mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, mlp_activation(cfg))
        self.residual_multiplier = cfg.residual_multiplier
        # the layer's output times a scalar of its own (Gemma 4's layer_scalar: a buffer, not trained)
        self.layer_scalar = nn.Buffer(torch.ones(1)) if cfg.layer_scale else None
        if self.is_moe:
            self.mlp = MoE(cfg)
        elif self.has_mlp:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, mlp_activation(cfg))
        self.layer = layer
        self.shares_keys = bool(cfg.index_shared_layers)  # its attention hands on or reads an indexer's keys (GLM-5)
        # the rotary table this layer's attention takes: the sliding layers' own where the model has a RoPE per kind; a
        # NoPE layer with temperature tuning takes its queries' scales instead
        self.rope_kind = "sliding" if kind == "sliding" and cfg.sliding_rope is not None else "full"
        if cfg.attn_temperature_scale and layer in cfg.nope_layers:
            self.rope_kind = "temperature"
        # ``block`` compiled for training (moerl.trainer.compile); None: eager
        self.compiled: Callable | None = None
        # ``recompute(layer, run, x, cos, sin, mask, replay, passed)`` runs a training forward's block so that it is
        # computed again in the backward (moerl.parallel.checkpointing); None: its activations are kept
        self.recompute: Callable | None = None

    def mix(
        self, x, cos, sin, mask, cache=None, passed=None, replay=None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The attention half of the layer: (the residual stream after attention, the MLP's input: None in a layer
        without an MLP, the attention experts chosen [N, k]: None unless its attention routes). ``passed``: what
        layers hand later ones within the forward (``Handoff``); ``replay``: the attention's experts to replay."""
        m = self.residual_multiplier
        if self.mask_kind is None:  # an MLP / MoE alone
            return x, self.input_layernorm(x), None
        more = {"passed": passed} if self.shares_keys and passed is not None else {}
        h = self.input_layernorm(x) if self.pre_norm else x
        chose = None
        if self.routes_attention:
            a, chose = self.self_attn(h, cos, sin, mask, cache, replay=replay)
        else:
            a = self.self_attn(h, cos, sin, mask, cache, **more)
        if self.parallel:  # the MLP takes the attention's input
            return x + (a if m == 1.0 else m * a), (h if self.has_mlp else None), chose
        if self.post_norm:
            a = self.post_attention_layernorm(a)
        norm = self._mlp_norm()
        if m == 1.0 and isinstance(norm, RMSNorm):
            return *norm.add_and_norm(x, a), chose  # one step: a backend's norm takes both in one call
        x = x + (a if m == 1.0 else m * a)  # no extra op per layer where there is no multiplier
        if not self.has_mlp:
            return x, None, chose
        return x, (x if norm is None else norm(x)), chose

    def _mlp_norm(self) -> nn.Module | None:
        """The norm of the MLP / MoE's input (None: post-norm layers, and layers without an MLP)."""
        if not self.has_mlp or not self.pre_norm or self.block_norms_input:
            return None
        return self.pre_feedforward_layernorm if self.post_norm else self.post_attention_layernorm

    def forward(
        self, x, cos, sin, mask, replay=None, cache=None, passed=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is not None and cache.runs_layers:  # the engine runs the block (its decode step's layer graph)
            return cache.run_layer(self, x, cos, sin, replay, passed)
        run = self.block
        # a training forward whose input carries a gradient: LoRA's first layer (frozen embeddings below it) runs
        # eager rather than compiling a second graph for an input without one
        if self.compiled is not None and cache is None and self.training and x.requires_grad:
            run = self.compiled
        if self.recompute is not None and cache is None and self.training and torch.is_grad_enabled():
            return self.recompute(self, run, x, cos, sin, mask, replay, passed)
        return run(x, cos, sin, mask, replay, cache, passed)

    def block(
        self, x, cos, sin, mask, replay=None, cache=None, passed=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer: (its output, the experts it chose: its one router's [N, k], its attention's and its MoE's
        [N, 2, k] where both route (``routes``), or None). ``replay``: the same shape, experts to use instead."""
        m = self.residual_multiplier
        # the attention's replay and the MoE's: columns 0 and 1 where both route
        attn_replay = replay if self.routes_attention else None
        if self.routes == 2 and replay is not None:
            attn_replay, replay = replay[:, 0], replay[:, 1]
        elif self.routes_attention:
            replay = None
        x, h, chose = self.mix(x, cos, sin, mask, cache, passed, attn_replay)
        idx = None
        if h is None:
            return (x if self.layer_scalar is None else x * self.layer_scalar), chose
        if self.is_moe:
            out, idx = self.mlp(h.flatten(0, 1), replay)
            out = out.view_as(x)
            if self.shortcut == "out":  # kept by the layer that reads it (a recomputed layer reads it again)
                passed.carried[self.layer + 1] = out
                out = self.dense_mlp(h)
        else:
            out = self.mlp(h)
        if self.mlp_out_norm:
            out = self.post_feedforward_layernorm(out)
        x = x + (out if m == 1.0 else m * out)
        if self.shortcut == "in":
            x = x + passed.carried[self.layer]
        if chose is not None:
            idx = chose if idx is None else torch.stack([chose, idx], dim=1)
        return (x if self.layer_scalar is None else x * self.layer_scalar), idx


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V] in the model dtype (None from a pipeline stage before the last)
    routed: torch.Tensor | None = None  # [B, T, L_moe, k] int64 chosen experts, when capture or replay
    hidden: torch.Tensor | None = None  # [B, T, H] a pipeline stage's output to the next
    head: object = None  # what the caller's ``head`` made of the final hidden states (in place of the logits)


class MoEModel(nn.Module):
    """Decoder-only MoE language model built from a ModelConfig.

    ``forward`` can capture each MoE layer's chosen experts and can replay given ones (R3).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = cfg
        self.backend: str | None = None  # the kernels installed on it from outside ("cpu": ``moerl.cpu.install``)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = layer_norm(cfg, cfg.hidden_size, cfg.final_norm_eps or None)
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
        """Compute the rotary tables: fp32, on the CPU (plain attributes, so ``to(dtype)`` leaves them fp32); the
        sliding layers' own (``sliding_inv_freq``, ``sliding_rope_scale``) where the model has a RoPE per kind."""
        cfg = self.config
        dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else (cfg.rope_dim or cfg.head_dim)
        self.inv_freq, self.rope_scale = inv_freq_and_scale(cfg.rope, dim, cfg.max_position_embeddings)
        self.sliding_inv_freq = None
        if cfg.sliding_rope is not None:
            dim = cfg.sliding_rope_dim or cfg.sliding_head_dim or cfg.head_dim
            self.sliding_inv_freq, self.sliding_rope_scale = inv_freq_and_scale(
                cfg.sliding_rope, dim, cfg.max_position_embeddings
            )

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [B, T, dim] of ``positions`` [B, T] per rotary table (``DecoderLayer.rope_kind``); with
        temperature tuning, "temperature": the NoPE layers' query scales [B, T] fp32 (and None)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        tables = {"full": rope_cos_sin(self.inv_freq, self.rope_scale, positions, dtype)}
        if self.sliding_inv_freq is not None:
            if self.sliding_inv_freq.device != positions.device:
                self.sliding_inv_freq = self.sliding_inv_freq.to(positions.device)
            tables["sliding"] = rope_cos_sin(self.sliding_inv_freq, self.sliding_rope_scale, positions, dtype)
        cfg = self.config
        if cfg.attn_temperature_scale:
            steps = torch.floor((positions.float() + 1.0) / cfg.attn_temperature_floor)
            tables["temperature"] = (torch.log1p(steps) * cfg.attn_temperature_scale + 1.0, None)
        return tables

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init: normal(0, std) matrices and experts, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "router.input_scale", "router.expert_scale")):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)
        for layer in self.layers:
            if layer.is_moe and layer.mlp.router.e_score_correction_bias is not None:
                layer.mlp.router.e_score_correction_bias.zero_()

    def set_expert_path(self, grouped: bool) -> None:
        """Pick the grouped-GEMM expert path (default) or the per-expert reference loop."""
        for i in self.moe_layer_ids:
            self.layers[i].mlp.experts.grouped = grouped

    @property
    def route_columns(self) -> list[int]:
        """The layer of each R3 column of this model's forward (of its own layers, on a pipeline stage): one per MoE
        layer, and before it one per layer whose attention routes (JetMoE's)."""
        return [layer.layer for layer in self.layers if isinstance(layer, DecoderLayer) for _ in range(layer.routes)]

    def check_replay(self, replay: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """``replay`` for a forward of [B=b, T=t] tokens, checked (shape, expert range: ReplayError naming them) and
        given its last row (-1) when it has T-1: int64 [b, t, L_moe, k]."""
        columns = self.route_columns
        n_moe, k = len(columns), self.config.top_k
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
                f"replay[..., {col}, :] (model layer {columns[col]}) holds expert {value}, "
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
        head=None,
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
        head: ``head(model, x)`` takes the final normed hidden states [B, T, H] in place of the whole logits (the
        trainer's logprobs in chunks: ``moerl.trainer.logprobs.LogprobHead``); inside this call, so the parameters
        it reads through ``logits`` are gathered (FSDP) as the forward's are. Its result is ``ModelOutput.head``.
        """
        b, t = input_ids.shape if hidden is None else hidden.shape[:2]
        if self.adapter_ctx is not None:
            self.adapter_ctx.set(adapters, b, t)
        elif adapters is not None:
            raise ValueError("adapters given but this model has no LoRA attached (moerl.model.lora.attach_lora)")
        counted = positions is None  # 0..T-1: a chunk of T or more positions holds every row whole
        if counted:
            positions = torch.arange(t, device=(input_ids if hidden is None else hidden).device).expand(b, t)
        if replay is not None:
            replay = self.check_replay(replay, b, t).flatten(0, 1)
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if hidden is None and self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        tables = self.rope_tables(positions, x.dtype)
        window = self.config.sliding_window if self.config.sliding_window and self.config.sliding_window < t else None
        plain = attention_mask is None or cache is not None  # no padding: the causal kernel, no mask tensor
        chunk = self.config.attention_chunk
        chunked = chunk is not None and cache is None and not (counted and attention_mask is None and chunk >= t)
        masks = {
            "full": None if plain else build_mask(attention_mask, b, t, None, x.device),
            "sliding": None if plain and window is None else build_mask(attention_mask, b, t, window, x.device),
            "chunked": build_mask(attention_mask, b, t, None, x.device, chunk, positions) if chunked else None,
            "linear": attention_mask,  # the sequences themselves: states restart at each
            None: None,  # a layer without a mixer
        }
        routed = []
        passed = Handoff()
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer):  # another pipeline stage's layer
                continue
            rows = None  # the layer's R3 columns: [N, k] of its one router, [N, 2, k] of two (JetMoE's)
            if replay is not None and layer.routes:
                col = len(routed)
                rows = replay[:, col] if layer.routes == 1 else replay[:, col : col + 2]
            x, idx = layer(x, *tables[layer.rope_kind], masks[layer.mask_kind], rows, cache, passed)
            if idx is not None:
                routed.extend(idx.unbind(1) if idx.ndim == 3 else [idx])
        keep = (capture or replay is not None) and routed
        routed = torch.stack(routed, dim=1).view(b, t, len(routed), -1) if keep else None
        if self.norm is None:
            return ModelOutput(None, routed, hidden=x)
        if logits_index is not None:
            x = x[torch.arange(b, device=x.device), logits_index]
        x = self.norm(x)
        if head is not None:
            return ModelOutput(None, routed, head=head(self, x))
        return ModelOutput(self.logits(x), routed)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head: logits [..., V] of final normed hidden states [..., H] (the tied embedding where the model ties
        it, scaled where the config scales them)."""
        logits = (
            self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed_tokens.weight, self.lm_head_bias)
        )
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
