"""Norms around the sublayers, derived with no bridge file: AFMoE's sandwich norms (before and after attention and
the MLP), A.X-K1's norm after each MoE block alone, Cohere2-MoE's parallel block (attention and MLP of one LayerNorm
without bias). Parity with transformers at fp32 1e-4 with a control per norm,
the engine's decode against full forwards, every training mode, and the bound CPU decode step refusing them by
name."""

import pytest
import torch
from hf_models import build_hf_model
from mixer_checks import FP32_TOL, assert_matches_transformers, moved, sft_losses, token_ids

from moerl.bridges import load_model

SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
NORMS = {
    "AfmoeForCausalLM": SANDWICH,
    "AXK1ForCausalLM": ("post_feedforward_layernorm",),
    "Cohere2MoeForCausalLM": ("input_layernorm",),
}
PLACEMENT = {"AfmoeForCausalLM": "sandwich", "AXK1ForCausalLM": "pre", "Cohere2MoeForCausalLM": "parallel"}


def _checkpoint(arch: str, path):
    """The tiny ``arch`` of ``hf_models`` with norms far from 1 (so that each one shows) saved to ``path``."""
    hf = build_hf_model(arch)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.5)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module", params=list(NORMS))
def checkpoint(request, tmp_path_factory):
    return (request.param, *_checkpoint(request.param, tmp_path_factory.mktemp("norms") / request.param))


def test_the_norms_match_transformers_with_a_control_per_norm(checkpoint):
    """40 tokens: logits within fp32 1e-4 of transformers, the same experts chosen; each norm's weight scaled moves
    the logits past the tolerance (the norm is applied where transformers applies it, not dropped)."""
    arch, path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert model.config.norm_placement == PLACEMENT[arch]
    assert model.config.moe_output_norm == (arch == "AXK1ForCausalLM")
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)
    for norm in NORMS[arch]:
        weights = [getattr(layer, norm).weight for layer in model.layers if hasattr(layer, norm)]
        assert weights, norm
        assert moved(model, ids, want, lambda w=weights: [x.mul_(1.5) for x in w]) > FP32_TOL, norm
    if arch == "AXK1ForCausalLM":  # the dense first layer has no such norm
        assert not hasattr(model.layers[0], "post_feedforward_layernorm")


def test_cohere2_moes_knobs_each_miss_when_set_wrong(tmp_path):
    """Cohere2-MoE at fp32 1e-4 of transformers (sharp attention, so that where RoPE goes shows); each of its knobs
    set wrong misses: the LayerNorm as RMSNorm, the rotary pairs in halves, RoPE on its full MoE layer (or none on
    its dense first one), the shared expert summed, the logits unscaled."""
    import dataclasses

    from moerl.model.transformer import MoEModel

    path, hf = _checkpoint("Cohere2MoeForCausalLM", tmp_path / "cohere2")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
    hf.save_pretrained(path)
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert (cfg.norm, cfg.rope_interleave, cfg.nope_layers) == ("layer_nobias", True, [3])
    assert (cfg.shared_combine, cfg.logits_scaling, cfg.topk_before_softmax) == ("average", 4.0, True)
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)
    wrong = [
        {"norm": "rms"},
        {"rope_interleave": False},
        {"nope_layers": []},
        {"nope_layers": [0, 3]},
        {"shared_combine": "sum"},
        {"logits_scaling": 1.0},
    ]
    for fields in wrong:
        off = MoEModel(dataclasses.replace(cfg, **fields), torch.float32)
        off.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (off(ids).logits - want).abs().max() > FP32_TOL, fields


def test_the_engine_decodes_them_as_their_full_forward(checkpoint):
    """Each sampled token's logprobs and experts as a full forward of the finished sequence gives them (k3 <= 1e-6
    fp32, routing equal)."""
    from test_engine import engine_vs_full_forward

    from moerl.engine import EngineConfig, LLMEngine

    config = EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8)
    kl, routed_ok = engine_vs_full_forward(LLMEngine(checkpoint[1], config, torch.float32))
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
@pytest.mark.parametrize("arch", list(NORMS))
def test_they_train_in_every_mode(arch, mode, tmp_path):
    """Ten SFT steps on one batch lower the loss in each mode; full fine-tuning moves the norms too (LayerNorm
    without bias: its weight)."""
    if mode == "mxfp8":
        pytest.importorskip("torchao")
    path, _ = _checkpoint(arch, tmp_path / arch)
    losses, policy = sft_losses(path, mode)
    assert losses[-1] < (losses[0] - 0.1 if mode == "lora" else 0.85 * losses[0]), losses
    if mode == "full":  # the norms train with the rest
        norm = NORMS[arch][-1]
        start = getattr(load_model(path, dtype=torch.float32).layers[1], norm).weight
        now = getattr(policy.model.layers[1], norm).weight.detach().float()
        assert (now - start).abs().max() > 1e-3


def test_the_bound_decode_step_refuses_them_by_name(checkpoint):
    """The CPU backend's bound decode step norms each sublayer's input only: it names what else a layer norms."""
    from moerl.cpu import install
    from moerl.cpu.direct import _layer_refusal
    from moerl.cpu.kernels import kernel

    if kernel() is None:
        pytest.skip("the CPU backend's kernels do not build on this host")
    arch, path, _ = checkpoint
    model = load_model(path, dtype=torch.float32)
    install(model)
    want = {
        "AfmoeForCausalLM": "not a pre-norm decoder layer without a residual multiplier",
        "AXK1ForCausalLM": "a norm of the MoE's output",
        "Cohere2MoeForCausalLM": "attention and MLP of one normed input (a parallel block)",
    }
    assert _layer_refusal(model.layers[1], torch.float32) == want[arch]
