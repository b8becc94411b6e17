"""Zero-code bridges: a checkpoint whose architecture has no bridge file gets one derived from its config, then
proven against transformers before it is used.

Deriving: config fields from the synonyms Llama-style MoE families use (``SYNONYMS``); everything else that shapes
the model from the tensor names of a tiny random instance of the same config built with transformers (router under
``gate`` / ``router``, per-expert or fused experts, shared experts and their gate, q/k norms per head or per
projection, biases, LayerNorm, post-sublayer norms, which layers are MoE). A config field the derivation neither
reads nor knows to be inert (``INERT``) is refused by name, as is any tensor no rule places.

Proving: the tiny instance and the derived moerl model run the same tokens; the bridge is accepted at fp32 parity
(``TOL``) with equal router choices. Behaviour names cannot show (renormalised top-k or not, softmax before or after
the top-k, q/k norms before or after the rotation, ...) is tried in ``variants`` order: the first that passes
wins.
Otherwise the refusal names the first layer and quantity that differ. ``moerl check-arch DIR`` runs this and prints
the derived bridge as a file to commit.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from moerl.bridges.base import (
    LINEAR_ATTENTION_RULES,
    LINEAR_FIELDS,
    Bridge,
    Fused,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    layer_types,
    linear_attention_fields,
    minus_one,
    mtp_layer,
    partial_rope_dim,
    plus_one,
    sparse_layers,
)
from moerl.errors import ConfigError, UnknownArchitectureError
from moerl.model.config import ModelConfig

TOL = 1e-4
SYNONYMS = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "n_shared_experts": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    "shared_size": ("shared_expert_intermediate_size", "shared_intermediate_size"),
    "routed_scaling_factor": (
        "routed_scaling_factor",
        "router_scaling_factor",
        "moe_routed_scaling_factor",
        "route_scale",
    ),  # fmt: skip
}
MUP = ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")  # GraniteMoe's
MLA = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim")
READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta",
    "rope_scaling", "intermediate_size", "norm_topk_prob", "attention_bias", "sliding_window", "use_sliding_window",
    "layer_types", "max_window_layers", "hidden_act", "clip_qkv",
    # what the tensor names decide (biases, which layers are MoE)
    "qkv_bias", "mlp_bias", "use_bias", "lm_head_bias", "decoder_sparse_step", "mlp_only_layers",
    "first_k_dense_replace", "moe_layer_freq", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
    # linear-attention (Gated DeltaNet) layers and the partial rotary of hybrid families
    *LINEAR_FIELDS, "linear_conv_kernel_dim", "partial_rotary_factor", "full_attention_interval",
    # DeepSeek-V3 routing under any family's name; its multi-token-prediction layers are not loaded
    "n_group", "topk_group", "scoring_func", "topk_method", "num_nextn_predict_layers",
    # q/k norms on or off (the tensors tell), dense / sparse MLP per layer, the sliding period, MiniMax's rotary
    "use_qk_norm", "mlp_layer_types", "sliding_window_pattern", "rotary_dim", "global_attn_every_n_layers",
    # the first layers dense (AFMoE), muP's embedding scale by sqrt(hidden_size) as a switch (AFMoE)
    "num_dense_layers", "mup_enabled", "layer_rope_theta",
    *MUP, *MLA, "rope_interleave",
}  # fmt: skip
INERT = {  # fields that do not change the forward pass (ids, bookkeeping, training-only losses)
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef",
    "attention_dropout", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "id2label", "label2id", "tokenizer_class",
    "pretraining_tp", "tie_encoder_decoder", "auto_map", "router_z_loss_coef", "use_return_dict", "eod_token_id",
    "sep_token_id",
    # routing noise in training; where a family uses one at inference too (PhiMoE), the proof finds the difference
    "router_jitter_noise", "input_jitter_noise",
    # HY-V3 sums routed and shared experts in fp32 when computing in bf16: a rounding detail, moerl sums in the
    # compute dtype
    "enable_moe_fp32_combine",
}  # fmt: skip
# config fields that say the family needs a feature moerl's decoder does not compute: the refusal names it
FEATURES = {
    "zero_expert_num": "zero-computation experts",
    **dict.fromkeys(("index_topk", "index_n_heads", "index_head_dim", "indexer_types"), "indexed sparse attention"),
    **dict.fromkeys(("linear_num_heads", "linear_head_dim"), "linear-attention layers other than Gated DeltaNet (KDA)"),
    **dict.fromkeys(("block_size", "linear_attn_alpha_factor"), "lightning linear-attention layers"),
    **dict.fromkeys(("conv_L_cache", "conv_bias"), "short-convolution layers"),
    **dict.fromkeys(("hc_mult", "hc_eps", "hc_magnitude"), "hyper-connections (several residual streams)"),
    **dict.fromkeys(("mamba_d_state", "mamba_n_heads", "ssm_state_size", "mamba_expand"), "Mamba layers"),
    "attention_chunk_size": "chunked attention",
    "attn_temperature_tuning": "attention temperature tuning",
    **dict.fromkeys(("cca_time0", "cca_time1"), "compressed convolutional attention"),
    "moe_router_logit_softcapping": "router logit soft-capping",
    "num_attention_heads_per_layer": "a head count per layer",
    "attention_value_scale": "scaled attention values",
    "shared_expert_combination_strategy": "shared experts combined with the routed ones other than by a sum",
}
# tensor names (under a layer) that say the same
TENSOR_FEATURES = {
    **dict.fromkeys(("pre_mlp_layernorm", "post_mlp_layernorm"), "sandwich norms (a norm before and after each MLP)"),
    "self_attn.gate_proj": "an attention output gate with a projection of its own",
    "attention_sink_bias": "attention sinks stored as a bias",
}


# behaviour tensor names cannot show, tried in this order where the layout leaves it open: softmax before or after
# the top-k, per-head q/k norms before or after the rotation, RMSNorms that scale by 1 + w (Qwen3.5's), the top-k
# renormalised when no field says (HY-V3 always does), full-attention layers without RoPE beside sliding ones (EXAONE)
def variants(hf: dict, layout: Layout) -> list[dict]:
    """The behaviour variants worth trying for config ``hf`` with tensors laid out as ``layout``, in order."""
    softmax = layout.correction_bias is None and hf.get("scoring_func", "softmax") == "softmax"
    kinds = set(hf.get("layer_types") or [])
    open_ = dict(
        norm_offset=(False, True),
        norm_topk=(False, True) if "norm_topk_prob" not in hf else (False,),
        nope_full=(False, True) if {"full_attention", "sliding_attention"} <= kinds else (False,),
        topk_before_softmax=(False, True) if softmax else (False,),
        qk_norm_after_rope=(False, True) if layout.qk_norm == "head" else (False,),
    )
    out = [dict(zip(open_, values, strict=True)) for values in itertools.product(*open_.values())]
    return [v for v in out if not (v["topk_before_softmax"] and v["norm_topk"])]  # the k-softmax sums to 1 anyway


# what the derived path reads as sizes and switches: checked for type and range before transformers sees them
COUNTED = ("num_experts", "top_k", "moe_intermediate_size")
COUNTS = {  # ints >= 1 (null: absent)
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "intermediate_size", "sliding_window", "max_window_layers", "decoder_sparse_step",
    "moe_layer_freq", "moe_layer_interval", *(n for k, names in SYNONYMS.items() for n in names if k in COUNTED),
    *LINEAR_FIELDS, "linear_conv_kernel_dim", "full_attention_interval", "n_group", "topk_group", *MLA, "rotary_dim",
    "sliding_window_pattern", "global_attn_every_n_layers",
}  # fmt: skip
NOT_NULL = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", *SYNONYMS["top_k"]}
INDICES = {  # ints >= 0
    "first_k_dense_replace", "moe_layer_start_index", "moe_layer_end_index", "num_nextn_predict_layers",
    "num_dense_layers", *SYNONYMS["n_shared_experts"], *SYNONYMS["shared_size"],
}  # fmt: skip
SWITCHES = {
    "tie_word_embeddings", "norm_topk_prob", "attention_bias", "use_sliding_window", "qkv_bias", "mlp_bias",
    "use_qk_norm", "rope_interleave", "enable_moe_fp32_combine", "mup_enabled",
}  # fmt: skip
POSITIVE = {  # numbers > 0
    "rms_norm_eps", "rope_theta", "clip_qkv", "partial_rotary_factor", *MUP, *SYNONYMS["routed_scaling_factor"],
}  # fmt: skip


def _typed(hf: dict) -> None:
    """Every size, index, switch and positive number of ``hf`` the derived path reads has its type and range: a
    ConfigError naming the field, not transformers' traceback."""
    for key, value in hf.items():
        if value is None and key not in NOT_NULL:
            continue
        if key in COUNTS or key in INDICES:
            least = 1 if key in COUNTS else 0
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ConfigError(f"config.json: field {key!r} must be an int >= {least}, got {value!r}")
        elif key in SWITCHES and not isinstance(value, bool):
            raise ConfigError(f"config.json: field {key!r} must be true or false, got {value!r}")
        elif key in POSITIVE and not (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ):
            raise ConfigError(f"config.json: field {key!r} must be a number > 0, got {value!r}")
    layers = hf.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        got = hf["mlp_only_layers"]
        raise ConfigError(f"config.json: field 'mlp_only_layers' must list layer indices, got {got!r}")
    kinds = hf.get("mlp_layer_types")
    if kinds is not None and not (isinstance(kinds, list) and set(kinds) <= {"dense", "sparse"}):
        raise ConfigError(f"config.json: field 'mlp_layer_types' must list 'dense' / 'sparse' per layer, got {kinds!r}")


def _known(hf: dict) -> None:
    _typed(hf)
    synonyms = {name for names in SYNONYMS.values() for name in names}
    unknown = sorted(set(hf) - READ - INERT - synonyms)
    features = list(dict.fromkeys(FEATURES[k] for k in unknown if k in FEATURES))
    if features:
        named = [k for k in unknown if k in FEATURES]
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: it has {'; '.join(features)} (config field(s) "
            f"{', '.join(map(repr, named))}), which moerl's decoder does not compute"
        )
    if unknown:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: config field(s) {', '.join(map(repr, unknown))} are not "
            "understood (a bridge file can map them; see moerl/bridges/README.md)"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise UnknownArchitectureError(f"cannot derive a bridge for {_arch(hf)}: hidden_act={hf['hidden_act']!r}")


def _arch(hf: dict) -> str:
    return (hf.get("architectures") or ["?"])[0]


def _pattern(name: str) -> str:
    """A tensor name with its layer and expert indices as placeholders."""
    name = re.sub(r"^model\.layers\.\d+\.", "model.layers.{i}.", name)
    return re.sub(r"\.experts\.\d+\.", ".experts.{e}.", name)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the tensor names (and shapes) of a checkpoint of the family say."""

    block: str  # "mlp" | "block_sparse_moe": the MoE block's module name
    router: str  # its router's module name under the block: "gate" | "router"
    experts: tuple[str, str, str] | None  # per-expert (gate, up, down) names, or None for fused 3D experts
    shared: str | None  # the shared expert's module name under the block
    shared_gate: bool
    moe_layers: tuple[int, ...]
    qk_norm: str  # none | head | full
    qk_norm_names: tuple[str, str]  # the q and k norms' module names under self_attn
    qkv_bias: bool
    o_bias: bool
    router_bias: bool
    layer_norm: bool  # LayerNorm with bias instead of RMSNorm
    post_norm: bool  # post-sublayer norms, no input norm
    tied: bool
    lm_head_bias: bool
    linear: str | None = None  # linear-attention projections: "split" (in_proj_qkv, _z, _b, _a) | "fused" (_qkvz, _ba)
    output_gate: bool = False  # q_proj yields a per-head output gate too (twice o_proj's input)
    attention: str = "gqa"  # "mla": multi-head latent attention (q_a_proj / kv_a_proj_with_mqa / kv_b_proj)
    correction_bias: str | None = None  # the router's selection-only bias (DeepSeek-V3's), as the checkpoint names it
    fused_experts: str = "experts"  # 3D experts as experts.{gate_up_proj, down_proj} | "linear": {input, output}_linear
    shared_at_layer: bool = False  # the shared MLP sits beside the MoE block (model.layers.{i}.shared_mlp)
    shared_fused: bool = False  # the shared MLP as input_linear (gate rows, then up rows) and output_linear
    sinks: bool = False  # a learned sink logit per head (self_attn.sinks, GPT-OSS's)


def read_layout(shapes: dict[str, tuple[int, ...]]) -> Layout:
    """The layout the tensor names ``shapes`` (name -> shape) show (names no rule then places are refused by the
    loader, by name)."""
    patterns = {_pattern(n) for n in shapes}
    router_re = r"model\.layers\.(\d+|\{i\})\.(mlp|block_sparse_moe)\.((?:gate|router)(?:\.wg|\.layer|\.gate)?)\.weight"
    moe = sorted({int(m.group(1)) for n in shapes if (m := re.fullmatch(router_re, n))})
    found = [m for p in patterns if (m := re.fullmatch(router_re, p))]
    if not found:
        raise UnknownArchitectureError("no router tensor (model.layers.{i}.mlp.gate.weight, .router.weight, ...)")
    block, router = found[0].group(2), found[0].group(3)
    per_expert = {p.split(".experts.{e}.")[1].removesuffix(".weight") for p in patterns if ".experts.{e}." in p}
    experts = None
    if per_expert:
        for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            if per_expert == set(names):
                experts = names
        if experts is None:
            raise UnknownArchitectureError(f"per-expert tensors {sorted(per_expert)} are not gate / up / down")
    shared = next(
        (s for s in ("shared_expert", "shared_experts", "shared_mlp") if any(f".{block}.{s}." in p for p in patterns)),
        None,
    )
    shared_at_layer = shared is None and any(p.startswith("model.layers.{i}.shared_mlp.") for p in patterns)
    if shared_at_layer:
        shared = "shared_mlp"
    bias_re = rf"model\.layers\.\{{i\}}\.{block}\.(?:{re.escape(router)}\.)?(?:e_score_correction_bias|expert_bias)"
    correction_bias = next((p for p in sorted(patterns) if re.fullmatch(bias_re, p)), None)
    mla = any(".self_attn.kv_a_proj_with_mqa." in p for p in patterns)
    names = next(
        (
            (q, k)
            for q, k in (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))
            if any(f"self_attn.{q}." in p for p in patterns)
        ),
        ("q_norm", "k_norm"),
    )
    q_norm = next((shape for n, shape in shapes.items() if n.endswith(f"self_attn.{names[0]}.weight")), None)
    q_proj = next((shape for n, shape in shapes.items() if n.endswith("self_attn.q_proj.weight")), None)
    if q_proj is None and not mla:
        raise UnknownArchitectureError(
            "no self_attn.q_proj tensor (grouped-query attention), no self_attn.kv_a_proj_with_mqa (latent attention)"
        )
    o_proj = next((shape for n, shape in shapes.items() if n.endswith("self_attn.o_proj.weight")), None)
    output_gate = not mla and o_proj is not None and q_proj[0] == 2 * o_proj[1]
    qk_norm = "none" if q_norm is None else ("full" if q_norm[0] * (2 if output_gate else 1) == q_proj[0] else "head")
    linear = next(
        (
            kind
            for kind, proj in (("split", "in_proj_qkv"), ("fused", "in_proj_qkvz"))
            if any(f"linear_attn.{proj}." in p for p in patterns)
        ),
        None,
    )
    return Layout(
        block=block,
        router=router,
        experts=experts,
        shared=shared,
        shared_gate=any(p.endswith(f"{block}.shared_expert_gate.weight") for p in patterns),
        moe_layers=tuple(moe),
        qk_norm=qk_norm,
        qk_norm_names=names,
        qkv_bias=any(p.endswith("self_attn.q_proj.bias") for p in patterns),
        o_bias=any(p.endswith("self_attn.o_proj.bias") for p in patterns),
        router_bias=any(p.endswith(f"{block}.{router}.bias") for p in patterns),
        layer_norm=any(
            p.endswith("input_layernorm.bias") or p.endswith("post_attention_layernorm.bias") for p in patterns
        ),
        post_norm=any("post_feedforward_layernorm" in p for p in patterns)
        and not any("input_layernorm" in p for p in patterns),
        tied="lm_head.weight" not in shapes,
        lm_head_bias="lm_head.bias" in shapes,
        linear=linear,
        output_gate=output_gate,
        attention="mla" if mla else "gqa",
        correction_bias=correction_bias,
        fused_experts="linear" if any(p.endswith(f"{block}.input_linear.weight") for p in patterns) else "experts",
        shared_at_layer=shared_at_layer,
        sinks=any(p.endswith("self_attn.sinks") for p in patterns),
        shared_fused=shared is not None and any(".shared_mlp.input_linear." in p for p in patterns),
    )


def moe_layers(c: HFConfig, n: int) -> list[int]:
    """The MoE layers by the config's pattern fields (every layer when it has none)."""
    d = c.data
    kinds = c.opt("mlp_layer_types", list)
    if kinds is not None:
        if len(kinds) != n:
            raise ConfigError(f"{c.source}: field 'mlp_layer_types' lists {len(kinds)} layers, the model has {n}")
        return [i for i, kind in enumerate(kinds) if kind == "sparse"]
    if "num_dense_layers" in d:
        return sparse_layers(n, first_dense=c.opt("num_dense_layers", int, 0))
    if "decoder_sparse_step" in d or "mlp_only_layers" in d:
        return sparse_layers(n, c.opt("decoder_sparse_step", int, 1), c.opt("mlp_only_layers", list, []))
    if "first_k_dense_replace" in d:
        return sparse_layers(n, c.opt("moe_layer_freq", int, 1), first_dense=c.opt("first_k_dense_replace", int, 0))
    if "moe_layer_start_index" in d or "moe_layer_interval" in d:
        start, end = c.opt("moe_layer_start_index", int, 0), c.opt("moe_layer_end_index", int, n - 1)
        end = n - 1 if end == -1 else end
        step = c.opt("moe_layer_interval", int, 1)
        return [i for i in range(n) if (i + 1) % step == 0 and start <= i <= end]
    return list(range(n))


def _one_rope(c: HFConfig, types: list[str]) -> HFConfig:
    """``c`` with ``rope_parameters`` keyed by layer kind (MiMo, Mellum) reduced to the one RoPE its layers use;
    different RoPEs per kind are refused by name."""
    thetas = [t for t in c.opt("layer_rope_theta", list, []) if t]  # GraniteMoeSWA: a theta per layer, 0 = NoPE
    if thetas:
        if len(set(thetas)) > 1:
            raise UnknownArchitectureError(
                f"{c.source}: layer_rope_theta differs between layers ({sorted(set(thetas))[:4]}): a RoPE per layer "
                "is not computed by moerl's decoder"
            )
        params = dict(c.opt("rope_parameters", dict) or {}) | {"rope_theta": float(thetas[0])}
        c = HFConfig(c.data | {"rope_parameters": params}, c.source)
    params = c.opt("rope_parameters", dict)
    if not params or not all(k in ("full_attention", "sliding_attention") for k in params):
        return c
    kinds = {"full": "full_attention", "sliding": "sliding_attention"}
    used = [params.get(kinds[t]) for t in dict.fromkeys(types) if t in kinds]
    if any(u is None for u in used) or any(u != used[0] for u in used):
        raise UnknownArchitectureError(
            f"{c.source}: rope_parameters differ per layer kind ({', '.join(params)}): a RoPE per layer kind is not "
            "computed by moerl's decoder"
        )
    top = {k: v for k, v in used[0].items() if k == "partial_rotary_factor"}
    return HFConfig(c.data | top | {"rope_parameters": used[0]}, c.source)


def _routing(c: HFConfig, layout: Layout, variant: dict) -> dict:
    """The router's fields: softmax or sigmoid scores, DeepSeek-V3's selection bias and groups, the scaling."""
    scoring = c.opt("scoring_func", str, "sigmoid" if layout.correction_bias else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise UnknownArchitectureError(f"{c.source}: scoring_func={scoring!r}: allowed: softmax, sigmoid")
    method = c.opt("topk_method", str, "noaux_tc")
    if method not in ("noaux_tc", "greedy"):  # noaux_tc: groups by their top-2 sum; greedy: no groups
        raise UnknownArchitectureError(f"{c.source}: topk_method={method!r}: allowed: noaux_tc, greedy")
    before = variant["topk_before_softmax"]
    norm = variant.get("norm_topk") or c.opt("norm_topk_prob", bool, False)
    return dict(
        scoring=scoring,
        score_correction_bias=layout.correction_bias is not None,
        topk_before_softmax=before,
        norm_topk_prob=False if before else norm,
        n_group=c.opt("n_group", int, 1),
        topk_group=c.opt("topk_group", int, 1),
        routed_scaling_factor=next(
            (c.req(k, float) for k in SYNONYMS["routed_scaling_factor"] if c.data.get(k) is not None), 1.0
        ),
    )


def _attention(c: HFConfig, f: dict, layout: Layout, variant: dict, types: list[str]) -> dict:
    """Grouped-query attention's knobs (q/k norms, output gate, partial or no RoPE), or latent attention's sizes."""
    mla = [k for k in MLA if c.data.get(k) is not None]
    if layout.attention == "mla":
        from moerl.bridges.deepseek_v3 import mla_fields

        return mla_fields(c, f["rope"], rope_interleave=c.opt("rope_interleave", bool, False))
    if mla and mla != ["qk_head_dim"]:
        raise UnknownArchitectureError(
            f"{c.source}: latent-attention field(s) {', '.join(map(repr, mla))} without latent-attention tensors "
            "(self_attn.kv_a_proj_with_mqa): value heads of another size than the query heads are not computed"
        )
    rotary = c.opt("rotary_dim", int)  # MiniMax-M2's spelling of a partial rotary
    rope_dim = partial_rope_dim(c, f["head_dim"]) if rotary is None else (None if rotary == f["head_dim"] else rotary)
    both = {"full", "sliding"} <= set(types)
    nope = [i for i, t in enumerate(types) if t == "full"] if variant.get("nope_full") and both else []
    nope += [i for i, theta in enumerate(c.opt("layer_rope_theta", list, [])) if theta == 0 and i not in nope]
    return dict(
        qkv_bias=layout.qkv_bias,
        o_bias=layout.o_bias,
        qk_norm=layout.qk_norm,
        qk_norm_after_rope=variant["qk_norm_after_rope"] and layout.qk_norm == "head",
        clip_qkv=c.opt("clip_qkv", float),
        attn_output_gate=layout.output_gate,
        rope_dim=rope_dim,
        # EXAONE-MoE: with sliding layers, the full-attention ones rotate nothing (names cannot tell: a variant)
        nope_layers=sorted(nope),
        attention_sinks=layout.sinks,
        **({"attn_scale": c.req("attention_multiplier", float)} if "attention_multiplier" in c.data else {}),
    )


def derive(hf: dict, layout: Layout, variant: dict) -> Bridge:
    """The bridge for a family with tensors laid out as ``layout``, in behaviour ``variant`` (``hf``: its config,
    for the names)."""

    def config_from_hf(c: HFConfig) -> ModelConfig:
        _known(c.data)
        n = c.req("num_hidden_layers", int)
        use = c.opt("use_sliding_window", bool)
        if use and not c.opt("layer_types", list):
            raise UnknownArchitectureError(f"{c.source}: use_sliding_window without layer_types: not derivable")
        if "sliding_window_pattern" in c.data and not c.opt("layer_types", list):
            raise UnknownArchitectureError(f"{c.source}: sliding_window_pattern without layer_types: not derivable")
        # a window with neither switch nor layer types slides on every layer (Mixtral's convention)
        types, window = layer_types(c, n, all_sliding=use is None, linear=layout.linear is not None)
        c = _one_rope(c, types)
        f = common_fields(c)
        f["tie_word_embeddings"] = layout.tied
        moe_size = c.first(SYNONYMS["moe_intermediate_size"] + ("intermediate_size",), int)
        shared = 0
        if layout.shared is not None:  # its own size, else n shared experts' worth, else one expert's
            count = next((c.req(k, int) for k in SYNONYMS["n_shared_experts"] if c.data.get(k) is not None), 1)
            own = next((c.req(k, int) for k in SYNONYMS["shared_size"] if c.data.get(k)), 0)
            shared = own or moe_size * count
        moe = moe_layers(c, n)
        hidden = f["hidden_size"]
        return ModelConfig(
            **f,
            intermediate_size=c.opt("intermediate_size", int, 0) if len(moe) < n else 0,
            num_experts=c.first(SYNONYMS["num_experts"], int),
            top_k=c.first(SYNONYMS["top_k"], int),
            moe_intermediate_size=moe_size,
            moe_layers=moe,
            layer_types=types,
            sliding_window=window,
            norm="layer" if layout.layer_norm else "rms",
            norm_placement="post" if layout.post_norm else "pre",
            lm_head_bias=layout.lm_head_bias,
            router_bias=layout.router_bias,
            shared_expert_size=shared,
            shared_expert_gate=layout.shared_gate,
            embedding_multiplier=hidden**0.5 if c.opt("mup_enabled", bool) else c.opt(MUP[1], float, 1.0),
            residual_multiplier=c.opt("residual_multiplier", float, 1.0),
            logits_scaling=c.opt("logits_scaling", float, 1.0),
            **_attention(c, f, layout, variant, types),
            **_routing(c, layout, variant),
            **(linear_attention_fields(c) if layout.linear is not None else {}),
        )

    hf_block = f"model.layers.{{i}}.{layout.block}"
    rules = [Rule(f"{hf_block}.{layout.router}.weight", "layers.{i}.mlp.router.weight")]
    if layout.router_bias:
        rules.append(Rule(f"{hf_block}.{layout.router}.bias", "layers.{i}.mlp.router.bias"))
    if layout.correction_bias is not None:
        rules.append(Rule(layout.correction_bias, "layers.{i}.mlp.router.e_score_correction_bias"))
    if layout.experts is not None:
        gate, up, down = layout.experts
        hf_e = f"{hf_block}.experts.{{e}}"
        rules += [
            Rule(f"{hf_e}.{gate}.weight", "layers.{i}.mlp.experts.gate_up_proj", part="gate"),
            Rule(f"{hf_e}.{up}.weight", "layers.{i}.mlp.experts.gate_up_proj", part="up"),
            Rule(f"{hf_e}.{down}.weight", "layers.{i}.mlp.experts.down_proj"),
        ]
    elif layout.fused_experts == "linear":  # GraniteMoe's [E, 2I, H] (gate rows first) and [E, H, I]
        rules += [
            Rule(f"{hf_block}.input_linear.weight", "layers.{i}.mlp.experts.gate_up_proj"),
            Rule(f"{hf_block}.output_linear.weight", "layers.{i}.mlp.experts.down_proj"),
        ]
    elif layout.block != "mlp":
        rules.append(Rule(f"{hf_block}.experts.{{x}}", "layers.{i}.mlp.experts.{x}"))
    fused: tuple[Fused, ...] = ()
    if layout.shared is not None:
        hf_shared = f"model.layers.{{i}}.{layout.shared}" if layout.shared_at_layer else f"{hf_block}.{layout.shared}"
        ours = "layers.{i}.mlp.shared_experts"
        if layout.shared_fused:  # one [2I, H] input projection: gate rows, then up rows
            rules.append(Rule(f"{hf_shared}.output_linear.weight", f"{ours}.down_proj.weight"))
            fused += (
                Fused(
                    f"{hf_shared}.input_linear.weight",
                    (f"{hf_shared}.gate_proj.weight", f"{hf_shared}.up_proj.weight"),
                    split=lambda t, cfg: list(t.chunk(2)),
                    join=lambda parts, cfg: torch.cat(parts),
                ),
            )
        rules.append(Rule(f"{hf_shared}.{{x}}", f"{ours}.{{x}}"))
    offset = {"load": plus_one, "save": minus_one} if variant.get("norm_offset") else {}
    if layout.qk_norm_names != ("q_norm", "k_norm") or offset:
        for theirs, ours in zip(layout.qk_norm_names, ("q_norm", "k_norm"), strict=True):
            rules.append(
                Rule(f"model.layers.{{i}}.self_attn.{theirs}.weight", f"layers.{{i}}.self_attn.{ours}.weight", **offset)
            )
    if offset:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            rules.append(Rule(f"model.layers.{{i}}.{norm}.weight", f"layers.{{i}}.{norm}.weight", **offset))
        rules.append(Rule("model.norm.weight", "norm.weight", **offset))
    if layout.linear is not None:
        from moerl.bridges.qwen3_next import FUSED

        rules += LINEAR_ATTENTION_RULES
        fused += FUSED if layout.linear == "fused" else ()
    if layout.shared_gate:
        rules.append(Rule(f"{hf_block}.shared_expert_gate.weight", "layers.{i}.mlp.shared_experts_gate.weight"))
    return Bridge(
        architectures=(_arch(hf),),
        model_type=str(hf.get("model_type", "?")),
        config_from_hf=config_from_hf,
        preset_config=_no_preset,
        rules=tuple(rules),
        fused=fused,
        ignore=mtp_layer,
    )


def _no_preset(p: Preset, bos: int, eos: int, pad: int) -> dict:
    raise UnknownArchitectureError("a derived bridge writes no preset configs (init-model needs a bridge file)")


SHRINK = {
    "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 256,
}  # fmt: skip


def tiny_config(hf: dict) -> dict:
    """``hf`` at test size: the same switches, small dimensions, 8 experts (top-2 at most), up to 4 layers."""
    small = dict(hf)
    for key, value in SHRINK.items():
        if key in small and small[key] is not None:
            small[key] = min(small[key], value) if key != "head_dim" else value
    heads, kv = hf.get("num_attention_heads", 4), hf.get("num_key_value_heads") or hf.get("num_attention_heads", 4)
    small["num_key_value_heads"] = 4 if kv == heads else 2
    for key in SYNONYMS["num_experts"]:
        if key in small:
            small[key] = 8
    for key in SYNONYMS["top_k"]:
        if key in small:
            small[key] = min(small[key], 2)
    n = hf.get("num_hidden_layers", 2)
    keep = max([2, hf.get("first_k_dense_replace", 0) + 1, *[i + 1 for i in hf.get("mlp_only_layers") or []]])
    kinds = []
    for key in ("layer_types", "mlp_layer_types"):
        listed = hf.get(key) if isinstance(hf.get(key), list) else []
        keep = max([keep, *(listed.index(k) + 1 for k in set(listed))])  # a layer of every kind
        kinds += listed
    small["num_hidden_layers"] = min(n, max(keep, 2), max(4, keep if kinds else 4))
    for key in ("layer_types", "mlp_layer_types", "layer_rope_theta"):
        if isinstance(small.get(key), list):
            small[key] = small[key][: small["num_hidden_layers"]]
    if small.get("sliding_window"):
        small["sliding_window"] = min(small["sliding_window"], 8)
    # linear-attention layers: 2 key heads, twice as many value heads if it has more
    if "linear_num_key_heads" in small:
        more = (hf.get("linear_num_value_heads") or 0) > (hf.get("linear_num_key_heads") or 0)
        small |= {"linear_num_key_heads": 2, "linear_num_value_heads": 4 if more else 2}
        small |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    if (small.get("n_group") or 1) > 1:  # group-limited routing: 4 groups of 2 of the 8 experts, 2 groups chosen
        small |= {"n_group": 4, "topk_group": 2}
    if small.get("kv_lora_rank"):  # latent attention: small ranks, the rotary part transformers reads as head_dim
        small |= {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
        small |= {"head_dim": 8} | ({"qk_head_dim": 24} if "qk_head_dim" in small else {})
        if small.get("q_lora_rank"):
            small["q_lora_rank"] = 32
    for key, default in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(small.get(key), int) and small[key] >= small.get("vocab_size", 128):
            small[key] = default
    return small


def hf_forward(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    """A transformers model's logits, each MoE layer's chosen experts [N, k] (read off its routers, modules whose
    class name ends in Router or Gate, as the one integer tensor of their output) and its per-layer hidden states."""
    choices, hooks = [], []

    def record(module, args, out):
        ints = [t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if len(ints) != 1:
            raise UnknownArchitectureError(f"{type(module).__name__} returned {len(ints)} integer tensors, not 1")
        choices.append(ints[0].detach())

    for module in model.modules():
        name = type(module).__name__.lower()
        if name.endswith("router") or name.endswith("gate"):
            hooks.append(module.register_forward_hook(record))
    if not hooks:
        raise UnknownArchitectureError(f"no router found in {type(model).__name__} (no module class *Router or *Gate)")
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out.logits, choices, out.hidden_states


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """A layer's output within TOL of transformers', relative to the output's magnitude when that exceeds 1."""
    return float((ours - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max()))


def _first_difference(model, bridge_hidden, ref_hidden, ours_routed, ref_choices) -> str:
    for i, (a, b) in enumerate(zip(bridge_hidden, ref_hidden[1:], strict=False)):
        if not _close(a, b):
            return f"layer {i} output differs by {float((a - b).abs().max()):.2e}"
    for j, ref in enumerate(ref_choices):
        ours = ours_routed[:, :, j].reshape(-1, ours_routed.shape[-1])
        if not torch.equal(ours.sort(-1).values, ref.sort(-1).values):
            return f"MoE layer {j} (model layer {model.moe_layer_ids[j]}) chose other experts"
    return "the logits differ"


SHARP = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight")


def prove(hf: dict) -> tuple[Bridge, dict, Layout]:
    """Derive the bridge for config ``hf`` and prove it on a tiny transformers instance; returns (bridge, variant,
    layout) or raises UnknownArchitectureError naming what could not be derived or where the proof failed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moerl.bridges.checkpoint import load_model

    _known(hf)
    small = tiny_config(hf)
    fields = {k: v for k, v in small.items() if k not in ("architectures", "model_type", "transformers_version")}
    try:
        config = AutoConfig.for_model(small.get("model_type"), **fields)
    except (ValueError, KeyError) as e:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: transformers does not know it ({e})"
        ) from None
    except Exception as e:  # noqa: BLE001 - transformers' own check of a value moerl does not read itself
        first = " ".join(str(e).split())[:300]
        raise ConfigError(f"config.json: transformers refuses it for {_arch(hf)}: {first}") from None
    config.architectures = [_arch(hf)]
    torch.manual_seed(0)
    try:
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 - a value transformers' model cannot be built with
        first = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"config.json: transformers cannot build {_arch(hf)} from it: {type(e).__name__}: {first}"
        ) from None
    if type(ref).__name__ != _arch(hf):
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: model_type {small.get('model_type')!r} builds "
            f"{type(ref).__name__} in transformers, not the architecture config.json names"
        )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # q and k sharper than the rest: attention far from uniform, so where RoPE goes (or not) shows
            scale = (0.16 if name.endswith(SHARP) else 0.02) if p.ndim >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
        saved = set(ref.state_dict())  # every buffer the checkpoint holds (a selection bias): make it matter too
        for name, b in ref.named_buffers():
            if name in saved and b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
    ids = torch.randint(0, small.get("vocab_size", 128), (2, 16), generator=gen)
    try:
        logits, choices, hidden = hf_forward(ref, ids)
    except UnknownArchitectureError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own model fails on this config at test size
        first = " ".join(str(e).split())[:300]
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: transformers' model fails on its tiny instance: "
            f"{type(e).__name__}: {first}"
        ) from None
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        saved = json.loads((Path(tmp) / "config.json").read_text())
        from safetensors import safe_open

        shapes = {}
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(f, "pt") as handle:
                shapes |= {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}
        features = {f for n in shapes for key, f in TENSOR_FEATURES.items() if f".{key}." in n}
        if features:
            raise UnknownArchitectureError(
                f"cannot derive a bridge for {_arch(hf)}: its tensors show {'; '.join(sorted(features))}, which "
                "moerl's decoder does not compute"
            )
        try:
            layout = read_layout(shapes)
        except UnknownArchitectureError as e:
            raise UnknownArchitectureError(f"cannot derive a bridge for {_arch(hf)}: {e}") from None
        by_config = moe_layers(HFConfig(saved, "the tiny config"), saved["num_hidden_layers"])
        if tuple(by_config) != layout.moe_layers:
            raise UnknownArchitectureError(
                f"cannot derive a bridge for {_arch(hf)}: its config's layer pattern gives MoE layers {by_config}, "
                f"its tensors show {list(layout.moe_layers)}"
            )
        for variant in variants(saved, layout):
            bridge = derive(saved, layout, variant)
            try:
                model = load_model(tmp, torch.float32, bridge=bridge)
            except Exception as e:  # noqa: BLE001 - a tensor it cannot place, a knob it cannot build: the reason
                why = str(e).removeprefix(f"cannot derive a bridge for {_arch(hf)}: ")
                raise UnknownArchitectureError(f"cannot derive a bridge for {_arch(hf)}: {why}") from None
            ours_hidden = []
            hooks = [
                layer.register_forward_hook(lambda m, a, out: ours_hidden.append(out[0])) for layer in model.layers
            ]
            with torch.no_grad():
                out = model(ids, capture=True)
            for h in hooks:
                h.remove()
            routed_ok = len(choices) == len(model.moe_layer_ids) and all(
                torch.equal(out.routed[:, :, j].reshape(-1, model.config.top_k).sort(-1).values, c.sort(-1).values)
                for j, c in enumerate(choices)
            )
            # every layer but the last (transformers hands that one back normed) within TOL of its own scale:
            # logits alone can hide a wrong variant (GraniteMoe's logits_scaling shrinks them below TOL)
            layers_ok = all(_close(a, b) for a, b in zip(ours_hidden[:-1], hidden[1:-1], strict=False))
            if float((out.logits - logits).abs().max()) <= TOL and routed_ok and layers_ok:
                return derive(hf, layout, variant), variant, layout
            failures.append(_first_difference(model, ours_hidden, hidden, out.routed, choices))
    raise UnknownArchitectureError(
        f"cannot derive a bridge for {_arch(hf)}: no variant matches transformers at fp32 {TOL} "
        f"(first difference: {failures[0]})"
    )


@lru_cache(maxsize=16)
def _proven(key: str) -> Bridge:
    return prove(json.loads(key))[0]


def derived_bridge(hf: dict) -> Bridge:
    """The proven derived bridge for config ``hf`` (once per process and config)."""
    return _proven(json.dumps(hf, sort_keys=True))


def bridge_source(hf: dict, variant: dict, layout: Layout) -> str:
    """The derived bridge as a Python file that registers it (what ``moerl check-arch`` prints)."""
    arch = _arch(hf)
    return f'''"""{arch}: derived by `moerl check-arch` and proven against transformers at fp32 {TOL}."""

from moerl.bridges.derived import Layout, derive
from moerl.bridges.registry import register

LAYOUT = {layout!r}
VARIANT = {variant!r}
CONFIG = {json.dumps({k: v for k, v in hf.items() if k in ("architectures", "model_type")})}

BRIDGE = register(derive(CONFIG, LAYOUT, VARIANT))
'''
