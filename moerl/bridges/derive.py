"""Zero-code bridges, derived: a checkpoint whose architecture has no bridge file gets one derived from its config
(``moerl.bridges.prove`` proves it against transformers before it is used).

Config fields come from the synonyms Llama-style MoE families use (``SYNONYMS``); everything else that shapes the
model from the tensor names of a tiny random instance of the same config built with transformers (router under
``gate`` / ``router``, per-expert or fused experts, shared experts and their gate, q/k norms per head or per
projection, biases, LayerNorm, post-sublayer norms, which layers are MoE). A config field the derivation neither
reads nor knows to be inert (``INERT``) is refused by name, as is any tensor no rule places. Behaviour names cannot
show is a ``variant`` the proof tries in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from functools import partial

import torch

from moerl.bridges.base import (
    LINEAR_ATTENTION_RULES,
    LINEAR_FIELDS,
    MAMBA_RULES,
    Bridge,
    Fused,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    layer_types,
    linear_attention_fields,
    mamba_fields,
    minus_one,
    model_name,
    mtp_layer,
    partial_rope_dim,
    plus_one,
    sparse_layers,
)
from moerl.bridges.shared import FUSED, mla_fields
from moerl.errors import ConfigError, UnknownArchitectureError
from moerl.model.config import ModelConfig

TOL = 1e-4
SYNONYMS = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk", "top_k_experts"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "n_shared_experts": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    "shared_size": (
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "moe_shared_expert_intermediate_size",
    ),
    "routed_scaling_factor": (
        "routed_scaling_factor",
        "router_scaling_factor",
        "moe_routed_scaling_factor",
        "route_scale",
    ),  # fmt: skip
    "router_softcap": ("moe_router_logit_softcapping", "router_logit_softcapping"),
}
MUP = ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")  # GraniteMoe's
MLA = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim")
INDEX = ("index_topk", "index_n_heads", "index_head_dim")
NEMOTRON = (
    "layers_block_type", "hybrid_override_pattern", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
    "conv_kernel", "expand", "use_conv_bias", "chunk_size", "layer_norm_epsilon", "mlp_hidden_act", "mamba_hidden_act",
    "moe_latent_size", "residual_in_fp32", "mtp_layers_block_type", "time_step_min",
)  # fmt: skip
PERIODS = ("attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset")  # Jamba's
MAMBA = ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_chunk_size")
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
    # DeepSeek sparse attention (its indexer: moerl.model.indexer)
    *INDEX, "indexer_types",
    # Mamba-2 layers (moerl.model.mamba) under Granite-4.0-H's names; attention without RoPE where it says so
    *MAMBA, "mamba_d_head", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit", "position_embedding_type",
    # Mamba-1 layers (moerl.model.mamba1) and the layer pattern under Jamba's names
    "mamba_dt_rank", *PERIODS,
    # Nemotron-H: layers of one block each (their kinds), Mamba-2 and its un-gated relu2 MLPs under its names
    *NEMOTRON,
    "zero_expert_num",  # zero-computation experts (ModelConfig.zero_experts)
    # Laguna: a head count per layer, its output gate's activation and granularity, router weights on the output
    "num_attention_heads_per_layer", "gating", "moe_apply_router_weight_on_input",
    # Cohere2-MoE: the logits' scale, the router's rule, the shared experts' share, its dense layers' size and
    # RoPE, LayerNorm (without bias) where rms_norm_eps is null
    "logit_scale", "expert_selection_fn", "shared_expert_combination_strategy", "prefix_dense_intermediate_size",
    "prefix_dense_sliding_window_pattern", "layer_norm_eps",
    # MiMo-V2-Flash: its values scaled (its value heads' own size: v_head_dim, with the latent-attention fields)
    "attention_value_scale",
    # Llama 4: chunked layers, NoPE layers (with temperature tuning), its dense layers' size, its MoE layers
    "attention_chunk_size", "no_rope_layers", "no_rope_layer_interval", "attn_temperature_tuning", "floor_scale",
    "attn_scale", "intermediate_size_mlp", "moe_layers", "interleave_moe_layer_step",
    # Gemma 4: GELU-tanh, capped logits, full layers whose values are their keys and their own head size and KV heads,
    # the MoE beside the MLP; per-layer embeddings, KV-shared layers and bidirectional attention (refused where on)
    "hidden_activation", "final_logit_softcapping", "attention_k_eq_v", "per_layer_config", "enable_moe_block",
    "hidden_size_per_layer_input", "vocab_size_per_layer_input", "num_kv_shared_layers", "use_double_wide_mlp",
    "use_bidirectional_attention", "global_head_dim", "num_global_key_value_heads",
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
    # which implementation of the same scan transformers runs (Jamba's kernels, mambapy, an associative scan)
    "use_mamba_kernels", "use_mambapy", "use_associative_scan",
    # Nemotron-H: the step's initialisation (time_step_max / _floor), dropout and init rescaling in training, the
    # shared experts overlapped with the routed ones (a schedule), the logits a generate keeps, the precision of
    # transformers' state cache (moerl keeps states in fp32)
    "time_step_max", "time_step_floor", "hidden_dropout", "rescale_prenorm_residual", "moe_shared_expert_overlap",
    "num_logits_to_keep", "mamba_ssm_cache_dtype",
}  # fmt: skip
# config fields that say the family needs a feature moerl's decoder does not compute: the refusal names it
FEATURES = {
    **dict.fromkeys(("linear_num_heads", "linear_head_dim"), "linear-attention layers other than Gated DeltaNet (KDA)"),
    **dict.fromkeys(("block_size", "linear_attn_alpha_factor"), "lightning linear-attention layers"),
    **dict.fromkeys(("conv_L_cache", "conv_bias"), "short-convolution layers"),
    **dict.fromkeys(
        ("hc_mult", "hc_eps", "hc_magnitude", "hc_count", "hc_lowrank"), "hyper-connections (several residual streams)"
    ),
    **dict.fromkeys(
        ("index_block_size", "index_topk_blocks", "index_local_blocks"),
        "block-sparse attention (MiniMax-M3's indexer choosing blocks of keys per KV group)",
    ),
    **dict.fromkeys(("cca_time0", "cca_time1"), "compressed convolutional attention"),
}
# tensor names (under a layer) that say the same
TENSOR_FEATURES = {}
# config fields of a family whose layers moerl builds through a bridge file, not by derivation: the architecture
BRIDGE_FILE_FIELDS = dict.fromkeys(("ffn_hidden_size", "expert_ffn_hidden_size"), "LongcatFlashForCausalLM")
BRIDGE_FILE_FIELDS["kv_channels"] = "JetMoeForCausalLM"  # its mixture of attention heads


# behaviour tensor names cannot show, tried in this order where the layout leaves it open: softmax before or after
# the top-k, per-head q/k norms before or after the rotation, RMSNorms that scale by 1 + w (Qwen3.5's), the top-k
# renormalised when no field says (HY-V3 always does), full-attention layers without RoPE beside sliding ones (EXAONE)
def variants(hf: dict, layout: Layout) -> list[dict]:
    """The behaviour variants worth trying for config ``hf`` with tensors laid out as ``layout``, in order."""
    softmax = layout.correction_bias is None and hf.get("scoring_func", "softmax") == "softmax"
    groups = hf.get("mamba_n_groups") or hf.get("n_groups") or 1  # Mamba-2's B / C groups (Granite's, Nemotron's)
    kinds = set(hf.get("layer_types") or [])
    top_k = next((hf[k] for k in SYNONYMS["top_k"] if hf.get(k) is not None), None)
    gemma = layout.sandwich == "feedforward"  # Gemma's names: its embedding scale and (Gemma 4) its values unscaled
    open_ = dict(
        # embeddings times sqrt(hidden_size) (Gemma's, no field says)
        embed_sqrt=(False, True) if gemma and not {"mup_enabled", MUP[1]} & set(hf) else (False,),
        # values normed to unit RMS, scores not scaled (Gemma 4's: its q / k norms scale them)
        unit_values=(False, True)
        if gemma and layout.qk_norm == "head" and "query_pre_attn_scalar" not in hf
        else (False,),
        # sigmoid scores scaling the one chosen expert's input (Llama 4's) where no field names the scoring: tried
        # after every softmax variant
        router_on_input=(False, True) if softmax and top_k == 1 and "scoring_func" not in hf else (False,),
        norm_offset=(False, True),
        norm_topk=(False, True) if "norm_topk_prob" not in hf else (False,),
        nope_full=(False, True) if {"full_attention", "sliding_attention"} <= kinds else (False,),
        # GQA's rotary pairs interleaved (Cohere's) where no field says
        gqa_interleave=(False, True) if layout.attention == "gqa" and "rope_interleave" not in hf else (False,),
        topk_before_softmax=(False, True) if softmax else (False,),
        qk_norm_after_rope=(False, True) if layout.qk_norm == "head" else (False,),
        # latent attention's rotary pairs where no field says (DeepSeek-V3.2 interleaves them in code)
        mla_interleave=(False, True) if layout.attention == "mla" and "rope_interleave" not in hf else (False,),
        # the indexer's rotary pairs: split in halves (DeepSeek-V3.2) or interleaved (GLM-5)
        index_interleave=(False, True) if layout.indexer else (False,),
        # a Mamba hybrid's attention without RoPE where no field says (Jamba's has none)
        nope_attention=(False, True) if layout.mamba and "position_embedding_type" not in hf else (False,),
        # Mamba-2's gated norm over all channels (Granite-4.0-H) or per B/C group (Nemotron-H)
        mamba_norm_groups=(1, groups) if layout.mamba == "mamba" and groups > 1 else (1,),
    )
    out = [dict(zip(open_, values, strict=True)) for values in itertools.product(*open_.values())]
    # the k-softmax sums to 1 anyway; norms after the rotation would see interleaved pairs reordered (not built)
    return [
        v
        for v in out
        if not (v["topk_before_softmax"] and v["norm_topk"])
        and not (v["qk_norm_after_rope"] and v["gqa_interleave"])
        and not (v["router_on_input"] and (v["topk_before_softmax"] or v["norm_topk"]))
    ]


# what the derived path reads as sizes and switches: checked for type and range before transformers sees them
COUNTED = ("num_experts", "top_k", "moe_intermediate_size")
COUNTS = {  # ints >= 1 (null: absent)
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "intermediate_size", "sliding_window", "max_window_layers", "decoder_sparse_step",
    "moe_layer_freq", "moe_layer_interval", *(n for k, names in SYNONYMS.items() for n in names if k in COUNTED),
    *LINEAR_FIELDS, "linear_conv_kernel_dim", "full_attention_interval", "n_group", "topk_group", *MLA, *INDEX,
    "rotary_dim", *MAMBA, "attn_layer_period", "expert_layer_period", "ssm_state_size", "mamba_num_heads",
    "mamba_head_dim", "n_groups", "conv_kernel", "expand", "chunk_size",
    "sliding_window_pattern", "global_attn_every_n_layers", "attention_chunk_size", "floor_scale",
    "intermediate_size_mlp", "interleave_moe_layer_step", "no_rope_layer_interval", "global_head_dim",
    "num_global_key_value_heads",
}  # fmt: skip
NOT_NULL = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", *SYNONYMS["top_k"]}
INDICES = {  # ints >= 0
    "first_k_dense_replace", "moe_layer_start_index", "moe_layer_end_index", "num_nextn_predict_layers",
    "num_dense_layers", *SYNONYMS["n_shared_experts"], *SYNONYMS["shared_size"], "attn_layer_offset",
    "expert_layer_offset", "zero_expert_num", "hidden_size_per_layer_input", "num_kv_shared_layers",
}  # fmt: skip
SWITCHES = {
    "tie_word_embeddings", "norm_topk_prob", "attention_bias", "use_sliding_window", "qkv_bias", "mlp_bias",
    "use_qk_norm", "rope_interleave", "enable_moe_fp32_combine", "mup_enabled", "mamba_conv_bias", "mamba_proj_bias",
    "use_conv_bias", "use_bias", "residual_in_fp32", "attn_temperature_tuning", "moe_apply_router_weight_on_input",
    "attention_k_eq_v", "enable_moe_block", "use_double_wide_mlp",
}  # fmt: skip
POSITIVE = {  # numbers > 0
    "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "clip_qkv", "partial_rotary_factor", *MUP, "attn_scale",
    "final_logit_softcapping",
    *SYNONYMS["routed_scaling_factor"],
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
    for what in ("attn", "expert"):  # Jamba's layer patterns: an offset within its period
        period, offset = hf.get(f"{what}_layer_period"), hf.get(f"{what}_layer_offset")
        if period is not None and offset is not None and offset >= period:
            raise ConfigError(
                f"config.json: field '{what}_layer_offset' ({offset}) must be below '{what}_layer_period' ({period})"
            )
    rank = hf.get("mamba_dt_rank")
    if rank is not None and rank != "auto" and not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ConfigError(f"config.json: field 'mamba_dt_rank' must be an int >= 1 or \"auto\", got {rank!r}")


def check_known(hf: dict) -> None:
    """Refuse ``hf`` naming what moerl's decoder does not compute (before its fields' types: a feature that is missing
    says more than a value of a field about it), then any field of the wrong type or range, then any field not
    understood."""
    synonyms = {name for names in SYNONYMS.values() for name in names}
    unknown = sorted(set(hf) - READ - INERT - synonyms)
    bridged = sorted({BRIDGE_FILE_FIELDS[k] for k in unknown if k in BRIDGE_FILE_FIELDS})
    if bridged:
        from moerl.bridges.registry import FAMILIES

        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: its layers are {bridged[0]}'s (config field(s) "
            f"{', '.join(repr(k) for k in unknown if k in BRIDGE_FILE_FIELDS)}), which moerl builds through that "
            f"architecture's bridge file (moerl.bridges.{FAMILIES[bridged[0]]}), not by derivation"
        )
    features = list(dict.fromkeys(FEATURES[k] for k in unknown if k in FEATURES))
    if features:
        named = [k for k in unknown if k in FEATURES]
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: it has {'; '.join(features)} (config field(s) "
            f"{', '.join(map(repr, named))}), which moerl's decoder does not compute"
        )
    kinds = hf.get("mlp_layer_types")
    if isinstance(kinds, list) and "hash_moe" in kinds:  # DeepSeek-V4's
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: it has hash-routed MoE layers (mlp_layer_types 'hash_moe', "
            f"layer {kinds.index('hash_moe')}), which moerl's decoder does not compute"
        )
    _typed(hf)
    if unknown:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: config field(s) {', '.join(map(repr, unknown))} are not "
            "understood (a bridge file can map them; see moerl/bridges/README.md)"
        )
    for key in ("hidden_act", "hidden_activation"):
        if hf.get(key, "silu") not in ACTIVATIONS:
            raise UnknownArchitectureError(f"cannot derive a bridge for {arch_name(hf)}: {key}={hf[key]!r}")
    # switches with one value built: Nemotron-H's MLPs un-gated relu2, its Mamba's conv SiLU, the experts' width
    for key, built, feature in (
        ("mlp_hidden_act", "relu2", "un-gated MLPs with another activation"),
        ("mamba_hidden_act", "silu", "a Mamba conv activation other than SiLU"),
        ("moe_latent_size", None, "latent expert projections (the experts in a smaller width)"),
        ("residual_in_fp32", False, "a residual stream kept in fp32 whatever the compute dtype"),
        ("hidden_size_per_layer_input", 0, "per-layer embeddings"),  # Gemma 4's small dense models'
        ("num_kv_shared_layers", 0, "layers that reuse an earlier layer's keys and values"),
        ("use_double_wide_mlp", False, "KV-shared layers' MLPs of twice the size"),
        ("use_bidirectional_attention", None, "bidirectional attention"),
    ):
        if hf.get(key, built) != built:
            raise UnknownArchitectureError(
                f"cannot derive a bridge for {arch_name(hf)}: it has {feature} ({key}={hf[key]!r}), which moerl's "
                "decoder does not compute"
            )


# the MLPs' and experts' activation, as transformers names it -> ModelConfig.activation
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def arch_name(hf: dict) -> str:
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
    gate_proj: str | None = None  # an output gate's own projection under self_attn: "gate_proj" | "g_proj" (Laguna)
    gate_kind: str = "none"  # its gates: "element" (as many as o_proj's inputs) | "head" (one per head)
    attention: str = "gqa"  # "mla": multi-head latent attention (q_a_proj / kv_a_proj_with_mqa / kv_b_proj)
    correction_bias: str | None = None  # the router's selection-only bias (DeepSeek-V3's), as the checkpoint names it
    fused_experts: str = "experts"  # 3D experts as experts.{gate_up_proj, down_proj} | "linear": {input, output}_linear
    shared_at_layer: bool = False  # the shared MLP sits beside the MoE block (model.layers.{i}.shared_mlp)
    shared_fused: bool = False  # the shared MLP as input_linear (gate rows, then up rows) and output_linear
    # a learned sink logit per head, as the checkpoint names it: "sinks" (GPT-OSS's) | "attention_sink_bias" (MiMo's)
    sinks: str | None = None
    sink_layers: tuple[int, ...] = ()  # the layers that hold them
    sinks_sliding_only: bool = False  # held by the sliding layers alone (MiMo-V2-Flash's): ``by_kind``
    k_rows: tuple[int, ...] = ()  # each attention layer's k_proj rows (0: a layer without one)
    sliding_kv_factor: int = 1  # the sliding layers' KV heads over the full ones' (MiMo-V2-Flash: 2): ``by_kind``
    own_values: bool = False  # value heads of their own size (v_proj's rows are not k_proj's)
    indexer: bool = False  # DeepSeek sparse attention's indexer (self_attn.indexer.*) in the latent attention
    mamba: str | None = None  # the Mamba layers' kind: "mamba" (Mamba-2: mamba.in_proj, ...) | "mamba1" (mamba.x_proj)
    norms: tuple[str, str, str] = ("input_layernorm", "post_attention_layernorm", "norm")  # Jamba: pre_ff_, final_
    one_block: bool = False  # Nemotron-H: a layer is one block under ``mixer`` (attention, Mamba, MLP or MoE), one norm
    # sandwich norms, before and after each sublayer: the MLP's pair as AFMoE names it ("mlp": pre_mlp_layernorm /
    # post_mlp_layernorm) or Gemma ("feedforward": pre_feedforward_layernorm / post_feedforward_layernorm)
    sandwich: str | None = None
    parallel: bool = False  # one norm a layer, attention and MLP both of its output (Cohere's parallel block)
    moe_output_norm: bool = False  # a norm after the MoE block alone (A.X-K1's post_mlp_layernorm, no pre_ one)
    experts_transposed: bool = False  # 3D experts as [E, H, 2I] and [E, I, H] (Llama 4's), moerl's transposed
    layer_scalar: bool = False  # a scalar per layer times its output (Gemma 4's layer_scalar)
    # the router and experts at the layer itself beside its MLP (Gemma 4's: block ""), the router's own input scale
    # (router.scale) and scale per expert (router.per_expert_scale)
    router_input_scale: bool = False
    router_expert_scale: bool = False


# a tensor each kind alone has, in order (Nemotron-H's Mamba-2 under ``mixer``)
MAMBA_KINDS = (("mamba1", ".mamba.x_proj."), ("mamba", ".mamba.in_proj."), ("mamba", ".mixer.in_proj."))


def read_layout(shapes: dict[str, tuple[int, ...]]) -> Layout:
    """The layout the tensor names ``shapes`` (name -> shape) show (names no rule then places are refused by the
    loader, by name). Nemotron-H's checkpoints keep the decoder under ``backbone.``: read as ``model.``."""
    shapes = {model_name(n): s for n, s in shapes.items()}
    patterns = {_pattern(n) for n in shapes}
    # the router under the MoE block's name, or (Gemma 4's, beside the MLP) at the layer itself
    router_re = (
        r"model\.layers\.(\d+|\{i\})\.(?:(mlp|block_sparse_moe|feed_forward|mixer)\.)?"
        r"((?:gate|router)(?:\.wg|\.layer|\.gate|\.proj)?)\.weight"
    )
    moe = sorted({int(m.group(1)) for n in shapes if (m := re.fullmatch(router_re, n))})
    found = [m for p in patterns if (m := re.fullmatch(router_re, p))]
    if not found:
        raise UnknownArchitectureError("no router tensor (model.layers.{i}.mlp.gate.weight, .router.weight, ...)")
    block, router = found[0].group(2) or "", found[0].group(3)
    one_block = block == "mixer"
    per_expert = {p.split(".experts.{e}.")[1].removesuffix(".weight") for p in patterns if ".experts.{e}." in p}
    experts = None
    if per_expert:
        if one_block and per_expert == {"up_proj", "down_proj"}:  # un-gated experts (Nemotron-H's)
            experts = ("", "up_proj", "down_proj")
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
    # under the block, its router or (Laguna's) its experts
    bias_re = (
        rf"model\.layers\.\{{i\}}\.{block}\.(?:{re.escape(router)}\.|experts\.)?(?:e_score_correction_bias|expert_bias)"
    )
    correction_bias = next((p for p in sorted(patterns) if re.fullmatch(bias_re, p)), None)
    linear = next(
        (
            kind
            for kind, proj in (("split", "in_proj_qkv"), ("fused", "in_proj_qkvz"))
            if any(f"linear_attn.{proj}." in p for p in patterns)
        ),
        None,
    )
    if one_block:  # the attention's tensors under ``mixer``: read as the other families' ``self_attn``
        renamed = {n.replace(".mixer.", ".self_attn."): s for n, s in shapes.items()}
        attention = _attention_layout({_pattern(n) for n in renamed}, renamed)
    else:
        attention = _attention_layout(patterns, shapes)
    sinks = {int(m.group(1)): m.group(2) for n in shapes if (m := re.fullmatch(SINKS_RE, n))}  # layer -> name
    return Layout(
        **attention,
        one_block=one_block,
        block=block,
        router=router,
        experts=experts,
        shared=shared,
        shared_gate=any(p.endswith(f"{block}.shared_expert_gate.weight") for p in patterns),
        moe_layers=tuple(moe),
        router_bias=any(p.endswith(f"{block}.{router}.bias") for p in patterns),
        layer_norm=any(
            p.endswith("input_layernorm.bias") or p.endswith("post_attention_layernorm.bias") for p in patterns
        ),
        post_norm=any("post_feedforward_layernorm" in p for p in patterns)
        and not any("input_layernorm" in p for p in patterns),
        moe_output_norm=any(".post_mlp_layernorm." in p for p in patterns)
        and not any(".pre_mlp_layernorm." in p for p in patterns),
        sandwich=next(
            (
                kind
                for kind in ("mlp", "feedforward")
                if any(f".pre_{kind}_layernorm." in p for p in patterns)
                and any(f".post_{kind}_layernorm." in p for p in patterns)
                and any(".input_layernorm." in p for p in patterns)
            ),
            None,
        ),
        tied="lm_head.weight" not in shapes,
        lm_head_bias="lm_head.bias" in shapes,
        linear=linear,
        mamba=next((k for k, t in MAMBA_KINDS if any(t in p for p in patterns)), None),
        parallel=any(".input_layernorm." in p for p in patterns)
        and not any(
            f".{n}_layernorm." in p for p in patterns for n in ("post_attention", "pre_ff", "post_feedforward")
        ),
        norms=(
            "input_layernorm",
            "pre_ff_layernorm" if any(".pre_ff_layernorm." in p for p in patterns) else "post_attention_layernorm",
            "final_layernorm" if "model.final_layernorm.weight" in shapes else "norm",
        ),
        correction_bias=correction_bias,
        fused_experts="linear" if any(p.endswith(f"{block}.input_linear.weight") for p in patterns) else "experts",
        shared_at_layer=shared_at_layer,
        sinks=next(iter(sinks.values()), None),
        sink_layers=tuple(sorted(sinks)),
        k_rows=_k_rows(shapes),
        shared_fused=shared is not None and any(".shared_mlp.input_linear." in p for p in patterns),
        experts_transposed=_transposed(shapes, block),
        layer_scalar=any(p.endswith(".layer_scalar") for p in patterns),
        router_input_scale=any(p.endswith(f".{router.split('.')[0]}.scale") for p in patterns) and not block,
        router_expert_scale=any(p.endswith(f".{router.split('.')[0]}.per_expert_scale") for p in patterns),
    )


def _transposed(shapes: dict[str, tuple[int, ...]], block: str) -> bool:
    """Whether the 3D experts are stored [E, H, 2I] and [E, I, H] (Llama 4's), not [E, 2I, H] and [E, H, I]: the
    hidden size where the other sits, in whichever of the two tells them apart (2I or I may equal H)."""
    hidden = shapes.get("model.embed_tokens.weight", (0, 0))[1]
    found = [
        s
        for w, at in (("gate_up_proj", 1), ("down_proj", 2))
        for n, s in shapes.items()
        if n.endswith(f"{_under(block)}.experts.{w}") and len(s) == 3 and (s[at] == hidden != s[3 - at])
    ]
    return bool(found)


def _under(block: str) -> str:
    """A layer's MoE tensors' infix: ``.mlp`` and the like, nothing where they sit at the layer (Gemma 4's)."""
    return f".{block}" if block else ""


def _k_rows(shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Each layer's k_proj rows (0 where a layer has none), in layer order."""
    rows = {int(m.group(1)): s[0] for n, s in shapes.items() if (m := re.fullmatch(K_PROJ_RE, n))}
    return tuple(rows.get(i, 0) for i in range(max(rows) + 1)) if rows else ()


K_PROJ_RE = r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight"
SINKS_RE = r"model\.layers\.(\d+)\.self_attn\.(sinks|attention_sink_bias)"


def _attention_layout(patterns: set[str], shapes: dict[str, tuple[int, ...]]) -> dict:
    """The attention fields of a Layout from the tensor names: latent or grouped-query attention, q/k norms (their
    names, per head or over the projection), an output gate folded into q_proj, biases."""
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
    k_name = next((n for n in sorted(shapes) if n.endswith("self_attn.k_proj.weight")), None)
    k_proj = shapes.get(k_name) if k_name else None
    v_proj = shapes.get(k_name.replace("k_proj", "v_proj")) if k_name else None  # the same layer's
    # values of their own size: v_proj's rows are not k_proj's (the same KV heads); else an o_proj taking half of
    # q_proj's rows means q_proj yields a gate beside each head
    own_values = not mla and k_proj is not None and v_proj is not None and k_proj[0] != v_proj[0]
    output_gate = not mla and not own_values and o_proj is not None and q_proj[0] == 2 * o_proj[1]
    qk_norm = "none" if q_norm is None else ("full" if q_norm[0] * (2 if output_gate else 1) == q_proj[0] else "head")
    gate_name = next((g for g in ("gate_proj", "g_proj") if any(f"self_attn.{g}." in p for p in patterns)), None)
    gate = next((shape for n, shape in shapes.items() if n.endswith(f"self_attn.{gate_name}.weight")), None)
    return {
        "own_values": own_values,
        "gate_proj": gate_name,
        "gate_kind": "none" if gate is None else ("element" if o_proj is not None and gate[0] == o_proj[1] else "head"),
        "qk_norm": qk_norm,
        "qk_norm_names": names,
        "qkv_bias": any(p.endswith("self_attn.q_proj.bias") for p in patterns),
        "o_bias": any(p.endswith("self_attn.o_proj.bias") for p in patterns),
        "output_gate": output_gate,
        "attention": "mla" if mla else "gqa",
        "indexer": any(".self_attn.indexer." in p for p in patterns),
    }


def by_kind(layout: Layout, hf_types: list[str]) -> Layout:
    """``layout`` with what its tensors show per layer kind, from its layers' kinds ``hf_types`` (a config's
    ``layer_types``): sinks on every attention layer (GPT-OSS's) or on the sliding ones alone, and the sliding
    layers' KV heads a multiple of the full ones' (MiMo-V2-Flash's, both). Anything else per layer is refused by
    name."""
    sliding = {i for i, t in enumerate(hf_types) if t == "sliding_attention"}
    full = {i for i, t in enumerate(hf_types) if t == "full_attention"}
    rows = {
        kind: {layout.k_rows[i] for i in layers if i < len(layout.k_rows)}
        for kind, layers in (("sliding", sliding), ("full", full))
    }
    if any(len(r) > 1 for r in rows.values()):
        raise UnknownArchitectureError(
            f"KV heads differ between layers of one kind (k_proj rows {sorted(rows['full'] | rows['sliding'])}): "
            "moerl's decoder keeps one count for the full layers and one for the sliding ones"
        )
    factor = 1
    if rows["full"] and rows["sliding"] and rows["full"] != rows["sliding"]:
        (f,), (s,) = rows["full"], rows["sliding"]
        if s % f:
            raise UnknownArchitectureError(
                f"the sliding layers' k_proj rows ({s}) are not a multiple of the full ones' ({f})"
            )
        factor = s // f
    if not layout.sinks:
        return dataclasses.replace(layout, sliding_kv_factor=factor)
    held = set(layout.sink_layers)
    attention = (full | sliding) or held
    if held not in (attention, sliding):
        raise UnknownArchitectureError(
            f"attention sinks on layers {sorted(held)}: moerl's decoder holds them on every attention layer or on the "
            "sliding ones alone"
        )
    return dataclasses.replace(layout, sinks_sliding_only=held != attention, sliding_kv_factor=factor)


def moe_layers(c: HFConfig, n: int) -> list[int]:
    """The MoE layers by the config's pattern fields (every layer when it has none)."""
    d = c.data
    kinds = c.opt("mlp_layer_types", list)
    if kinds is not None:
        if len(kinds) != n:
            raise ConfigError(f"{c.source}: field 'mlp_layer_types' lists {len(kinds)} layers, the model has {n}")
        return [i for i, kind in enumerate(kinds) if kind == "sparse"]
    listed = c.opt("moe_layers", list)  # Llama 4's: the MoE layers by index, else every step-th
    if listed is not None:
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in listed):
            raise ConfigError(f"{c.source}: field 'moe_layers' must list layer indices, got {listed!r}")
        return sorted(i for i in set(listed) if i < n)
    if "interleave_moe_layer_step" in d:
        step = c.req("interleave_moe_layer_step", int)
        return list(range(step - 1, n, step))
    if "expert_layer_period" in d:  # Jamba's: every period-th layer from the offset
        period, offset = c.req("expert_layer_period", int), c.opt("expert_layer_offset", int, 0)
        return [i for i in range(n) if i % period == offset]
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


def _one_rope(c: HFConfig, types: list[str]) -> tuple[HFConfig, dict | None]:
    """``c`` with its RoPE as the full-attention layers use it (``rope_parameters`` keyed by layer kind: MiMo,
    Mellum, Laguna; ``layer_rope_theta``, a theta per layer: GraniteMoeSWA), and the sliding layers' own
    ``rope_parameters`` where they differ (None where they rotate as the full ones). A RoPE that differs between
    layers of one kind is refused by name."""
    kinds = {"full": "full_attention", "sliding": "sliding_attention"}
    thetas = c.opt("layer_rope_theta", list, [])
    per_layer = {}  # kind -> the thetas of its layers that rotate (0: NoPE)
    for t, theta in zip(types, thetas, strict=False):
        if theta:
            per_layer.setdefault(t, set()).add(float(theta))
    if any(len(v) > 1 for v in per_layer.values()):
        raise UnknownArchitectureError(
            f"{c.source}: layer_rope_theta differs between layers of one kind ({sorted(set(thetas))[:4]}): a RoPE "
            "per layer is not computed by moerl's decoder"
        )
    params = dict(c.opt("rope_parameters", dict) or {})
    if per_layer and not all(k in kinds.values() for k in params):
        # a kind whose layers all rotate nothing (theta 0) takes another kind's table, which it never reads
        some = next(iter(per_layer.values()))
        params = {kinds[k]: params | {"rope_theta": next(iter(per_layer.get(k, some)))} for k in kinds if k in types}
    if not params or not all(k in kinds.values() for k in params):
        return c, None
    used = {t: params.get(kinds[t]) for t in dict.fromkeys(types) if t in kinds}
    if not used:
        return c, None
    if any(u is None for u in used.values()):
        missing = [kinds[t] for t, u in used.items() if u is None]
        raise ConfigError(f"{c.source}: field 'rope_parameters' has no entry for the {', '.join(missing)} layers")
    first = used.get("full", used.get("sliding"))
    sliding = used.get("sliding") if "full" in used and used.get("sliding") != first else None
    top = {k: v for k, v in first.items() if k == "partial_rotary_factor"}
    return HFConfig(c.data | top | {"rope_parameters": first}, c.source), sliding


def _routing(c: HFConfig, layout: Layout, variant: dict) -> dict:
    """The router's fields: softmax or sigmoid scores, DeepSeek-V3's selection bias and groups, the scaling."""
    scoring = c.opt("scoring_func", str, "sigmoid" if layout.correction_bias else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise UnknownArchitectureError(f"{c.source}: scoring_func={scoring!r}: allowed: softmax, sigmoid")
    method = c.opt("topk_method", str, "noaux_tc")
    if method not in ("noaux_tc", "greedy"):  # noaux_tc: groups by their top-2 sum; greedy: no groups
        raise UnknownArchitectureError(f"{c.source}: topk_method={method!r}: allowed: noaux_tc, greedy")
    before = variant["topk_before_softmax"]
    selection = c.opt("expert_selection_fn", str)  # Cohere2-MoE: softmax over the top-k logits, or sigmoid scores
    if selection not in (None, "softmax", "sigmoid"):
        raise UnknownArchitectureError(f"{c.source}: expert_selection_fn={selection!r}: allowed: softmax, sigmoid")
    if selection is not None:
        scoring, before = selection, selection == "softmax"
    norm = variant.get("norm_topk") or c.opt("norm_topk_prob", bool, False)
    on_input = variant.get("router_on_input", False)
    if on_input:
        scoring = "sigmoid"
    return dict(
        router_weight_on_input=on_input or c.opt("moe_apply_router_weight_on_input", bool, False),
        scoring=scoring,
        score_correction_bias=layout.correction_bias is not None,
        topk_before_softmax=before,
        norm_topk_prob=False if before else norm,
        n_group=c.opt("n_group", int, 1),
        topk_group=c.opt("topk_group", int, 1),
        routed_scaling_factor=next(
            (c.req(k, float) for k in SYNONYMS["routed_scaling_factor"] if c.data.get(k) is not None), 1.0
        ),
        router_softcap=next((c.req(k, float) for k in SYNONYMS["router_softcap"] if c.data.get(k) is not None), 0.0),
    )


def _attention(
    c: HFConfig, f: dict, layout: Layout, variant: dict, types: list[str], per_kind_heads: bool = False
) -> dict:
    """Grouped-query attention's knobs (q/k norms, output gate, partial or no RoPE), or latent attention's sizes
    (``per_kind_heads``: the config says each kind's KV heads, ``_per_kind``, not the tensors)."""
    mla = [k for k in MLA if c.data.get(k) is not None]
    indexer = _indexer(c, layout, variant, f["num_layers"])  # refuses indexer fields without an indexer
    if layout.attention == "mla":
        interleave = c.opt("rope_interleave", bool, variant.get("mla_interleave", False))
        fields = mla_fields(c, f["rope"], rope_interleave=interleave)
        return fields | indexer
    if layout.own_values:  # value heads of their own size: v_head_dim says which
        mla = [k for k in mla if k != "v_head_dim"]
    if mla and mla != ["qk_head_dim"]:
        raise UnknownArchitectureError(
            f"{c.source}: latent-attention field(s) {', '.join(map(repr, mla))} without latent-attention tensors "
            "(self_attn.kv_a_proj_with_mqa): value heads of another size than the query heads are not computed"
        )
    rotary = c.opt("rotary_dim", int)  # MiniMax-M2's spelling of a partial rotary
    rope_dim = partial_rope_dim(c, f["head_dim"]) if rotary is None else (None if rotary == f["head_dim"] else rotary)
    both = {"full", "sliding"} <= set(types)
    nope = [i for i, t in enumerate(types) if t == "full"] if variant.get("nope_full") and both else []
    if c.opt("prefix_dense_sliding_window_pattern", int) == 1:  # Cohere2-MoE: its dense full layers rotate after all
        dense = set(range(f["num_layers"])) - set(moe_layers(c, f["num_layers"]))
        nope = [i for i in nope if i not in dense]
    nope += [i for i, theta in enumerate(c.opt("layer_rope_theta", list, [])) if theta == 0 and i not in nope]
    if variant.get("nope_attention") or c.data.get("position_embedding_type", "rope") != "rope":  # Granite-4.0-H
        nope = [i for i, t in enumerate(types) if t in ("full", "sliding")]
    rotates = c.opt("no_rope_layers", list)  # Llama 4's: 1 where a layer rotates, 0 where it does not
    if rotates is not None:
        if len(rotates) < f["num_layers"] or not all(r in (0, 1) for r in rotates[: f["num_layers"]]):
            raise ConfigError(
                f"{c.source}: field 'no_rope_layers' must list 1 (RoPE) or 0 (none) for each of the "
                f"{f['num_layers']} layers, got {rotates!r}"
            )
        nope += [i for i in range(f["num_layers"]) if not rotates[i] and i not in nope]
    # q/k norms switched on without tensors: a norm without a weight (Llama 4's)
    qk_norm = "l2" if layout.qk_norm == "none" and c.opt("use_qk_norm", bool, False) else layout.qk_norm
    return dict(
        qkv_bias=layout.qkv_bias,
        o_bias=layout.o_bias,
        qk_norm=qk_norm,
        qk_norm_after_rope=variant["qk_norm_after_rope"] and layout.qk_norm == "head",
        clip_qkv=c.opt("clip_qkv", float),
        attn_output_gate=layout.output_gate,
        attn_gate=layout.gate_kind,
        # Laguna's ``gating`` field goes with its softplus gates; AFMoE's (no field) are sigmoid
        attn_gate_act="softplus" if layout.gate_kind != "none" and "gating" in c.data else "sigmoid",
        layer_heads=_layer_heads(c, f),
        rope_dim=rope_dim,
        rope_interleave=c.opt("rope_interleave", bool, variant.get("gqa_interleave", False)),
        # EXAONE-MoE: with sliding layers, the full-attention ones rotate nothing (names cannot tell: a variant)
        nope_layers=sorted(nope),
        attention_sinks=layout.sinks is not None,
        sinks_sliding_only=layout.sinks_sliding_only,
        **(
            {}
            if per_kind_heads
            else {
                "sliding_kv_heads": f["num_kv_heads"] * layout.sliding_kv_factor if layout.sliding_kv_factor > 1 else 0
            }
        ),
        attn_k_eq_v=c.opt("attention_k_eq_v", bool, False),
        **({"v_norm": True, "attn_scale": 1.0} if variant.get("unit_values") else {}),
        v_head_dim=c.req("v_head_dim", int) if layout.own_values else 0,
        attn_value_scale=c.opt("attention_value_scale", float, 1.0),
        **_temperature(c, nope),
        attention_chunk=c.req("attention_chunk_size", int) if "chunked" in types else None,
        **({"attn_scale": c.req("attention_multiplier", float)} if "attention_multiplier" in c.data else {}),
    )


def _per_kind(c: HFConfig, f: dict, types: list[str]) -> dict:
    """Gemma 4's ``per_layer_config`` (or, as its hub configs spell it, ``global_head_dim`` and, where the full layers'
    values are their keys, ``num_global_key_value_heads``): the full layers' own head size and KV heads (the top-level
    ones are the sliding layers'), as moerl's ``head_dim`` / ``num_kv_heads`` and the sliding layers'
    ``sliding_head_dim`` / ``sliding_kv_heads``. Anything else per layer is refused by name."""
    per = c.opt("per_layer_config", dict)
    if not per and ("global_head_dim" in c.data or "num_global_key_value_heads" in c.data):
        own = {"head_dim": c.req("global_head_dim", int)} if "global_head_dim" in c.data else {}
        if c.opt("attention_k_eq_v", bool, False) and c.data.get("num_global_key_value_heads") is not None:
            own["num_key_value_heads"] = c.req("num_global_key_value_heads", int)
        per = {str(i): own for i, t in enumerate(types) if t == "full"}
    if not per:
        return {}
    seen = {}
    for key, over in per.items():
        layer = int(key) if str(key).isdigit() else -1
        if not 0 <= layer < len(types) or not isinstance(over, dict) or set(over) - {"head_dim", "num_key_value_heads"}:
            raise UnknownArchitectureError(
                f"{c.source}: field 'per_layer_config' entry {key!r} ({over!r}): moerl's decoder takes a head size "
                "and KV heads of the full layers' own, by layer index"
            )
        seen[layer] = (over.get("head_dim", f["head_dim"]), over.get("num_key_value_heads", f["num_kv_heads"]))
    full = [i for i, t in enumerate(types) if t == "full"]
    if sorted(seen) != full or len(set(seen.values())) != 1:
        raise UnknownArchitectureError(
            f"{c.source}: field 'per_layer_config' sets layers {sorted(seen)} to {sorted(set(seen.values()))} (head "
            f"size, KV heads): moerl's decoder keeps one of each for the full layers ({full}) and one for the others"
        )
    ((dim, kv),) = set(seen.values())
    out = dict(head_dim=dim, num_kv_heads=kv)
    if "sliding" in types and dim != f["head_dim"]:
        out["sliding_head_dim"] = f["head_dim"]
    if "sliding" in types and kv != f["num_kv_heads"]:
        out["sliding_kv_heads"] = f["num_kv_heads"]
    return out


def _temperature(c: HFConfig, nope: list[int]) -> dict:
    """Llama 4's temperature tuning of the NoPE layers' queries (none without such a layer)."""
    if not c.opt("attn_temperature_tuning", bool, False) or not nope:
        return {}
    return dict(attn_temperature_scale=c.req("attn_scale", float), attn_temperature_floor=c.req("floor_scale", int))


def _sliding_rope(c: HFConfig, f: dict, params: dict | None) -> dict:
    """The sliding layers' own RoPE and rotated dims from their ``rope_parameters`` (none: they rotate as the full
    ones)."""
    if params is None:
        return {}
    own = HFConfig({"rope_parameters": params}, f"{c.source} rope_parameters.sliding_attention")
    return dict(sliding_rope=own.rope(), sliding_rope_dim=partial_rope_dim(own, f["head_dim"]))


def _layer_heads(c: HFConfig, f: dict) -> list[int]:
    """The query heads per layer where the config lists them and they differ from ``num_attention_heads``."""
    heads = c.opt("num_attention_heads_per_layer", list)
    if heads is None or all(h == f["num_heads"] for h in heads):
        return []
    if len(heads) != f["num_layers"] or not all(isinstance(h, int) and h >= 1 for h in heads):
        raise ConfigError(
            f"{c.source}: field 'num_attention_heads_per_layer' must list an int >= 1 for each of the "
            f"{f['num_layers']} layers, got {heads!r}"
        )
    return list(heads)


def _indexer(c: HFConfig, layout: Layout, variant: dict, n: int) -> dict:
    """DeepSeek sparse attention's fields where the tensors hold an indexer: its heads, their size, the keys a
    query keeps, and the layers that keep an earlier indexer layer's choice (GLM-5's ``shared`` ones)."""
    named = [k for k in INDEX if c.data.get(k) is not None]
    if not layout.indexer:
        if named:
            raise UnknownArchitectureError(
                f"{c.source}: indexer field(s) {', '.join(map(repr, named))} without indexer tensors "
                "(self_attn.indexer.*)"
            )
        return {}
    kinds = c.opt("indexer_types", list) or ["full"] * n
    if set(kinds) - {"full", "shared"} or len(kinds) != n or kinds[0] != "full":
        bad = next((f"{k!r} (layer {i})" for i, k in enumerate(kinds) if k not in ("full", "shared")), None)
        raise ConfigError(
            f"{c.source}: field 'indexer_types' must list 'full' / 'shared' for each of the {n} layers, the first "
            f"'full' (a shared layer keeps the keys an earlier one chose); got {bad or kinds!r}"
        )
    return dict(
        index_shared_layers=[i for i, k in enumerate(kinds) if k == "shared"],
        index_topk=c.req("index_topk", int),
        index_n_heads=c.req("index_n_heads", int),
        index_head_dim=c.req("index_head_dim", int),
        index_rope_interleave=variant.get("index_interleave", False),
    )


def derive(hf: dict, layout: Layout, variant: dict) -> Bridge:
    """The bridge for a family with tensors laid out as ``layout``, in behaviour ``variant`` (``hf``: its config,
    for the names)."""
    rules, fused = _rules(layout, variant)
    return Bridge(
        architectures=(arch_name(hf),),
        model_type=str(hf.get("model_type", "?")),
        config_from_hf=partial(_config, layout=layout, variant=variant),
        preset_config=_no_preset,
        rules=tuple(rules),
        fused=fused,
        ignore=mtp_layer,
        # where PEFT finds the 3D experts in transformers' model (GraniteMoe's block_sparse_moe, ...)
        peft_experts=f"model.layers.{{i}}{_under(layout.block)}.experts",
    )


def _config(c: HFConfig, layout: Layout, variant: dict) -> ModelConfig:
    """The ModelConfig of config ``c`` for tensors laid out as ``layout``, in behaviour ``variant``."""
    check_known(c.data)
    blocks = one_block_kinds(c) if layout.one_block else None
    if blocks is not None:  # the layer count and the norms' epsilon as the other families spell them
        eps = c.opt("layer_norm_epsilon", float, 1e-5)
        c = HFConfig(c.data | {"num_hidden_layers": len(blocks), "rms_norm_eps": eps}, c.source)
    n = c.req("num_hidden_layers", int)
    use = c.opt("use_sliding_window", bool)
    if use and not c.opt("layer_types", list):
        raise UnknownArchitectureError(f"{c.source}: use_sliding_window without layer_types: not derivable")
    if "sliding_window_pattern" in c.data and not c.opt("layer_types", list):
        raise UnknownArchitectureError(f"{c.source}: sliding_window_pattern without layer_types: not derivable")
    # a window with neither switch nor layer types slides on every layer (Mixtral's convention)
    types, window = layer_types(
        c, n, all_sliding=use is None, linear=layout.linear is not None, indexed=layout.indexer, mamba=layout.mamba
    )
    c, sliding = _one_rope(c, types)
    # Cohere's convention: a null rms_norm_eps means LayerNorm (without bias), of layer_norm_eps
    layer_norm_eps = c.opt("layer_norm_eps", float) if c.data.get("rms_norm_eps") is None else None
    if layer_norm_eps is not None:
        c = HFConfig(c.data | {"rms_norm_eps": layer_norm_eps}, c.source)
    f = common_fields(c)
    f["tie_word_embeddings"] = layout.tied
    per_kind = _per_kind(c, f, types)  # Gemma 4's full layers' own head size and KV heads
    own_heads = bool(per_kind)  # each kind's KV heads from the config, not from the tensors
    f |= {k: per_kind.pop(k) for k in ("head_dim", "num_kv_heads") if k in per_kind}
    moe_size = c.first(SYNONYMS["moe_intermediate_size"] + ("intermediate_size",), int)
    shared = 0
    if layout.shared is not None:  # its own size, else n shared experts' worth, else one expert's
        count = next((c.req(k, int) for k in SYNONYMS["n_shared_experts"] if c.data.get(k) is not None), 1)
        own = next((c.req(k, int) for k in SYNONYMS["shared_size"] if c.data.get(k)), 0)
        shared = own or moe_size * count
    moe = moe_layers(c, n)
    one_block = {}
    if blocks is not None:  # Nemotron-H: each layer one block, its kind from the config
        kinds = {"mamba": layout.mamba, "attention": "full", "moe": "none", "mlp": "none"}
        types = [kinds[b] for b in blocks]
        moe = [i for i, b in enumerate(blocks) if b == "moe"]
        only = [i for i, b in enumerate(blocks) if b in ("mamba", "attention")]
        one_block = dict(mixer_only_layers=only, activation="relu2")
    else:
        act = c.data.get("hidden_act") or c.data.get("hidden_activation") or "silu"
        one_block = dict(activation=ACTIVATIONS[act])
    hidden = f["hidden_size"]
    # Gemma 4: a dense MLP beside the experts in every MoE layer
    dense = len(moe) + len(one_block.get("mixer_only_layers", [])) < n or not layout.block
    return ModelConfig(
        **f,
        **one_block,
        intermediate_size=c.first(("prefix_dense_intermediate_size", "intermediate_size_mlp", "intermediate_size"), int)
        if dense
        else 0,
        num_experts=c.first(SYNONYMS["num_experts"], int),
        top_k=c.first(SYNONYMS["top_k"], int),
        moe_intermediate_size=moe_size,
        moe_layers=moe,
        layer_types=types,
        sliding_window=window,
        norm="layer" if layout.layer_norm else ("layer_nobias" if layer_norm_eps is not None else "rms"),
        norm_placement=_placement(layout),
        moe_output_norm=layout.moe_output_norm,
        lm_head_bias=layout.lm_head_bias,
        router_bias=layout.router_bias,
        shared_expert_size=shared,
        shared_expert_gate=layout.shared_gate,
        zero_experts=c.opt("zero_expert_num", int, 0),
        embedding_multiplier=hidden**0.5
        if c.opt("mup_enabled", bool) or variant.get("embed_sqrt")
        else c.opt(MUP[1], float, 1.0),
        residual_multiplier=c.opt("residual_multiplier", float, 1.0),
        logits_scaling=1 / c.req("logit_scale", float)
        if "logit_scale" in c.data
        else c.opt("logits_scaling", float, 1.0),
        shared_combine=_shared_combine(c, shared),
        final_logit_softcap=c.opt("final_logit_softcapping", float, 0.0),
        layer_scale=layout.layer_scalar,
        moe_beside_mlp=not layout.block,
        router_input_norm=layout.router_input_scale,
        router_expert_scale=layout.router_expert_scale,
        **per_kind,
        **_attention(c, f, layout, variant, types, per_kind_heads=own_heads),
        **_sliding_rope(c, f | {"head_dim": per_kind.get("sliding_head_dim", f["head_dim"])}, sliding),
        **_routing(c, layout, variant),
        **(linear_attention_fields(c) if layout.linear is not None else {}),
        **(mamba_fields(c, hidden, variant.get("mamba_norm_groups", 1), layout.mamba) if layout.mamba else {}),
    )


def _shared_combine(c: HFConfig, shared: int) -> str:
    """How the shared experts join the routed ones (Cohere2-MoE's ``shared_expert_combination_strategy``): their
    sum, or its average; nothing to combine without shared experts."""
    how = c.opt("shared_expert_combination_strategy", str, "sum")
    if how not in ("sum", "average"):
        raise UnknownArchitectureError(f"{c.source}: shared_expert_combination_strategy={how!r}: allowed: sum, average")
    return how if shared else "sum"


def _placement(layout: Layout) -> str:
    """Where the layers' norms sit, by the tensors: ModelConfig.norm_placement."""
    if layout.sandwich:
        return "sandwich"
    if layout.post_norm:
        return "post"
    return "parallel" if layout.parallel else "pre"


def one_block_kinds(c: HFConfig) -> list[str]:
    """Nemotron-H's layer kinds (mamba, attention, mlp, moe) from ``layers_block_type`` or, in older configs, the
    ``hybrid_override_pattern`` string (M, *, -, E)."""
    pattern = c.opt("hybrid_override_pattern", str)
    names = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
    names |= {"mlp": "mlp", "moe": "moe"}
    if pattern is not None and c.data.get("layers_block_type") is None:
        letters = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        bad = next((ch for ch in pattern if ch not in letters), None)
        if bad is not None:
            raise ConfigError(f"{c.source}: field 'hybrid_override_pattern' holds {bad!r}; allowed: M, *, -, E")
        return [letters[ch] for ch in pattern]
    blocks = c.req("layers_block_type", list)
    bad = next((b for b in blocks if b not in names), None)
    if bad is not None:
        raise ConfigError(f"{c.source}: field 'layers_block_type' holds {bad!r}; allowed: {', '.join(names)}")
    return [names[b] for b in blocks]


def _one_block_rules(prefix: str, write: bool) -> tuple[Rule, ...]:
    """Nemotron-H's tensors under ``prefix`` (its checkpoints' ``backbone``, transformers' ``model``): each layer's one
    block under ``mixer``, its one norm ``norm``; per-expert or 3D un-gated experts (the up rows alone). ``write``:
    export writes these names (the per-expert ones of the 3D experts)."""
    layer = f"{prefix}.layers.{{i}}.mixer"
    fused = (
        Rule(f"{layer}.experts.up_proj", "layers.{i}.mlp.experts.gate_up_proj", write=False),
        Rule(f"{layer}.experts.down_proj", "layers.{i}.mlp.experts.down_proj", write=False),
    )
    rules = (
        Rule(f"{prefix}.embeddings.weight", "embed_tokens.weight"),
        Rule(f"{prefix}.norm_f.weight", "norm.weight"),
        Rule(f"{prefix}.layers.{{i}}.norm.weight", "layers.{i}.input_layernorm.weight"),
        Rule(f"{layer}.gate.weight", "layers.{i}.mlp.router.weight"),
        Rule(f"{layer}.gate.e_score_correction_bias", "layers.{i}.mlp.router.e_score_correction_bias"),
        Rule(f"{layer}.experts.{{e}}.up_proj.weight", "layers.{i}.mlp.experts.gate_up_proj"),
        Rule(f"{layer}.experts.{{e}}.down_proj.weight", "layers.{i}.mlp.experts.down_proj"),
        Rule(f"{layer}.shared_experts.{{x}}", "layers.{i}.mlp.shared_experts.{x}"),
        *(Rule(f"{layer}.{m}.{{x}}", f"layers.{{i}}.mlp.{m}.{{x}}") for m in ("up_proj", "down_proj")),
        *(
            Rule(f"{layer}.{m}.{{x}}", f"layers.{{i}}.self_attn.{m}.{{x}}")
            for m in ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "conv1d", "norm", "out_proj")
        ),
        *(Rule(f"{layer}.{m}", f"layers.{{i}}.self_attn.{m}") for m in ("dt_bias", "A_log", "D")),
    )
    return fused + (rules if write else tuple(dataclasses.replace(r, write=False) for r in rules))


# export writes the checkpoints' own names (``backbone.``, per-expert tensors, as transformers saves them); either
# prefix, per-expert or 3D, loads
ONE_BLOCK_RULES = _one_block_rules("backbone", True) + _one_block_rules("model", False)


def _rules(layout: Layout, variant: dict) -> tuple[list[Rule], tuple[Fused, ...]]:
    """The tensor rules (and fused tensors) of ``layout`` in ``variant``: router, experts, shared experts, q/k and
    offset norms, linear attention."""
    if layout.one_block:
        return list(ONE_BLOCK_RULES), ()
    hf_block = f"model.layers.{{i}}{_under(layout.block)}"
    rules = [Rule(f"{hf_block}.{layout.router}.weight", "layers.{i}.mlp.router.weight")]
    if not layout.block:  # Gemma 4: the MLP, its norms and the router's scales beside the experts, at the layer
        rules += [Rule(f"model.layers.{{i}}.{theirs}", f"layers.{{i}}.mlp.{ours}") for theirs, ours in BESIDE]
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
    elif layout.experts_transposed:
        rules += [
            Rule(f"{hf_block}.experts.{w}", f"layers.{{i}}.mlp.experts.{w}", load=_swap, save=_swap)
            for w in ("gate_up_proj", "down_proj")
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
    theirs = layout.norms
    if offset or theirs != Layout.norms:
        for hf_norm, norm in zip(theirs[:2], ("input_layernorm", "post_attention_layernorm"), strict=True):
            rules.append(Rule(f"model.layers.{{i}}.{hf_norm}.weight", f"layers.{{i}}.{norm}.weight", **offset))
        rules.append(Rule(f"model.{theirs[2]}.weight", "norm.weight", **offset))
    if layout.mamba:
        rules += MAMBA_RULES[layout.mamba]
    if layout.block == "feed_forward":  # Jamba: dense MLPs, routers and experts under one name
        # export writes the dense MLPs by name and the catch-all only loads: writing it too would put each expert
        # tensor out twice, per expert by the rules above and whole under its moerl name (one memory, two names)
        rules += [
            Rule(f"model.layers.{{i}}.feed_forward.{m}.{{x}}", f"layers.{{i}}.mlp.{m}.{{x}}")
            for m in ("gate_proj", "up_proj", "down_proj")
        ]
        rules.append(Rule("model.layers.{i}.feed_forward.{x}", "layers.{i}.mlp.{x}", write=False))
    if layout.linear is not None:
        rules += LINEAR_ATTENTION_RULES
        fused += FUSED if layout.linear == "fused" else ()
    if layout.shared_gate:
        rules.append(Rule(f"{hf_block}.shared_expert_gate.weight", "layers.{i}.mlp.shared_experts_gate.weight"))
    if layout.sandwich == "mlp":  # AFMoE's names for the MLP's pair
        rules += [
            Rule(
                f"model.layers.{{i}}.{where}_mlp_layernorm.weight", f"layers.{{i}}.{where}_feedforward_layernorm.weight"
            )
            for where in ("pre", "post")
        ]
    if layout.sinks == "attention_sink_bias":  # MiMo-V2-Flash's name for them
        rules.append(Rule("model.layers.{i}.self_attn.attention_sink_bias", "layers.{i}.self_attn.sinks"))
    if layout.moe_output_norm:
        rules.append(Rule("model.layers.{i}.post_mlp_layernorm.weight", "layers.{i}.post_feedforward_layernorm.weight"))
    if layout.gate_proj == "g_proj":
        rules.append(Rule("model.layers.{i}.self_attn.g_proj.weight", "layers.{i}.self_attn.gate_proj.weight"))
    return rules, fused


def _swap(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """3D experts' last two dims swapped (Llama 4's [E, H, 2I] <-> moerl's [E, 2I, H]), contiguous."""
    return t.transpose(1, 2).contiguous()


# Gemma 4's MoE layer (a dense MLP beside the experts) -> moerl's MoE block that holds both
BESIDE = (
    ("mlp.{x}", "shared_experts.{x}"),
    ("pre_feedforward_layernorm.weight", "shared_input_norm.weight"),
    ("post_feedforward_layernorm_1.weight", "shared_output_norm.weight"),
    ("pre_feedforward_layernorm_2.weight", "routed_input_norm.weight"),
    ("post_feedforward_layernorm_2.weight", "routed_output_norm.weight"),
    ("router.scale", "router.input_scale"),
    ("router.per_expert_scale", "router.expert_scale"),
)


def _no_preset(p: Preset, bos: int, eos: int, pad: int) -> dict:
    raise UnknownArchitectureError("a derived bridge writes no preset configs (init-model needs a bridge file)")
