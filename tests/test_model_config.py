"""Nothing accepted that is then ignored: every ModelConfig combination the decoder does not implement is refused by
name, and so are HF layer types it has no layer for."""

import dataclasses

import pytest
import torch

from moerl.bridges import HFConfig, bridge_for_arch
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig, RopeConfig
from moerl.model.transformer import MoEModel

GQA = dict(
    vocab_size=32,
    hidden_size=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=32,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=8,
    moe_layers=[1],
)
LINEAR = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4)
HYBRID = GQA | LINEAR | dict(layer_types=["linear", "full"], attn_output_gate=True, rope_dim=2)
# Mamba-2 beside attention (Granite-4.0-H): 2 heads of 4 channels, 8 states
MAMBA = GQA | dict(layer_types=["mamba", "full"], mamba_num_heads=2, mamba_head_dim=4, mamba_state_size=8)
# Mamba-1 beside attention (Jamba): 8 channels, 4 states, a rank-2 step
MAMBA1 = GQA | dict(layer_types=["mamba1", "full"], mamba_inner_size=8, mamba_state_size=4, mamba_dt_rank=2)
MLA = GQA | dict(attention="mla", head_dim=0, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
# DeepSeek sparse attention: an indexer (2 heads of 4) keeping 3 keys a query, on latent attention with a low-rank query
INDEXED = MLA | dict(q_lora_rank=8, index_topk=3, index_n_heads=2, index_head_dim=4)

REFUSED = [
    # (base, overrides, field named, why)
    (GQA, dict(qk_norm_after_rope=True), "qk_norm_after_rope", "needs per-head norms"),
    (GQA, dict(qk_norm="head", qk_norm_after_rope=True, rope_interleave=True), "qk_norm_after_rope", "interleave"),
    (GQA, dict(kv_lora_rank=8), "kv_lora_rank", "latent attention field set with attention='gqa'"),
    (GQA, dict(rope_dim=3), "rope_dim", "must be even"),
    (GQA, dict(rope_dim=8), "rope_dim", r"lie in \[2, head_dim=4\]"),
    (GQA, dict(scoring="sparsemixer", top_k=3), "top_k", "not built with scoring='sparsemixer'"),
    (GQA, dict(scoring="sparsemixer", norm_topk_prob=True), "norm_topk_prob", "scoring='sparsemixer'"),
    (GQA, dict(scoring="sparsemixer", sparsemixer_eps=-1.0), "sparsemixer_eps", "must be >= 0"),
    (GQA, dict(scoring="top1"), "scoring", "allowed: softmax, sigmoid, sparsemixer"),
    (GQA, dict(norm_topk_min=1e-12), "norm_topk_min", "normalisation that is off"),
    (GQA, dict(group_score="max"), "group_score", "not group-limited"),
    (GQA, dict(group_score="mean", n_group=2), "group_score", "allowed: top2_sum, max"),
    (GQA, dict(norm="batch"), "norm", "allowed: rms, layer, layer_nobias"),
    (GQA, dict(norm_placement="middle"), "norm_placement", "allowed: pre, post, sandwich, parallel"),
    (GQA, dict(shared_combine="max", shared_expert_size=8), "shared_combine", "allowed: sum, average"),
    (GQA, dict(shared_combine="average"), "shared_combine", "no shared expert"),
    (GQA, dict(norm_placement="sandwich", moe_output_norm=True), "moe_output_norm", "a pre-norm model's"),
    (GQA, dict(embedding_multiplier=0.0), "embedding_multiplier", "must be > 0"),
    (GQA, dict(residual_multiplier=-1.0), "residual_multiplier", "must be > 0"),
    (GQA, dict(logits_scaling=0.0), "logits_scaling", "must be > 0"),
    (GQA, dict(topk_before_softmax=True, scoring="sigmoid"), "scoring", "not built with topk_before_softmax"),
    (GQA, dict(topk_before_softmax=True, norm_topk_prob=True), "norm_topk_prob", "topk_before_softmax"),
    (GQA, dict(sliding_window=8), "sliding_window", "no layer is 'sliding'"),
    (GQA, dict(swiglu_limit=5.0), "activation", "only activation='swiglu_clamped' uses them"),
    (GQA, dict(shared_expert_gate=True), "shared_expert_gate", "shared_expert_size=0"),
    (GQA, dict(clip_qkv=0.0), "clip_qkv", "must be > 0"),
    (GQA, dict(routed_scaling_factor=0.0), "routed_scaling_factor", "must be > 0"),
    (GQA, dict(rms_norm_eps=0.0), "rms_norm_eps", "must be > 0"),
    (GQA, dict(moe_layers=[1, 1]), "moe_layers", "holds an index twice"),
    (GQA, dict(intermediate_size=0), "intermediate_size", "must be >= 1"),
    (GQA, dict(moe_intermediate_size=0), "moe_intermediate_size", "must be >= 1"),
    (GQA, dict(head_dim=0), "head_dim", "must be >= 1"),
    (MLA, dict(qk_norm="head"), "qk_norm", "not built for attention='mla'"),
    (MLA, dict(clip_qkv=3.0), "clip_qkv", "not built for attention='mla'"),
    (MLA, dict(attention_sinks=True), "attention_sinks", "not built for attention='mla'"),
    (MLA, dict(rope_dim=2), "rope_dim", "not built for attention='mla'"),
    (MLA, dict(qk_norm_after_rope=True), "qk_norm_after_rope", "not built for attention='mla'"),
    (MLA, dict(v_head_dim=0), "v_head_dim", "must be >= 1"),
    (MLA, dict(attn_output_gate=True), "attn_output_gate", "not built for attention='mla'"),
    # Laguna's knobs: a head count and a RoPE per layer, output gates of their own projection, the router's cap
    (GQA, dict(layer_heads=[4]), "layer_heads", "needs 2 entries"),
    (GQA, dict(layer_heads=[4, 3]), "layer_heads", "layer 1's 2 KV heads must divide its 3 heads"),
    (MLA, dict(layer_heads=[4, 2]), "layer_heads", "not built for attention='mla'"),
    (GQA, dict(attn_gate="channel"), "attn_gate", "allowed: none, head, element"),
    (GQA, dict(attn_gate="head", attn_gate_act="tanh"), "attn_gate_act", "allowed: sigmoid, softplus"),
    (GQA, dict(attn_gate_act="softplus"), "attn_gate_act", "no gate of its own projection"),
    (GQA, dict(attn_gate="head", attn_output_gate=True), "attn_gate", "a second output gate"),
    (MLA, dict(attn_gate="head"), "attn_gate", "not built for attention='mla'"),
    (GQA, dict(sliding_rope_dim=2), "sliding_rope_dim", "without sliding_rope"),
    (GQA, dict(sliding_rope=RopeConfig()), "sliding_rope", "no layer is 'sliding'"),
    (
        GQA,
        dict(layer_types=["sliding", "full"], sliding_window=4, sliding_rope=RopeConfig(), sliding_rope_dim=3),
        "sliding_rope_dim",
        "must be even",
    ),
    (GQA, dict(router_softcap=-1.0), "router_softcap", "must be >= 0"),
    # MiMo-V2-Flash's: the sliding layers' KV heads and sinks, values of their own size, scaled
    (GQA, dict(sliding_kv_heads=4), "sliding_kv_heads", "with a 'sliding' layer"),
    (
        GQA,
        dict(layer_types=["sliding", "full"], sliding_window=4, sliding_kv_heads=3),
        "sliding_kv_heads",
        "layer 0's 3 KV heads must divide its 4 heads",
    ),
    (GQA, dict(sinks_sliding_only=True, attention_sinks=True), "sinks_sliding_only", "a 'sliding' layer"),
    (GQA, dict(attn_value_scale=0.0), "attn_value_scale", "must be > 0"),
    (GQA, dict(v_head_dim=-1), "v_head_dim", "must be >= 1"),
    (GQA, dict(v_head_dim=2, attn_output_gate=True), "v_head_dim", "attn_output_gate"),
    (MLA, dict(sliding_kv_heads=4), "sliding_kv_heads", "with a 'sliding' layer"),
    (MLA, dict(attn_value_scale=0.5), "attn_value_scale", "not built for attention='mla'"),
    (GQA, dict(linear_num_key_heads=2), "linear_num_key_heads", "without a 'linear' layer"),
    (GQA, dict(linear_conv_kernel=3), "linear_conv_kernel", "without a 'linear' layer"),
    (
        HYBRID,
        dict(linear_num_key_heads=2, linear_num_value_heads=3),
        "linear_num_value_heads",
        "a multiple of them as value heads",
    ),
    (HYBRID, dict(linear_conv_kernel=0), "linear_key_head_dim", "a conv kernel >= 1"),
    (
        GQA,
        dict(layer_types=["ssm", "full"]),
        "layer_types",
        "entries allowed: full, sliding, chunked, linear, mamba, mamba1",
    ),
    # Llama 4's: chunks, temperature tuning of the NoPE layers, the gate weight on the one expert's input
    (GQA, dict(layer_types=["chunked", "full"]), "attention_chunk", "chunked layers need a chunk >= 1"),
    (GQA, dict(attention_chunk=8), "attention_chunk", "no layer is 'chunked'"),
    (MLA, dict(layer_types=["chunked", "full"], attention_chunk=8), "attention_chunk", "not built for attention='mla'"),
    (GQA, dict(attn_temperature_scale=0.1, attn_temperature_floor=4), "attn_temperature_scale", "nope_layers is empty"),
    (GQA, dict(attn_temperature_scale=0.1, nope_layers=[1]), "attn_temperature_floor", "must be >= 1"),
    (GQA, dict(attn_temperature_scale=-0.1, nope_layers=[1]), "attn_temperature_scale", "must be > 0"),
    (GQA, dict(attn_temperature_floor=4), "attn_temperature_floor", "not built without attn_temperature_scale"),
    (GQA, dict(router_weight_on_input=True), "router_weight_on_input", "top_k=1, not 2"),
    (GQA, dict(qk_norm="l2", qk_norm_after_rope=True), "qk_norm_after_rope", "needs per-head norms"),
    (GQA, dict(qk_norm="rms"), "qk_norm", "allowed: none, head, full, l2"),
    (GQA, dict(mamba_num_heads=2), "mamba_num_heads", "without a 'mamba' layer"),
    (GQA, dict(mamba_head_dim=4), "mamba_head_dim", "without a 'mamba' layer"),
    (GQA, dict(mamba_state_size=4), "mamba_state_size", "without a 'mamba' or 'mamba1' layer"),
    (GQA, dict(mamba_groups=2), "mamba_groups", "without a 'mamba' layer"),
    (GQA, dict(mamba_conv_kernel=3), "mamba_conv_kernel", "without a 'mamba' or 'mamba1' layer"),
    (GQA, dict(mamba_conv_bias=True), "mamba_conv_bias", "without a 'mamba' or 'mamba1' layer"),
    (GQA, dict(mamba_proj_bias=True), "mamba_proj_bias", "without a 'mamba' or 'mamba1' layer"),
    (GQA, dict(mamba_norm_groups=2), "mamba_norm_groups", "without a 'mamba' layer"),
    (GQA, dict(mamba_dt_min=0.001), "mamba_dt_min", "without a 'mamba' layer"),
    (GQA, dict(mamba_dt_max=0.1), "mamba_dt_max", "without a 'mamba' layer"),
    (MAMBA, dict(mamba_state_size=0), "mamba_state_size", "must be >= 1"),
    (GQA, dict(mamba_inner_size=8), "mamba_inner_size", "without a 'mamba1' layer"),
    (MAMBA, dict(mamba_dt_rank=2), "mamba_dt_rank", "without a 'mamba1' layer"),
    (MAMBA1, dict(mamba_dt_rank=0), "mamba_dt_rank", "must be >= 1"),
    (GQA, dict(mixer_only_layers=[1]), "mixer_only_layers", "lists an MoE layer"),
    (GQA, dict(zero_experts=-1), "zero_experts", "must be >= 0"),
    (GQA, dict(zero_experts=2, top_k=7), "top_k", r"must lie in \[1, num_experts \+ zero_experts=6\]"),
    (INDEXED, dict(index_shared_layers=[0]), "index_shared_layers", r"must lie in \[1, 2\)"),
    (MLA | dict(q_lora_rank=8), dict(index_shared_layers=[1]), "index_shared_layers", "without an indexer"),
    (GQA, dict(mixer_only_layers=[2]), "mixer_only_layers", r"indices must lie in \[0, 2\)"),
    (GQA, dict(layer_types=["none", "full"], mixer_only_layers=[0]), "mixer_only_layers", "of type 'none'"),
    (GQA, dict(layer_types=["none", "full"], norm_placement="post"), "norm_placement", "pre-norm only"),
    (GQA, dict(layer_types=["none", "full"], nope_layers=[0]), "nope_layers", "one without a mixer"),
    (GQA, dict(activation="gelu"), "activation", "allowed: silu, swiglu_clamped, gelu_tanh, relu2"),
    # Gemma 4's: values that are the keys, normed values, the sliding layers' own head size, capped logits, the MoE
    # beside its MLP with its router's own norm and per-expert scale
    (GQA, dict(attn_k_eq_v=True, layer_types=["sliding", "sliding"], sliding_window=4), "attn_k_eq_v", "no layer is"),
    (GQA, dict(attn_k_eq_v=True, v_head_dim=2), "attn_k_eq_v", "the keys' size"),
    (MLA, dict(v_norm=True), "v_norm", "not built for attention='mla'"),
    (GQA, dict(sliding_head_dim=8), "sliding_head_dim", "with a 'sliding' layer"),
    (GQA, dict(sliding_head_dim=8, layer_types=["sliding", "full"], sliding_window=4), "sliding_head_dim", "needs"),
    (GQA, dict(final_logit_softcap=-1.0), "final_logit_softcap", "must be >= 0"),
    (GQA, dict(moe_beside_mlp=True), "moe_beside_mlp", "a sandwich-norm model's"),
    (GQA, dict(moe_beside_mlp=True, intermediate_size=0, moe_layers=[0, 1]), "moe_beside_mlp", "intermediate_size"),
    (GQA, dict(router_input_norm=True), "router_input_norm", "moe_beside_mlp"),
    (GQA, dict(router_expert_scale=True), "router_expert_scale", "moe_beside_mlp"),
    (MAMBA1, dict(mamba_num_heads=2), "mamba_num_heads", "without a 'mamba' layer"),
    (MAMBA, dict(mamba_groups=3), "mamba_groups", "must divide mamba_num_heads=2"),
    (MAMBA, dict(mamba_norm_groups=3), "mamba_norm_groups", "divide the channels"),
    (MAMBA, dict(mamba_dt_min=0.5, mamba_dt_max=0.1), "mamba_dt_min", "mamba_dt_min < mamba_dt_max"),
    (MAMBA, dict(nope_layers=[0]), "nope_layers", "lists a recurrent layer"),
    (GQA, dict(nope_layers=[2]), "nope_layers", r"indices must lie in \[0, 2\), each once"),
    (GQA, dict(nope_layers=[1, 1]), "nope_layers", "each once"),
    (MLA, dict(nope_layers=[0]), "nope_layers", "not built for attention='mla'"),
    (HYBRID, dict(nope_layers=[0]), "nope_layers", "lists a recurrent layer"),
    (MLA, dict(index_topk=4, index_n_heads=2, index_head_dim=4), "index_topk", "low-rank query"),
    (GQA, dict(index_topk=4, index_n_heads=2, index_head_dim=4), "index_topk", "needs latent attention"),
    (INDEXED, dict(index_n_heads=0), "index_n_heads", "must be >= 1"),
    (INDEXED, dict(index_head_dim=1), "index_head_dim", "must be >= qk_rope_head_dim=2"),
    (INDEXED, dict(index_topk=-1), "index_topk", "must be >= 1"),
    (MLA, dict(index_n_heads=2), "index_n_heads", "not built without an indexer"),
    (MLA, dict(index_head_dim=4), "index_head_dim", "not built without an indexer"),
    (MLA, dict(index_rope_interleave=True), "index_rope_interleave", "not built without an indexer"),
    # LongCat-Flash's: the low-rank parts of latent attention scaled, the MoE output carried past the next layer
    (GQA, dict(mla_lora_scale=True), "mla_lora_scale", "multi-head latent attention field set with attention='gqa'"),
    (MLA, dict(mla_lora_scale=True), "mla_lora_scale", "q_lora_rank is unset"),
    (GQA, dict(moe_shortcut=True), "moe_shortcut", r"needs layers in pairs, the first of each MoE"),
    (GQA, dict(moe_shortcut=True, num_layers=3, moe_layers=[0, 2]), "moe_shortcut", "needs layers in pairs"),
    (GQA, dict(moe_shortcut=True, moe_layers=[0], residual_multiplier=2.0), "moe_shortcut", "without multipliers"),
    (GQA, dict(moe_shortcut=True, moe_layers=[0], shared_expert_size=8), "moe_shortcut", "without shared experts"),
    (MAMBA, dict(moe_shortcut=True, moe_layers=[0]), "moe_shortcut", "attention in every layer"),
    # JetMoE's: a mixture of attention heads, a bias on the MoE's output, the final norm's own epsilon
    (GQA, dict(attention="moa", num_heads=8), "num_heads", "must be num_kv_heads x top_k=4"),
    (GQA, dict(attention="moa", num_heads=4, zero_experts=2), "attention", "no zero-computation ones"),
    (GQA, dict(attention="moa", num_heads=4, qk_norm="head"), "qk_norm", "not built for attention='moa'"),
    (GQA, dict(attention="moa", num_heads=4, nope_layers=[0]), "nope_layers", "not built for attention='moa'"),
    (GQA, dict(attention="moa", num_heads=4, kv_lora_rank=8), "kv_lora_rank", "latent attention field set"),
    (GQA, dict(moe_output_bias=True, moe_layers=[]), "moe_output_bias", "there is none"),
    (GQA, dict(final_norm_eps=-1.0), "final_norm_eps", "must be > 0"),
]


ACCEPTED = [
    GQA,
    MLA | dict(rope_interleave=True),
    GQA | dict(intermediate_size=0, moe_layers=[0, 1]),  # no dense layer: no dense size needed
    GQA | dict(scoring="sigmoid", score_correction_bias=True, n_group=2, topk_group=1),
    GQA | dict(topk_before_softmax=True),
    GQA | dict(rope_interleave=True, score_correction_bias=True, norm_topk_prob=True, norm_topk_min=1e-12),
    GQA | dict(n_group=2, topk_group=1, group_score="max", qk_norm="head", qk_norm_after_rope=True),
    GQA | dict(scoring="sparsemixer", norm="layer", norm_placement="post", mlp_bias=True, lm_head_bias=True),
    HYBRID | dict(linear_conv_kernel=3),
    GQA | dict(nope_layers=[1], rope_dim=2),  # a layer without RoPE beside a partially rotated one
    INDEXED | dict(index_rope_interleave=True),
    INDEXED | dict(index_shared_layers=[1]),  # GLM-5: the second layer keeps the keys the first chose
    MAMBA | dict(mamba_groups=2, mamba_norm_groups=2, mamba_conv_bias=True, mamba_proj_bias=True, mamba_dt_max=0.5),
    MAMBA1 | dict(mamba_conv_bias=True, mamba_conv_kernel=3, nope_layers=[1]),  # Jamba: attention without RoPE
    # Nemotron-H: a Mamba layer alone, an MoE alone, un-gated relu2 experts and MLPs with a shared expert
    MAMBA | dict(layer_types=["mamba", "none"], mixer_only_layers=[0], activation="relu2", shared_expert_size=8),
    GQA | dict(num_layers=3, layer_types=["full", "none", "none"], moe_layers=[1], mixer_only_layers=[0]),
    GQA | dict(activation="relu2"),
    GQA | dict(zero_experts=4, top_k=3, score_correction_bias=True),  # LongCat-Flash's zero-computation experts
    # JetMoE: a mixture of attention heads (2 KV heads x top_k 2) with an output bias, MoE layers with one
    GQA | dict(attention="moa", num_heads=4, o_bias=True, moe_layers=[0, 1], moe_output_bias=True, final_norm_eps=1e-5),
    # LongCat-Flash's layer pair: the MoE output carried past the second layer, latent attention's parts scaled
    MLA | dict(q_lora_rank=8, mla_lora_scale=True, moe_layers=[0], moe_shortcut=True, zero_experts=2),
    # both kinds in one model share the state / conv fields
    MAMBA | dict(num_layers=3, layer_types=["mamba", "mamba1", "full"], mamba_inner_size=8, mamba_dt_rank=2),
    # Laguna: heads per layer, softplus gates per head, a RoPE of the sliding layers' own, a capped router
    GQA
    | dict(
        layer_types=["sliding", "full"],
        sliding_window=4,
        layer_heads=[2, 4],
        attn_gate="head",
        attn_gate_act="softplus",
        sliding_rope=RopeConfig(theta=500.0),
        sliding_rope_dim=2,
        router_softcap=5.0,
    ),  # fmt: skip
    GQA | dict(attn_gate="element", norm_placement="sandwich"),  # AFMoE: sigmoid gates per channel, sandwich norms
    GQA | dict(moe_output_norm=True),  # A.X-K1: a norm after the MoE block
    # MiMo-V2-Flash: twice the KV heads in the sliding layer, its sinks alone, values of 2 dims scaled
    GQA
    | dict(
        layer_types=["sliding", "full"],
        sliding_window=4,
        sliding_kv_heads=4,
        attention_sinks=True,
        sinks_sliding_only=True,
        v_head_dim=2,
        attn_value_scale=0.5,
    ),  # fmt: skip
    # Cohere2-MoE: a parallel block of LayerNorms without bias, the shared expert averaged in, interleaved pairs
    GQA | dict(norm="layer_nobias", norm_placement="parallel", shared_expert_size=8, shared_combine="average"),
    # Llama 4: a chunked layer beside a NoPE one with temperature tuning, the q/k norm without weights, the gate
    # weight on the one expert's input
    GQA
    | dict(
        layer_types=["chunked", "full"],
        attention_chunk=2,
        nope_layers=[1],
        attn_temperature_scale=0.1,
        attn_temperature_floor=2,
        qk_norm="l2",
        top_k=1,
        router_weight_on_input=True,
        rope_interleave=True,
    ),  # fmt: skip
    # Gemma 4: sliding layers of half the full ones' head size and twice their KV heads, a proportional RoPE on the
    # full layer, its values its keys, normed values, GELU-tanh MLPs, the MoE beside its MLP, capped logits
    GQA
    | dict(
        layer_types=["sliding", "full"],
        sliding_window=4,
        head_dim=8,
        sliding_head_dim=4,
        sliding_kv_heads=4,
        rope=RopeConfig(kind="proportional", proportion=0.25, theta=1e6),
        sliding_rope=RopeConfig(theta=1e4),
        attn_k_eq_v=True,
        v_norm=True,
        activation="gelu_tanh",
        norm_placement="sandwich",
        moe_beside_mlp=True,
        router_input_norm=True,
        router_expert_scale=True,
        layer_scale=True,
        final_logit_softcap=30.0,
    ),  # fmt: skip
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=range(len(ACCEPTED)))
def test_the_bases_are_accepted_and_build_a_model_that_runs(fields):
    """Every combination the audit accepts keeps its values and builds a model whose forward runs and routes."""
    cfg = ModelConfig(**fields)
    assert all(getattr(cfg, k) == v for k, v in fields.items())
    model = MoEModel(cfg, torch.float32)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(torch.randint(0, cfg.vocab_size, (2, 5)), capture=True)
    assert out.logits.shape == (2, 5, cfg.vocab_size) and out.logits.isfinite().all()
    assert out.routed.shape == (2, 5, len(cfg.route_layers()), cfg.top_k)  # JetMoE's: its attention's columns too
    assert ((out.routed >= 0) & (out.routed < cfg.num_experts + cfg.zero_experts)).all()  # zero experts: past E


@pytest.mark.parametrize(("base", "over", "name", "why"), REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_unimplemented_combinations_are_refused_by_name(base, over, name, why):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{name}=.*{why}"):
        ModelConfig(**(base | over))


def test_every_field_is_either_used_by_the_bases_or_refused_somewhere():
    """The audit is complete: each ModelConfig field is set by an accepted combination or a refused case."""
    covered = {k for fields in ACCEPTED for k in fields} | {k for _, over, *_ in REFUSED for k in over}
    # fields every value of which the decoder implements (no combination to refuse)
    free = {"max_position_embeddings", "tie_word_embeddings", "qkv_bias", "o_bias", "layer_types", "attn_scale"}
    free |= {"rope", "q_lora_rank", "router_bias", "expert_bias", "shared_expert_size", "swiglu_alpha", "activation"}
    free |= {"mlp_bias", "lm_head_bias"}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields - covered - free == set()


def test_unknown_hf_layer_types_are_refused_by_name():
    bridge = bridge_for_arch("qwen3_moe")
    from moerl.presets import preset

    hf = bridge.preset_config(preset("tiny"), 1, 2, 0)
    hf["layer_types"] = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"'layer_types' holds 'linear_attention' \(layer 1\); allowed: full_att"):
        bridge.config_from_hf(HFConfig(hf, "config.json"))


def test_a_proportional_ropes_share_is_checked():
    """Gemma 4's proportional RoPE: its share of each half-head lies in (0, 1], and no other kind takes one."""
    with pytest.raises(ConfigError, match=r"ModelConfig\.rope\.proportion=1\.5: must lie in \(0, 1\]"):
        ModelConfig(**GQA, rope=RopeConfig(kind="proportional", proportion=1.5))
    with pytest.raises(ConfigError, match=r"ModelConfig\.sliding_rope\.proportion set with kind='default'"):
        ModelConfig(
            **GQA | dict(layer_types=["sliding", "full"], sliding_window=4), sliding_rope=RopeConfig(proportion=0.5)
        )
