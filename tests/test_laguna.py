"""Laguna, derived with no bridge file: a head count per layer, softplus output gates of their own projection (per head
and per channel), a RoPE per layer kind, router logits soft-capped. Parity with transformers at fp32 1e-4 (plain and
left-padded) with a control per knob, its own default config proven, the engine's decode against full forwards,
every training mode, and the bound CPU decode step refusing what it does not bind by name."""

import pytest
import torch
from hf_models import build_hf_model, hf_router_choices
from mixer_checks import FP32_TOL, assert_left_padded_rows_match, assert_trains, model_with, moved, token_ids

from moerl.bridges import load_model

ARCH = "LagunaForCausalLM"


def _checkpoint(path, **overrides):
    """The tiny Laguna of ``hf_models`` saved to ``path`` with sharper attention (where RoPE goes shows) and output
    gates and routers whose logits matter; returns (path, the transformers model)."""
    hf = build_hf_model(ARCH, **overrides)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
            elif name.endswith(("g_proj.weight", "mlp.gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module", params=[True, "per-element"], ids=["per-head", "per-element"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("laguna") / ARCH, gating=request.param)


def test_laguna_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens: logits within fp32 1e-4 of transformers, the same experts chosen. Each knob set wrong misses:
    the router's cap, the gates' softplus (as sigmoid), the gates' weights, the sliding layers' own RoPE (as the full
    ones'); the heads per layer are refused by shape."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert cfg.layer_heads == [4, 8, 2, 4] and cfg.router_softcap == 0.05 and cfg.attn_gate_act == "softplus"
    assert cfg.attn_gate == ("head" if hf.config.gating is True else "element")
    assert cfg.sliding_rope.theta == 1e4 and cfg.rope.theta == 5e5 and (cfg.rope_dim, cfg.sliding_rope_dim) == (8, None)
    ids = token_ids()
    want, choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        out = model(ids, capture=True)
    assert (out.logits - want).abs().max() <= FP32_TOL
    for j, choice in enumerate(choices):
        ours = out.routed[:, :, j].reshape(-1, cfg.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values), f"MoE layer {j} chose other experts"
    for fields in ({"router_softcap": 0.0}, {"attn_gate_act": "sigmoid"}, {"sliding_rope": None}):
        with torch.no_grad():
            assert (model_with(model, **fields)(ids).logits - want).abs().max() > FP32_TOL, fields
    gates = [layer.self_attn.gate_proj.weight for layer in model.layers]
    assert moved(model, ids, want, lambda: [g.mul_(0.5) for g in gates]) > FP32_TOL
    with pytest.raises(RuntimeError, match=r"layers\.1\.self_attn\.q_proj\.weight"):
        model_with(model, layer_heads=[])


def test_left_padded_rows_match_transformers(checkpoint):
    """A left-padded row (its positions from 0 at its first token) and a full one: every real token's logits
    within fp32 1e-4 of transformers given the same mask and positions."""
    path, hf = checkpoint
    assert_left_padded_rows_match(load_model(path, dtype=torch.float32), hf)


def test_lagunas_own_default_config_is_derived_and_proved():
    """transformers' Laguna defaults (40 layers of 48 heads, full attention, no cap) pass the proof, and so does a
    config with every knob on at the checkpoint's head counts."""
    from test_derived import _default_config

    from moerl.bridges.prove import prove

    bridge, _, layout = prove(_default_config("laguna"))
    assert bridge.architectures == (ARCH,) and layout.gate_proj == "g_proj" and layout.gate_kind == "head"
    n = 40
    knobs = dict(
        layer_types=["sliding_attention", "full_attention"] * (n // 2),
        num_attention_heads_per_layer=[48, 32] * (n // 2),
        moe_router_logit_softcapping=0.05,
        gating="per-element",
    )
    _, _, layout = prove(_default_config("laguna", **knobs))
    assert layout.gate_kind == "element"


def test_the_engine_decodes_laguna_as_its_full_forward(checkpoint):
    """The engine's paged decode with two RoPE tables, heads per layer and gates: each sampled token's logprobs and
    experts as a full forward of the finished sequence gives them (k3 <= 1e-6 fp32, routing equal)."""
    from test_engine import engine_vs_full_forward

    from moerl.engine import EngineConfig, LLMEngine

    config = EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8)
    kl, routed_ok = engine_vs_full_forward(LLMEngine(checkpoint[0], config, torch.float32))
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_laguna_trains_in_every_mode(mode, tmp_path):
    """Ten SFT steps on one batch lower the loss in each mode; LoRA puts adapters on the gates' own projection."""
    assert_trains(_checkpoint(tmp_path / ARCH)[0], mode, "layers.1.self_attn.gate_proj.lora.lora_A")


def test_the_bound_decode_step_and_vllm_refuse_lagunas_knobs_by_name(checkpoint):
    """The CPU backend's bound decode step rotates by one table and binds no output gate: it names what it does not
    bind, layer by layer (the engine then runs the modules); vLLM's CPU attention has no kernel for its heads of 16
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
    assert _layer_refusal(model.layers[0], torch.float32) == "not attention then a MoE"  # its dense first layer
    assert _layer_refusal(model.layers[1], torch.float32) == "an attention output gate, or clipped q / k / v"
    assert _layer_refusal(model.layers[2], torch.float32) == "a RoPE of the sliding layers' own"
    with pytest.raises(ConfigError, match=rf"engine=vllm with {ARCH} .*heads of size \[16\]: vLLM's CPU attention"):
        make_engine("vllm", checkpoint[0], EngineConfig())
