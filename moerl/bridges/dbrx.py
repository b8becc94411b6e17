"""DBRX: its own names throughout (``d_model``, ``n_heads``, the ``attn_config`` / ``ffn_config`` sub-configs;
``transformer.blocks.{i}.norm_attn_norm.*``, ``ffn.*``), q / k / v fused in ``Wqkv`` and clipped, LayerNorms without
bias, and the experts' three matrices each flattened over the experts as [E * I, H] (``w1`` the gate rows, ``v1`` the
up rows, ``w2`` the down projection transposed); the top-k weights renormalised by their L1 norm."""

import torch

from moerl.bridges.base import Bridge, Fused, HFConfig, Preset, Rule, common_preset
from moerl.errors import ConfigError
from moerl.model.config import ModelConfig, RopeConfig

ARCH = "DbrxForCausalLM"
BLOCK = "transformer.blocks.{i}"


def config_from_hf(c: HFConfig) -> ModelConfig:
    attn = HFConfig(c.opt("attn_config", dict) or {}, f"{c.source} attn_config")
    ffn = HFConfig(c.opt("ffn_config", dict) or {}, f"{c.source} ffn_config")
    act = (ffn.opt("ffn_act_fn", dict) or {}).get("name", "silu")
    if act != "silu":
        raise ConfigError(f"{ffn.source}: ffn_act_fn.name={act!r}: moerl's DBRX experts are SiLU-gated")
    p = ffn.data.get("moe_normalize_expert_weights", 1.0)
    if p not in (None, 1, 1.0):  # the L1 norm of positive weights is their sum; other norms are not built
        raise ConfigError(f"{ffn.source}: moe_normalize_expert_weights={p!r}: allowed: 1 (sum to 1) or null (none)")
    hidden, heads, n = c.req("d_model", int), c.req("n_heads", int), c.req("n_layers", int)
    if hidden % heads:
        raise ConfigError(f"{c.source}: d_model={hidden} is not a multiple of n_heads={heads}")
    # transformers 5 writes rope_parameters; DBRX's own configs keep the theta in attn_config
    rope = c.rope() if "rope_parameters" in c.data else RopeConfig(theta=attn.opt("rope_theta", float, 10000.0))
    return ModelConfig(
        vocab_size=c.req("vocab_size", int),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=attn.opt("kv_n_heads", int, heads),
        head_dim=hidden // heads,
        max_position_embeddings=c.opt("max_seq_len", int, 2048),
        rms_norm_eps=1e-5,  # torch's LayerNorm default: DBRX's norms take no eps
        tie_word_embeddings=c.opt("tie_word_embeddings", bool, False),
        rope=rope,
        norm="layer_nobias",
        clip_qkv=attn.opt("clip_qkv", float),
        intermediate_size=0,
        num_experts=ffn.req("moe_num_experts", int),
        top_k=ffn.opt("moe_top_k", int, 1),
        moe_intermediate_size=ffn.req("ffn_hidden_size", int),
        moe_layers=list(range(n)),
        norm_topk_prob=p is not None,
    )


def preset_config(p: Preset, bos: int, eos: int, pad: int) -> dict:
    if p.hidden_size != p.num_heads * p.head_dim:
        raise ConfigError(f"preset {p.name!r}: DBRX's heads are d_model / n_heads, not head_dim={p.head_dim}")
    base = common_preset(p, ARCH, "dbrx", bos, eos, pad)
    return {k: base[k] for k in ("architectures", "model_type", "vocab_size", "initializer_range")} | {
        "d_model": p.hidden_size,
        "n_heads": p.num_heads,
        "n_layers": p.num_layers,
        "max_seq_len": p.max_position_embeddings,
        "attn_config": {"kv_n_heads": p.num_kv_heads, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {
            "ffn_hidden_size": p.moe_intermediate_size,
            "moe_num_experts": p.num_experts,
            "moe_top_k": p.top_k,
            "moe_normalize_expert_weights": 1.0,
            "ffn_act_fn": {"name": "silu"},
        },
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def _experts(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[E * I, H] -> [E, I, H]: one expert's rows after another's."""
    return t.reshape(cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)


def _flat(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return t.reshape(-1, cfg.hidden_size)


def _down(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``w2`` [E * I, H] -> moerl's down_proj [E, H, I]."""
    return _experts(t, cfg).transpose(1, 2).contiguous()


def _w2(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, cfg.hidden_size)


def _split_qkv(t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    kv = cfg.num_kv_heads * cfg.head_dim
    return list(t.split([cfg.num_heads * cfg.head_dim, kv, kv]))


ATTN = f"{BLOCK}.norm_attn_norm"
MOE = f"{BLOCK}.ffn"
BRIDGE = Bridge(
    architectures=(ARCH,),
    model_type="dbrx",
    config_from_hf=config_from_hf,
    preset_config=preset_config,
    rules=(
        Rule("transformer.wte.weight", "embed_tokens.weight"),
        Rule("transformer.norm_f.weight", "norm.weight"),
        Rule(f"{ATTN}.norm_1.weight", "layers.{i}.input_layernorm.weight"),
        Rule(f"{ATTN}.norm_2.weight", "layers.{i}.post_attention_layernorm.weight"),
        Rule(f"{ATTN}.attn.out_proj.weight", "layers.{i}.self_attn.o_proj.weight"),
        Rule(f"{MOE}.router.layer.weight", "layers.{i}.mlp.router.weight"),
        Rule(f"{MOE}.experts.mlp.w1", "layers.{i}.mlp.experts.gate_up_proj", part="gate", load=_experts, save=_flat),
        Rule(f"{MOE}.experts.mlp.v1", "layers.{i}.mlp.experts.gate_up_proj", part="up", load=_experts, save=_flat),
        Rule(f"{MOE}.experts.mlp.w2", "layers.{i}.mlp.experts.down_proj", load=_down, save=_w2),
    ),
    fused=(
        Fused(
            f"{ATTN}.attn.Wqkv.weight",
            tuple(f"model.layers.{{i}}.self_attn.{m}_proj.weight" for m in "qkv"),
            split=_split_qkv,
            join=lambda parts, cfg: torch.cat(parts),
        ),
    ),
    peft_experts=f"{MOE}.experts.mlp",
)
