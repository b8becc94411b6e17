"""Gemma 4's MoE, derived with no bridge file: the experts beside a dense MLP (each with its norms, the router its own
unit-RMS input scale and a scale per expert), full layers of their own head size and KV heads whose values are their
keys, a proportional RoPE, normed values with unscaled scores, GELU-tanh, a scalar per layer, embeddings times
sqrt(H), capped logits. Parity with transformers at fp32 1e-4 (plain and left-padded) with a control per knob, its own
default config proven, the multimodal checkpoint's language model, the engine's decode against full forwards, every
training mode, and the bound CPU decode step refusing it by name."""

import dataclasses

import pytest
import torch
from hf_models import DERIVED_CONFIGS, build_hf_model
from mixer_checks import (
    FP32_TOL,
    assert_left_padded_rows_match,
    assert_matches_transformers,
    assert_trains,
    model_with,
    token_ids,
)

from moerl.bridges import load_model
from moerl.model.transformer import MoEModel

ARCH = "Gemma4ForCausalLM"


def _sharpen(hf) -> None:
    """Sharper attention (where RoPE goes shows), routers whose logits matter, a scalar per layer away from 1."""
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
            elif name.endswith(("router.proj.weight", "router.scale")):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 2 else 1.0) + (p.ndim == 1))
            elif name.endswith("per_expert_scale"):
                p.copy_(1.0 + torch.rand(p.shape, generator=gen))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def _checkpoint(path, **overrides):
    """The tiny Gemma 4 of ``hf_models``, sharpened, saved to ``path``; returns (path, the transformers model)."""
    hf = build_hf_model(ARCH, **overrides)
    _sharpen(hf)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("gemma4") / ARCH)


def _moved(model: MoEModel, ids, want, suffix: str) -> float:
    """How far the logits move from ``want`` with every parameter or buffer named ``*suffix`` times 1.5."""
    tensors = [t for n, t in [*model.named_parameters(), *model.named_buffers()] if n.endswith(suffix)]
    assert tensors, suffix
    with torch.no_grad():
        for t in tensors:
            t.mul_(1.5)
        off = model(ids).logits
        for t in tensors:
            t.div_(1.5)
    return float((off - want).abs().max())


def test_gemma4_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens: logits within fp32 1e-4 of transformers, the same experts chosen. Each knob set wrong misses: the
    embedding scale, the values' norm, the scores' scale, the logits' cap, GELU-tanh (as SiLU), the proportional RoPE
    (every frequency kept), and each learned tensor of the block moved: the scalar per layer, the router's input scale
    and scale per expert, the norms in and out of the MLP and the experts; values of their own projection and one head
    size for all layers are refused by name."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert (cfg.head_dim, cfg.sliding_head_dim, cfg.num_kv_heads, cfg.sliding_kv_heads) == (32, 16, 1, 2)
    assert cfg.attn_k_eq_v and cfg.v_norm and cfg.attn_scale == 1.0 and cfg.embedding_multiplier == 64**0.5
    assert cfg.rope.kind == "proportional" and cfg.rope.proportion == 0.25 and cfg.rope_dim is None
    assert cfg.moe_beside_mlp and cfg.router_input_norm and cfg.router_expert_scale and cfg.layer_scale
    assert cfg.activation == "gelu_tanh" and cfg.final_logit_softcap == 3.0 and cfg.norm_placement == "sandwich"
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)
    for fields in (
        {"embedding_multiplier": 1.0},
        {"v_norm": False},
        {"attn_scale": None},
        {"final_logit_softcap": 0.0},
        {"activation": "silu"},
        {"rope": dataclasses.replace(cfg.rope, kind="default", proportion=1.0)},
    ):
        with torch.no_grad():
            assert (model_with(model, **fields)(ids).logits - want).abs().max() > FP32_TOL, fields
    for suffix in (
        "layer_scalar",
        "router.input_scale",
        "router.expert_scale",
        "shared_input_norm.weight",
        "shared_output_norm.weight",
        "routed_input_norm.weight",
        "routed_output_norm.weight",
    ):
        assert _moved(model, ids, want, suffix) > FP32_TOL, suffix
    with pytest.raises(RuntimeError, match=r"layers\.1\.self_attn\.v_proj\.weight"):
        model_with(model, attn_k_eq_v=False)
    with pytest.raises(RuntimeError, match=r"layers\.0\.self_attn\.q_proj\.weight"):
        model_with(model, sliding_head_dim=0)


def test_left_padded_rows_match_transformers(checkpoint):
    """A left-padded row (its positions from 0 at its first token) and a full one: every real token's logits
    within fp32 1e-4 of transformers given the same mask and positions."""
    path, hf = checkpoint
    assert_left_padded_rows_match(load_model(path, dtype=torch.float32), hf)


def test_gemma4s_own_default_config_is_derived_and_proved():
    """transformers' Gemma 4 defaults with its MoE block on (26B-A4B's shape: 128 experts, top 8, full layers of
    512-dim heads and 2 KV heads whose values are their keys, capped logits) pass the proof; per-layer embeddings
    and KV-shared layers (its small dense models') are refused by name, as is a head size per full layer."""
    from test_derived import _default_config

    from moerl.bridges.base import HFConfig
    from moerl.bridges.prove import prove
    from moerl.errors import UnknownArchitectureError

    moe = dict(enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704)
    moe |= dict(attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)
    hf = _default_config("gemma4_text", **moe)  # transformers' spelling: per_layer_config, the full layers' heads
    hub = {k: v for k, v in hf.items() if k != "per_layer_config"} | dict(
        global_head_dim=512, num_global_key_value_heads=2
    )
    bridge, variant, layout = prove(hub)  # the hub's: global_head_dim, num_global_key_value_heads
    assert bridge.config_from_hf(HFConfig(hub, "config.json")).sliding_head_dim == 256
    hf["per_layer_config"] = {k: v | {"num_key_value_heads": 2} for k, v in hf["per_layer_config"].items()}
    bridge, variant, layout = prove(hf)
    assert variant["embed_sqrt"] and variant["unit_values"] and layout.layer_scalar and not layout.block
    cfg = bridge.config_from_hf(HFConfig(hf, "config.json"))
    assert (cfg.head_dim, cfg.sliding_head_dim, cfg.num_kv_heads, cfg.sliding_kv_heads) == (512, 256, 2, 4)
    assert cfg.num_layers == 30 and cfg.layer_types.count("full") == 5 and cfg.num_experts == 128
    for changes, feature in (
        ({"hidden_size_per_layer_input": 256}, "per-layer embeddings"),
        ({"num_kv_shared_layers": 10}, "reuse an earlier layer's keys and values"),
    ):
        with pytest.raises(UnknownArchitectureError, match=feature):
            prove(hf | changes)
    uneven = hf | {"per_layer_config": hf["per_layer_config"] | {"11": {"head_dim": 256, "num_key_value_heads": 2}}}
    with pytest.raises(UnknownArchitectureError, match="per_layer_config.*one of each for the full layers"):
        bridge.config_from_hf(HFConfig(uneven, "config.json"))


def test_the_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Gemma 4 as released (``Gemma4ForConditionalGeneration``: ``model.language_model.*`` beside the vision tower and
    its embedder): moerl loads the text model and skips the rest by name; fp32 logits of a text prompt within 1e-4 of
    transformers' multimodal model."""
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    text = {k: v for k, v in DERIVED_CONFIGS[ARCH].items() if k != "model_type"}
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = AutoConfig.for_model("gemma4", text_config=text, vision_config=vision | dict(intermediate_size=32))
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).eval()
    _sharpen(hf)
    hf.save_pretrained(tmp_path)
    ids = token_ids()
    model = load_model(tmp_path, torch.float32)
    assert model.hf_config["architectures"] == [ARCH]
    with torch.no_grad():
        assert (model(ids).logits - hf(input_ids=ids).logits).abs().max() <= FP32_TOL


def test_the_engine_decodes_gemma4_as_its_full_forward(checkpoint):
    """The engine's paged decode with pools of two head sizes and KV counts, values that are the keys, sliding windows
    of 4: each sampled token's logprobs and experts as a full forward of the finished sequence gives them (k3 <= 1e-6
    fp32, routing equal)."""
    from test_engine import engine_vs_full_forward

    from moerl.engine import EngineConfig, LLMEngine

    config = EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(checkpoint[0], config, torch.float32)
    assert [engine.cache.layer_pools(i)[0].shape[::2] for i in (0, 1)] == [(2, 16), (1, 32)]
    kl, routed_ok = engine_vs_full_forward(engine)
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_gemma4_trains_in_every_mode(mode, tmp_path):
    """Ten SFT steps on one batch lower the loss in each mode; LoRA puts adapters on the MLP beside the experts."""
    assert_trains(_checkpoint(tmp_path / ARCH)[0], mode, "layers.1.mlp.shared_experts.up_proj.lora.lora_A")


def test_the_bound_decode_step_and_vllm_refuse_gemma4_by_name(checkpoint):
    """The CPU backend's bound decode step binds no sandwich norms: it names what it does not bind (the engine then
    runs the modules); vLLM's CPU attention has no kernel for its heads of 16
    (tests/test_vllm.py serves the family at heads of 32)."""
    from moerl.cpu import install
    from moerl.cpu.direct import _layer_refusal
    from moerl.cpu.kernels import kernel
    from moerl.engine import EngineConfig
    from moerl.errors import ConfigError
    from moerl.rollout import make_engine

    if kernel() is None:
        pytest.skip("the CPU backend's kernels do not build on this host")
    model = load_model(checkpoint[0], dtype=torch.float32)
    install(model)
    assert (
        _layer_refusal(model.layers[1], torch.float32) == "not a pre-norm decoder layer without a residual multiplier"
    )
    assert model.layers[1].self_attn.bound_refusal(torch.float32) == "values that are the keys, or normed values"
    with pytest.raises(ConfigError, match=rf"engine=vllm with {ARCH} .*heads of size \[16\]: vLLM's CPU attention"):
        make_engine("vllm", checkpoint[0], EngineConfig())


def test_peft_export_of_gemma4s_adapters_reproduces_moerl_in_peft(checkpoint, tmp_path):
    """Adapters on o_proj and the experts (at the layer itself in transformers' Gemma 4, not under a block), written
    for PEFT: peft on the transformers model gives moerl's logits (fp32 1e-4), far from the base model's."""
    from test_export import peft_logits

    _, ours, theirs, plain = peft_logits(checkpoint[0], ["o_proj", "experts"], tmp_path / "adapter")
    assert (ours - theirs).abs().max() <= 1e-4 and (ours - plain).abs().max() > 1e-3
