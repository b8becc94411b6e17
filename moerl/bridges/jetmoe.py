"""JetMoE: a mixture of attention heads (``ModelConfig.attention`` "moa"): each layer's attention routes its queries
and outputs to ``num_experts_per_tok`` of ``num_local_experts`` attention experts (``self_attention.experts``: query
projections ``input_linear`` [E, kv_heads * kv_channels, H], output projections ``output_linear``, a router and an
output bias) over keys and values they share (``kv_proj``, k rows then v rows); its MoE routes the same way (the
softmax over the k chosen logits) to experts stacked as ``input_linear`` [E, 2I, H] / ``output_linear`` [E, H, I]
with an output bias. Query heads are kv_heads x top_k. transformers norms the layers at eps 1e-6 whatever
``rms_norm_eps`` says, the final norm at it."""

import torch

from moerl.bridges.base import Bridge, Fused, HFConfig, Preset, Rule, common_preset
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

ARCH = "JetMoeForCausalLM"
LAYER_NORM_EPS = 1e-6  # JetMoeRMSNorm's default: the decoder layers' norms take no eps from the config


def config_from_hf(c: HFConfig) -> ModelConfig:
    hidden, kv_heads, k = (
        c.req("hidden_size", int),
        c.req("num_key_value_heads", int),
        c.req("num_experts_per_tok", int),
    )
    act = c.opt("activation_function", str, "silu")
    if act != "silu":
        raise ConfigError(f"{c.source}: field 'activation_function' is {act!r}; JetMoE's experts allow: silu")
    heads = c.opt("num_attention_heads", int, kv_heads * k)
    if heads != kv_heads * k:  # transformers sets it so; a config that says otherwise describes another model
        raise ConfigError(
            f"{c.source}: field 'num_attention_heads'={heads}: JetMoE's query heads are num_key_value_heads x "
            f"num_experts_per_tok={kv_heads * k}"
        )
    n = c.req("num_hidden_layers", int)
    return ModelConfig(
        vocab_size=c.req("vocab_size", int),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=c.req("kv_channels", int),
        max_position_embeddings=c.opt("max_position_embeddings", int, 4096),
        rms_norm_eps=LAYER_NORM_EPS,
        final_norm_eps=c.opt("rms_norm_eps", float, LAYER_NORM_EPS),
        tie_word_embeddings=c.opt("tie_word_embeddings", bool, True),
        rope=c.rope(),
        attention="moa",
        o_bias=True,
        intermediate_size=0,
        num_experts=c.first(("num_local_experts", "num_experts"), int),
        top_k=k,
        moe_intermediate_size=c.req("intermediate_size", int),
        moe_layers=list(range(n)),
        topk_before_softmax=True,
        moe_output_bias=True,
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    base = common_preset(p, ARCH, "jetmoe", bos, eos, pad)
    for key in ("num_attention_heads", "head_dim", "hidden_act", "num_experts_per_tok"):
        base.pop(key)
    return base | {
        "num_key_value_heads": p.num_kv_heads,
        "kv_channels": p.head_dim,
        "num_experts_per_tok": p.top_k,
        "num_local_experts": p.num_experts,
        "intermediate_size": p.moe_intermediate_size,
        "activation_function": "silu",
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    }


def _split_kv(t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    return list(t.chunk(2))


ATTN, MOE = "model.layers.{i}.self_attention", "model.layers.{i}.mlp"
BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="jetmoe",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule(f"{ATTN}.experts.input_linear.weight", "layers.{i}.self_attn.experts.q_proj"),
        Rule(f"{ATTN}.experts.output_linear.weight", "layers.{i}.self_attn.experts.o_proj"),
        Rule(f"{ATTN}.experts.router.layer.weight", "layers.{i}.self_attn.router.weight"),
        Rule(f"{ATTN}.experts.bias", "layers.{i}.self_attn.bias"),
        Rule(f"{MOE}.input_linear.weight", "layers.{i}.mlp.experts.gate_up_proj"),
        Rule(f"{MOE}.output_linear.weight", "layers.{i}.mlp.experts.down_proj"),
        Rule(f"{MOE}.router.layer.weight", "layers.{i}.mlp.router.weight"),
    ),
    fused=(
        Fused(
            f"{ATTN}.kv_proj.weight",
            ("model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
            split=_split_kv,
            join=lambda parts, cfg: torch.cat(parts),
        ),
    ),
    peft_experts=None,  # transformers' experts: a module per projection, not one PEFT's target_parameters address
)
