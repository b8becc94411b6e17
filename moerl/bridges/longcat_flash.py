"""LongCat-Flash: each of its layers is two moerl layers (``ModelConfig.moe_shortcut``). HF layer i holds two attention
sublayers (``self_attn.{0,1}``, moerl layers 2i and 2i + 1), two dense MLPs (``mlps.{0,1}``) and one MoE (``mlp``)
that runs beside the first dense MLP and joins the residual stream after the second sublayer. The MoE is a softmax
router over its experts and zero-computation experts (``classifier``), a selection-only bias, the top-k weights
scaled, not renormalised; its attention is MLA with a low-rank query, rotary pairs interleaved and the low-rank parts
scaled by sqrt(hidden / rank) (``ModelConfig.mla_lora_scale``)."""

import re

import torch

from moerl.bridges.base import Bridge, HFConfig, Preset, Rule, common_preset
from moerl.bridges.shared import mla_fields, mla_preset
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

ARCH = "LongcatFlashForCausalLM"
LAYER = "model.layers.{i}"


def config_from_hf(c: HFConfig) -> ModelConfig:
    pairs, hidden, heads = c.req("num_layers", int), c.req("hidden_size", int), c.req("num_attention_heads", int)
    rope = c.rope()
    rope_dim = c.req("qk_rope_head_dim", int)
    if c.opt("head_dim", int, rope_dim) != rope_dim:  # transformers' rotary table takes head_dim's size
        raise ConfigError(
            f"{c.source}: field 'head_dim'={c.data['head_dim']} differs from qk_rope_head_dim={rope_dim}: "
            "transformers rotates LongCat-Flash's queries and keys by a table of head_dim's size"
        )
    if not c.opt("q_lora_rank", int):
        raise ConfigError(f"{c.source}: field 'q_lora_rank' is missing: LongCat-Flash's queries are low-rank")
    act = c.opt("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"{c.source}: field 'hidden_act' is {act!r}; LongCat-Flash's MLPs and experts allow: silu")
    if c.opt("mla_scale_q_lora", bool, True) is False or c.opt("mla_scale_kv_lora", bool, True) is False:
        raise ConfigError(f"{c.source}: unscaled low-rank attention parts (mla_scale_*_lora false): not built")
    zero = c.opt("zero_expert_type", str, "identity")
    if zero != "identity":  # a zero-computation expert returns its input, times its gate weight
        raise ConfigError(
            f"{c.source}: field 'zero_expert_type' is {zero!r}; moerl's zero-computation experts allow: identity"
        )
    return ModelConfig(
        vocab_size=c.req("vocab_size", int),
        hidden_size=hidden,
        num_layers=2 * pairs,
        num_heads=heads,
        num_kv_heads=heads,  # every head its own keys and values from the latent
        head_dim=rope_dim,  # as DeepSeek's configs give it: the rotary dims (latent attention sizes its heads itself)
        max_position_embeddings=c.opt("max_position_embeddings", int, 4096),
        rms_norm_eps=c.opt("rms_norm_eps", float, 1e-5),
        tie_word_embeddings=c.opt("tie_word_embeddings", bool, False),
        rope=rope,
        **mla_fields(c, rope, rope_interleave=True),
        mla_lora_scale=True,
        intermediate_size=c.first(("ffn_hidden_size", "intermediate_size"), int),
        num_experts=c.first(("n_routed_experts", "num_local_experts"), int),
        zero_experts=c.opt("zero_expert_num", int, 0),
        top_k=c.first(("moe_topk", "num_experts_per_tok"), int),
        moe_intermediate_size=c.first(("expert_ffn_hidden_size", "moe_intermediate_size"), int),
        moe_layers=list(range(0, 2 * pairs, 2)),
        moe_shortcut=True,
        score_correction_bias=True,
        norm_topk_prob=False,
        routed_scaling_factor=c.opt("routed_scaling_factor", float, 1.0),
        router_bias=c.opt("router_bias", bool, False),
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    if p.num_layers % 2:
        raise ConfigError(f"preset {p.name!r}: LongCat-Flash's layers come in pairs, not {p.num_layers}")
    base = common_preset(p, ARCH, "longcat_flash", bos, eos, pad)
    del base["num_hidden_layers"], base["num_experts_per_tok"]
    mla = mla_preset(p) | {"head_dim": p.head_dim // 2}  # the rotary dims (qk_rope_head_dim)
    return (
        base
        | mla
        | {
            "num_layers": p.num_layers // 2,
            "ffn_hidden_size": p.intermediate_size,
            "expert_ffn_hidden_size": p.moe_intermediate_size,
            "n_routed_experts": p.num_experts,
            "zero_expert_num": max(1, p.num_experts // 2),
            "moe_topk": p.top_k,
            "routed_scaling_factor": 6.0,
            "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
        }
    )


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """transformers' stacked gate_up holds rows for the zero-computation experts too, which compute nothing: their
    gate / up tensors are not loaded; nor the multi-token-prediction layer (``model.mtp.*``)."""
    if name.startswith("model.mtp."):
        return True
    m = re.match(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up)_proj\.weight$", name)
    return m is not None and int(m.group(1)) >= cfg.num_experts


def _zero_expert_rows(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Zero gate / up matrices for the zero-computation experts: transformers' model stacks [E + Z, 2I, H] and
    refuses a checkpoint with fewer (they compute nothing, so zeros give its function)."""
    out = {}
    for name, t in tensors.items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.0\.(gate|up)_proj\.weight$", name)
        if m is not None:
            for e in range(cfg.num_experts, cfg.num_experts + cfg.zero_experts):
                out[f"{m.group(1)}.{e}.{m.group(2)}_proj.weight"] = torch.zeros_like(t)
    return out


def _sublayers(j: int) -> tuple[Rule, ...]:
    """Sublayer ``j`` of every HF layer is moerl layer 2i + j."""
    dense = "dense_mlp" if j == 0 else "mlp"  # the first sublayer's MLP sits beside the MoE
    return tuple(
        Rule(f"{LAYER}.{hf}", f"layers.{{i}}.{ours}", stride=2, offset=j)
        for hf, ours in (
            (f"self_attn.{j}.{{x}}", "self_attn.{x}"),
            (f"input_layernorm.{j}.weight", "input_layernorm.weight"),
            (f"post_attention_layernorm.{j}.weight", "post_attention_layernorm.weight"),
            (f"mlps.{j}.{{x}}", f"{dense}.{{x}}"),
        )
    )


MOE = f"{LAYER}.mlp"
BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="longcat_flash",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        *_sublayers(0),
        *_sublayers(1),
        Rule(f"{MOE}.router.classifier.weight", "layers.{i}.mlp.router.weight", stride=2),
        Rule(f"{MOE}.router.classifier.bias", "layers.{i}.mlp.router.bias", stride=2),
        Rule(f"{MOE}.router.e_score_correction_bias", "layers.{i}.mlp.router.e_score_correction_bias", stride=2),
        Rule(f"{MOE}.experts.{{e}}.gate_proj.weight", "layers.{i}.mlp.experts.gate_up_proj", part="gate", stride=2),
        Rule(f"{MOE}.experts.{{e}}.up_proj.weight", "layers.{i}.mlp.experts.gate_up_proj", part="up", stride=2),
        Rule(f"{MOE}.experts.{{e}}.down_proj.weight", "layers.{i}.mlp.experts.down_proj", stride=2),
    ),
    ignore=_ignored,
    export_extra=_zero_expert_rows,
)
