"""Tiny random models built by transformers from real architecture configs, saved as HF checkpoints.

The test oracle: transformers builds and runs these; moerl must load them and reproduce their numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moerl.bridges.prove import hf_forward

VOCAB = 128

# Real config fields of each family, shrunk: 2-4 layers, 8 experts, small hidden. Each one switches on the
# features of its family (dense layers, shared experts, sliding windows, sinks, MLA, YaRN, groups, clipping).
CONFIGS: dict[str, dict] = {
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        vocab_size=VOCAB,
    ),
    "Qwen2MoeForCausalLM": dict(
        model_type="qwen2_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=2,
        decoder_sparse_step=1,
        vocab_size=VOCAB,
    ),
    "MixtralForCausalLM": dict(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=6,
        vocab_size=VOCAB,
    ),
    "OlmoeForCausalLM": dict(
        model_type="olmoe",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        clip_qkv=3.0,
        vocab_size=VOCAB,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "DeepseekV3ForCausalLM": dict(
        model_type="deepseek_v3",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
        vocab_size=VOCAB,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
    "GptOssForCausalLM": dict(
        model_type="gpt_oss",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=VOCAB,
    ),
}
ARCHS = list(CONFIGS)
# the families added for issue 13 (Day-0 breadth): tested in tests/test_families.py, each switching its features on
NEW_CONFIGS = {
    "Ernie4_5_MoeForCausalLM": dict(  # interleaved rope, biases everywhere (tied head too), corrected softmax router
        model_type="ernie4_5_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_num_experts=8,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=1,
        use_bias=True,
        tie_word_embeddings=True,
        vocab_size=VOCAB,
    ),
    "HunYuanMoEV1ForCausalLM": dict(  # per-head q/k norms after the rotation, shared MLP, gate.wg
        model_type="hunyuan_v1_moe",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        moe_topk=2,
        vocab_size=VOCAB,
    ),
    "DeepseekV2ForCausalLM": dict(  # MLA, softmax router with group-limited greedy top-k, routed scaling
        model_type="deepseek_v2",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=2.0,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=VOCAB,
    ),
    "GraniteMoeForCausalLM": dict(  # embedding / residual / attention multipliers, logits scaling, fused experts
        model_type="granitemoe",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=6.0,
        vocab_size=VOCAB,
    ),
    "FlexOlmoForCausalLM": dict(  # post-sublayer norms, q/k norms over the whole projection
        model_type="flex_olmo",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "PhimoeForCausalLM": dict(  # LayerNorm with bias, lm_head and attention biases, sparsemixer routing
        model_type="phimoe",
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        attention_bias=True,
        lm_head_bias=True,
        vocab_size=VOCAB,
    ),
    # DBRX: its own field and tensor names, nested sub-configs, q / k / v fused and clipped, LayerNorms without bias,
    # each expert matrix flattened over the experts, the top-k renormalised (its L1 norm)
    "DbrxForCausalLM": dict(
        model_type="dbrx",
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=256,
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=1e4),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2),
        vocab_size=VOCAB,
    ),
    # LongCat-Flash: layers of two attention and two MLP sublayers with the MoE's output carried past the second, MLA
    # with its low-rank parts scaled, zero-computation experts, a selection-only bias, routed scaling
    "LongcatFlashForCausalLM": dict(
        model_type="longcat_flash",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        ffn_hidden_size=48,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        zero_expert_num=4,
        moe_topk=2,
        expert_ffn_hidden_size=32,
        routed_scaling_factor=6.0,
        vocab_size=VOCAB,
    ),
    # JetMoE: a mixture of attention heads (queries and outputs from routed attention experts over shared keys),
    # experts routed by a softmax over the k chosen logits, output biases on both blocks, tied embeddings
    "JetMoeForCausalLM": dict(
        model_type="jetmoe",
        hidden_size=64,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    ),
}
NEW_ARCHS = list(NEW_CONFIGS)
CONFIGS |= NEW_CONFIGS


def build_hf_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A transformers model of ``arch`` with every parameter random (norms near 1, biases and sinks nonzero)."""
    kwargs = dict(CONFIGS[arch]) | overrides
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if p.ndim >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:  # selection-only bias: make it matter
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return model.eval()


def save_hf_model(arch: str, path: Path, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    model = build_hf_model(arch, seed)
    model.save_pretrained(path, **save_kwargs)
    return model


def hf_router_choices(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, list]:
    """Logits and each MoE layer's chosen experts [N, k], read off the transformers routers (moerl's own helper,
    which the derived-bridge proof uses: routers are *Router / *Gate modules; it fails saying so when none)."""
    logits, choices, _ = hf_forward(model, input_ids, **kwargs)
    return logits, choices


# hybrid families: Gated DeltaNet linear-attention layers beside gated full attention (moerl.model.linear_attention)
HYBRID_CONFIGS = {
    "Qwen3_5MoeForCausalLM": dict(
        model_type="qwen3_5_moe_text",
        hidden_size=64,
        num_hidden_layers=4,  # linear, linear, linear, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
        vocab_size=VOCAB,
    ),
}
# Qwen3-Next: q/k/v/z and b/a projections fused per key head; a dense MLP layer
HYBRID_CONFIGS["Qwen3NextForCausalLM"] = HYBRID_CONFIGS["Qwen3_5MoeForCausalLM"] | dict(
    model_type="qwen3_next", intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False
)
HYBRID_ARCHS = list(HYBRID_CONFIGS)
CONFIGS |= HYBRID_CONFIGS

# 2026 families with no bridge file: the derived path (moerl.bridges.derive, prove) loads them from their config and
# tensor names alone. Each switches on knobs moerl has under that family's own names.
DERIVED_CONFIGS = {
    # GLM-4.5: DeepSeek-V3 routing (sigmoid, selection bias as a buffer, groups, scaling), per-head q/k norms behind
    # a use_qk_norm switch, partial RoPE, first layer dense, a multi-token-prediction layer count
    "Glm4MoeForCausalLM": dict(
        model_type="glm4_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.8,
        norm_topk_prob=True, use_qk_norm=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1,
        vocab_size=VOCAB,
    ),
    # GLM-4.7-Flash: latent attention with DeepSeek-V3 routing, dense / sparse layers listed per layer
    "Glm4MoeLiteForCausalLM": dict(
        model_type="glm4_moe_lite", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, vocab_size=VOCAB,
    ),
    # MiniMax-M2: sigmoid selection with the correction bias a buffer of the MoE block, q/k norms over the whole
    # projection, partial RoPE spelled rotary_dim, w1 / w3 / w2 experts
    "MiniMaxM2ForCausalLM": dict(
        model_type="minimax_m2", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
        scoring_func="sigmoid", vocab_size=VOCAB,
    ),
    # Granite-4-style muP: embedding / residual / attention multipliers, logits scaling, a shared dense MLP beside
    # the MoE block with its gate and up rows fused in one input_linear
    "GraniteMoeSharedForCausalLM": dict(
        model_type="granitemoeshared", hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=6.0, vocab_size=VOCAB,
    ),
    # EXAONE-MoE: three sliding-window layers then a full one that rotates nothing, dense first layer, a shared
    # expert, DeepSeek-V3 routing with the bias at the block
    "ExaoneMoeForCausalLM": dict(
        model_type="exaone_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=4, sliding_window_pattern=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=VOCAB,
    ),
    # HY-V3: the router under router.gate, its bias stored as expert_bias, the top-k always renormalised (no
    # field says so), router_scaling_factor, a shared MLP
    "HYV3ForCausalLM": dict(
        model_type="hy_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        mlp_layer_types=["dense", "sparse"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_shared_experts=1, num_experts_per_tok=2, router_scaling_factor=2.826, vocab_size=VOCAB,
    ),
    # Solar-Open: DeepSeek-V3 routing under its names, shared experts, grouped-query attention
    "SolarOpenForCausalLM": dict(
        model_type="solar_open", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        vocab_size=VOCAB,
    ),
    # GraniteMoeSWA: muP, a shared MLP, sliding layers beside full ones, sinks, a RoPE theta per layer (0: NoPE)
    "GraniteMoeSWAForCausalLM": dict(
        model_type="granitemoe_swa", hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25,
        logits_scaling=6.0, sliding_window=4, layer_rope_theta=[0, 10000.0, 10000.0, 10000.0], vocab_size=VOCAB,
    ),
    # DeepSeek-V3.2: latent attention (rotary pairs interleaved in code, no field says) narrowed by a lightning
    # indexer (its keys rotated in halves) that keeps 4 keys a query, DeepSeek-V3 routing, a dense first layer
    "DeepseekV32ForCausalLM": dict(
        model_type="deepseek_v32", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_topk=4, index_n_heads=16, index_head_dim=16, vocab_size=VOCAB,
    ),
}  # fmt: skip
# Granite-4.0-H: Mamba-2 layers (2 groups of B / C, conv bias, the gated norm over all channels) beside attention
# without RoPE, muP multipliers, a shared MLP beside fused experts
DERIVED_CONFIGS["GraniteMoeHybridForCausalLM"] = dict(
    model_type="granitemoehybrid", hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
    num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2,
    mamba_d_state=16, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=8, embedding_multiplier=12.0,
    residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=6.0, vocab_size=VOCAB,
)  # fmt: skip
# Jamba: Mamba-1 layers (a decay per channel and state dim, dt / B / C norms, the step's rank "auto") beside attention
# without RoPE, by period fields (attention every 4th from 2, experts every 2nd from 1), one block name for MLPs and MoE
DERIVED_CONFIGS["JambaForCausalLM"] = dict(
    model_type="jamba", hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=2,
    expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    vocab_size=VOCAB,
)  # fmt: skip
# Nemotron-H: layers of one block each (Mamba-2 with 2 B / C groups and its norm per group, MoE, attention without
# RoPE, a dense MLP), un-gated relu2 experts and MLPs, DeepSeek-V3 routing with a shared expert
DERIVED_CONFIGS["NemotronHForCausalLM"] = dict(
    model_type="nemotron_h", hidden_size=64, layers_block_type=["mamba", "moe", "attention", "mlp", "moe"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48, mamba_num_heads=4,
    mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, vocab_size=VOCAB,
)  # fmt: skip
# GLM-5: DeepSeek-V3.2's layers with the indexer's rotary pairs interleaved; its second layer has no indexer and keeps
# the keys the first one chose ("shared")
DERIVED_CONFIGS["GlmMoeDsaForCausalLM"] = DERIVED_CONFIGS["DeepseekV32ForCausalLM"] | dict(
    model_type="glm_moe_dsa", indexer_types=["full", "shared", "full"]
)
# Laguna: sliding layers with a RoPE of their own (all dims at theta 1e4) beside full ones (half the dims at 5e5), a
# head count per layer, softplus output gates of their own projection (one per head), router logits soft-capped at
# a cap the tiny router's logits exceed, sigmoid routing with a selection bias, a shared expert, a dense first layer
DERIVED_CONFIGS["LagunaForCausalLM"] = dict(
    model_type="laguna", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_attention_heads_per_layer=[4, 8, 2, 4], num_experts=8, num_experts_per_tok=2,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], sliding_window=4,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], moe_router_logit_softcapping=0.05, gating=True,
    vocab_size=VOCAB,
)  # fmt: skip
# AFMoE: sandwich norms (before and after attention and MLP), sigmoid output gates of their own projection per
# channel, sliding layers beside a full one, sigmoid routing with its expert_bias, shared experts, a dense first layer
DERIVED_CONFIGS["AfmoeForCausalLM"] = dict(
    model_type="afmoe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, num_shared_experts=1, route_scale=1.5, global_attn_every_n_layers=2, sliding_window=4,
    vocab_size=VOCAB,
)  # fmt: skip
# A.X-K1: DeepSeek-V3 (latent attention, interleaved rotary pairs, groups) with a norm after each MoE block alone
DERIVED_CONFIGS["AXK1ForCausalLM"] = dict(
    model_type="axk1", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, qk_head_dim=24,
    head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
    rope_interleave=True, vocab_size=VOCAB,
)  # fmt: skip
# Cohere2-MoE: a parallel block (attention and MLP of one LayerNorm without bias), interleaved rotary pairs, full
# layers without RoPE but its dense first one, the shared expert averaged with the routed ones, a softmax over the
# top-k logits, scaled logits, tied embeddings
DERIVED_CONFIGS["Cohere2MoeForCausalLM"] = dict(
    model_type="cohere2_moe", hidden_size=64, intermediate_size=32, prefix_dense_intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, num_shared_experts=1, shared_expert_combination_strategy="average",
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"], sliding_window=4,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], prefix_dense_sliding_window_pattern=1,
    logit_scale=0.25, vocab_size=VOCAB,
)  # fmt: skip
# MiMo-V2-Flash: sliding layers with twice the KV heads, sinks of their own and a RoPE of their own (a third of each
# head rotates), value heads smaller than the query / key heads and scaled, DeepSeek-V3 routing, a dense first layer
DERIVED_CONFIGS["MiMoV2FlashForCausalLM"] = dict(
    model_type="mimo_v2_flash", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, layer_types=["full_attention", "sliding_attention",
    "sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=4,
    attention_value_scale=0.5, vocab_size=VOCAB,
)  # fmt: skip
# Llama 4: chunked layers (chunks of 8) beside a NoPE full one with temperature tuning (a step every 4 positions), a
# unit-RMS q/k norm without weights on the RoPE layers, interleaved rotary pairs with llama3 scaling, sigmoid scores
# on the one chosen expert's input, a shared expert, a dense first layer of its own size, experts stored [E, H, 2I]
DERIVED_CONFIGS["Llama4ForCausalLM"] = dict(
    model_type="llama4_text", hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=1,
    moe_layers=[1, 2, 3], no_rope_layers=[1, 1, 0, 1], attention_chunk_size=8, attn_temperature_tuning=True,
    floor_scale=4, attn_scale=0.5, use_qk_norm=True, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    vocab_size=VOCAB,
)  # fmt: skip
# Gemma 4's MoE (26B-A4B's shape): sliding layers beside full ones of twice the head size, half the KV heads, values
# that are their keys and a proportional RoPE on a quarter of each half-head; normed values, unscaled scores, sandwich
# norms, GELU-tanh, the experts beside a dense MLP with the router's own norm and per-expert scale, a scalar per
# layer, embeddings times sqrt(H), capped logits
DERIVED_CONFIGS["Gemma4ForCausalLM"] = dict(
    model_type="gemma4_text", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], sliding_window=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
    attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2, hidden_size_per_layer_input=0,
    final_logit_softcapping=3.0, vocab_size=VOCAB,
)  # fmt: skip
DERIVED_ARCHS = list(DERIVED_CONFIGS)
CONFIGS |= DERIVED_CONFIGS
