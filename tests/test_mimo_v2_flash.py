"""MiMo-V2-Flash, derived with no bridge file: sliding layers with twice the KV heads, sinks and a RoPE of their own,
value heads smaller than the query and key heads and scaled. Parity with transformers at fp32 1e-4 (plain and
left-padded) with a control per knob, its own default config proven, the engine's paged decode (pools of two head
counts, values of their own size) against full forwards, every training mode, and the bound CPU decode step refusing
what it does not bind by name."""

import dataclasses

import pytest
import torch
from hf_models import build_hf_model
from mixer_checks import (
    FP32_TOL,
    assert_left_padded_rows_match,
    assert_matches_transformers,
    assert_trains,
    moved,
    token_ids,
)

from moerl.bridges import load_model
from moerl.model.transformer import MoEModel

ARCH = "MiMoV2FlashForCausalLM"


def _checkpoint(path):
    """The tiny MiMo-V2-Flash of ``hf_models`` with sharp attention (where RoPE goes shows) and sinks that matter,
    saved to ``path``; returns (path, the transformers model)."""
    hf = build_hf_model(ARCH)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("mimo") / ARCH)


def test_mimo_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens: logits within fp32 1e-4 of transformers, the same experts chosen. Each knob set wrong misses: the
    value scale, the sliding layers' own RoPE, the sinks (zeroed); the KV heads and the value heads of their own size
    are refused by shape."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert (cfg.num_kv_heads, cfg.sliding_kv_heads, cfg.v_head_dim, cfg.attn_value_scale) == (2, 4, 16, 0.5)
    assert cfg.attention_sinks and cfg.sinks_sliding_only and cfg.sliding_rope.theta == 1e4
    assert [layer.self_attn.sinks is not None for layer in model.layers] == [False, True, True, False]
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)
    for fields in ({"attn_value_scale": 1.0}, {"sliding_rope": None, "sliding_rope_dim": None}):
        off = MoEModel(dataclasses.replace(cfg, **fields), torch.float32)
        off.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (off(ids).logits - want).abs().max() > FP32_TOL, fields
    sinks = [layer.self_attn.sinks for layer in model.layers if layer.self_attn.sinks is not None]
    assert moved(model, ids, want, lambda: [s.zero_() for s in sinks]) > FP32_TOL
    for fields, tensor in (
        ({"sliding_kv_heads": 0}, "layers.1.self_attn.k_proj.weight"),
        ({"v_head_dim": 0}, "v_proj"),
    ):
        with pytest.raises(RuntimeError, match=tensor):
            MoEModel(dataclasses.replace(cfg, **fields), torch.float32).load_state_dict(model.state_dict())


def test_left_padded_rows_match_transformers(checkpoint):
    """A left-padded row (its positions from 0 at its first token) and a full one: every real token's logits within
    fp32 1e-4 of transformers given the same mask and positions."""
    path, hf = checkpoint
    assert_left_padded_rows_match(load_model(path, dtype=torch.float32), hf)


def test_mimos_own_default_config_is_derived_and_proved():
    """transformers' MiMo-V2-Flash defaults (48 layers, 4 KV heads and 8 in the sliding ones, heads of 192 with
    values of 128, a third of each head rotated) pass the proof and derive at the checkpoint's size."""
    from test_derived import _default_config

    from moerl.bridges.base import HFConfig
    from moerl.bridges.prove import prove

    hf = _default_config("mimo_v2_flash")
    bridge, _, layout = prove(hf)
    cfg = bridge.config_from_hf(HFConfig(hf, "mimo_v2_flash"))
    assert layout.sinks_sliding_only and layout.sliding_kv_factor == 2
    assert (cfg.sliding_kv_heads, cfg.v_head_dim, cfg.rope_dim, cfg.sliding_rope_dim) == (8, 128, 64, 64)


def test_the_engine_decodes_mimo_as_its_full_forward(checkpoint):
    """The engine's paged decode with pools of two head counts and values of their own size: each sampled token's
    logprobs and experts as a full forward of the finished sequence gives them (k3 <= 1e-6 fp32, routing equal)."""
    from test_engine import engine_vs_full_forward

    from moerl.engine import EngineConfig, LLMEngine

    config = EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(checkpoint[0], config, torch.float32)
    assert [tuple(engine.cache.v[i].shape[::2]) for i in range(4)] == [(2, 16), (4, 16), (4, 16), (2, 16)]
    kl, routed_ok = engine_vs_full_forward(engine)
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_mimo_trains_in_every_mode(mode, tmp_path):
    """Ten SFT steps on one batch lower the loss in each mode; full fine-tuning moves the sinks too."""
    path, _ = _checkpoint(tmp_path / ARCH)
    policy = assert_trains(path, mode)
    if mode == "full":
        start = load_model(path, dtype=torch.float32).layers[1].self_attn.sinks
        assert (policy.model.layers[1].self_attn.sinks.detach().float() - start).abs().max() > 1e-3


def test_the_bound_decode_step_refuses_mimos_knobs_by_name(checkpoint):
    """The CPU backend's bound decode step reads values of the keys' size, unscaled: it names what it does not
    bind (the engine then runs the modules)."""
    from moerl.cpu import install
    from moerl.cpu.direct import _layer_refusal
    from moerl.cpu.kernels import kernel

    if kernel() is None:
        pytest.skip("the CPU backend's kernels do not build on this host")
    model = load_model(checkpoint[0], dtype=torch.float32)
    install(model)
    assert _layer_refusal(model.layers[1], torch.float32) == "a RoPE of the sliding layers' own"
    assert _layer_refusal(model.layers[3], torch.float32) == "value heads of their own size, or scaled values"
