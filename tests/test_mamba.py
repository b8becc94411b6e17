"""Mamba-2 layers (Granite-4.0-H): the chunked and recurrent forms against transformers' reference kernels, the
family derived with no bridge file at fp32 parity with a control per knob, packed sequences, the engine's state
slots (chunked prefill, n samples copying the prompt's state) against full forwards, every training mode, PEFT."""

import dataclasses

import pytest
import torch
from mixer_checks import (
    assert_engine_states_follow_full_forwards,
    assert_matches_transformers,
    assert_packed_sequences_stay_apart,
    assert_vllm_and_compiled_decode_refuse,
    live_mamba_checkpoint,
    mixers_of,
    moved,
    sft_losses,
    token_ids,
)

from moerl.bridges import load_model
from moerl.model.mamba import ssd_chunked, ssd_step
from moerl.model.transformer import MoEModel

ARCH = "GraniteMoeHybridForCausalLM"
FP32_TOL = 1e-4  # logits against transformers in fp32 (as the other families' parity tests)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Granite-4.0-H with a conv and decays that matter."""
    return live_mamba_checkpoint(tmp_path_factory.mktemp("mamba") / ARCH, ARCH, ("mamba.in_proj.weight",))


def _random_ssm(b=2, t=21, h=4, p=8, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, t, h, generator=g))
    a = -torch.rand(h, generator=g) - 0.1
    bb, cc = torch.randn(b, t, h, n, generator=g), torch.randn(b, t, h, n, generator=g)
    state = torch.randn(b, h, p, n, generator=g)
    return x, dt, a, bb, cc, state


def test_the_chunked_and_recurrent_forms_are_transformers_reference_kernels():
    """moerl's chunked form (chunks of 4, 8 and one 64 over 21 tokens, from a nonzero state) against transformers'
    pure-PyTorch ``mamba2_chunk_scan`` and, token by token, its ``mamba2_selective_state_update``: outputs and final
    states within fp32 1e-5. Negative control: the decay's sign flipped misses."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as ref

    x, dt, a, bb, cc, state = _random_ssm()
    b, t, h, p = x.shape
    d = torch.zeros(h)
    # transformers takes dt before its softplus and B / C per group (one group per head here)
    raw = torch.log(torch.expm1(dt))
    want_y, want_s = ref.mamba2_chunk_scan(
        x, raw, a, bb, cc, chunk_size=8, D=d, dt_softplus=True, initial_states=state, return_final_states=True
    )
    for chunk in (4, 8, 64):
        y, s = ssd_chunked(x, dt, a, bb, cc, state, chunk=chunk)
        assert (y - want_y).abs().max() <= 1e-5 and (s - want_s).abs().max() <= 1e-5, chunk
    s = state.clone()
    for i in range(t):
        s_ref = s.clone()  # transformers' step updates the state in place
        a_ref, dt_ref = a[:, None, None].expand(-1, p, bb.shape[-1]), raw[:, i, :, None].expand(-1, -1, p)
        want = ref.mamba2_selective_state_update(
            s_ref, x[:, i], dt_ref, a_ref, bb[:, i], cc[:, i], D=d[:, None].expand(-1, p), dt_softplus=True
        )
        y, s = ssd_step(x[:, i], dt[:, i], a, bb[:, i], cc[:, i], s)
        assert (y - want).abs().max() <= 1e-5 and (s - s_ref).abs().max() <= 1e-5, i
    assert (s - want_s).abs().max() <= 1e-4  # the recurrence ends where the chunked form does
    flipped, _ = ssd_chunked(x, dt, -a, bb, cc, state, chunk=8)
    assert not torch.allclose(flipped, want_y, atol=1e-3)


def test_the_chunked_forms_gradients_are_the_recurrences():
    """Gradients through the chunked form (what training runs) equal those through the token-by-token recurrence
    (fp32 1e-4), for every input and the starting state."""
    inputs = [z.clone().requires_grad_() for z in _random_ssm(t=13)]
    x, dt, a, bb, cc, state = inputs
    y, s = ssd_chunked(x, dt, a, bb, cc, state, chunk=4)
    (y.square().sum() + s.sum()).backward()
    chunked = [z.grad.clone() for z in inputs]
    for z in inputs:
        z.grad = None
    s, ys = state, []
    for i in range(x.shape[1]):
        yi, s = ssd_step(x[:, i], dt[:, i], a, bb[:, i], cc[:, i], s)
        ys.append(yi)
    (torch.stack(ys, 1).square().sum() + s.sum()).backward()
    for got, z in zip(chunked, inputs, strict=True):
        assert (got - z.grad).abs().max() <= 1e-4 * max(1.0, float(z.grad.abs().max()))


def test_granite_4_h_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens (several of transformers' chunks of 8): logits within fp32 1e-4 of transformers, the same experts
    chosen; each knob moved misses: the decay, the step's bias, the skip D, the conv, the gated norm's gate and its
    groups."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert model.config.layer_types == ["mamba", "full", "mamba", "mamba"] and model.config.mamba_groups == 2
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)

    mambas = mixers_of(model, "mamba")
    knobs = {
        "decay": lambda: [m.A_log.add_(0.5) for m in mambas],
        "dt bias": lambda: [m.dt_bias.add_(0.5) for m in mambas],
        "skip": lambda: [m.D.mul_(0.5) for m in mambas],
        "conv": lambda: [m.conv1d.weight.copy_(m.conv1d.weight.flip(-1)) for m in mambas],
        "gate": lambda: [m.in_proj.weight[: m.inner].mul_(0.5) for m in mambas],
    }
    for knob, change in knobs.items():
        assert moved(model, ids, want, change) > FP32_TOL, f"negative control '{knob}' matched transformers"
    off = MoEModel(dataclasses.replace(model.config, mamba_norm_groups=2), torch.float32)  # per B / C group
    off.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (off(ids).logits - want).abs().max() > FP32_TOL


def test_packing_restarts_the_state_and_padding_stays_out(checkpoint):
    """Packed sequences and a left-padded row give each sequence's own logits: the conv and the state restart at
    each sequence start (control: one state through both)."""
    assert_packed_sequences_stay_apart(load_model(checkpoint[0], dtype=torch.float32))


def test_the_engine_continues_each_sequence_from_its_state_as_a_full_forward(checkpoint, monkeypatch):
    """The engine's state slots (chunked prefill, n samples copying the prompt's state) against full forwards
    (k3 <= 1e-6 fp32, R3's rows equal), with its negative control: ``assert_engine_states_follow_full_forwards``."""
    assert_engine_states_follow_full_forwards(checkpoint[0], monkeypatch, [0, 2, 3], (4, 32, 16))


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_the_mamba_hybrid_trains_in_every_mode(mode, checkpoint):
    """Gradients flow through the chunked form, the conv and the gated norm: ten SFT steps on one batch lower the
    loss in each mode, by 15% (LoRA: 0.1 nats; on the Mamba projections too; MXFP8 quantizes their GEMMs)."""
    if mode == "mxfp8":
        pytest.importorskip("torchao")
    losses, policy = sft_losses(checkpoint[0], mode)
    # measured: full and mxfp8 4.62 -> 3.60; LoRA (rank 8, under muP's logit scaling) 4.62 -> 4.48
    assert losses[-1] < (losses[0] - 0.1 if mode == "lora" else 0.85 * losses[0]), losses
    if mode == "lora":
        names = {n for n, _ in policy.model.named_parameters() if n.startswith("layers.0.self_attn.")}
        assert {f"layers.0.self_attn.{p}.lora.lora_A" for p in ("in_proj", "out_proj")} <= names


def test_a_peft_adapter_on_the_mamba_projections_reproduces_moerl_in_peft(checkpoint, tmp_path):
    """Adapters on the Mamba projections, attention and the experts, written for PEFT: peft on the transformers model
    gives moerl's logits (fp32 1e-4), far from the base model's."""
    from test_export import peft_logits

    _, ours, theirs, plain = peft_logits(checkpoint[0], ["in_proj", "out_proj", "o_proj", "experts"], tmp_path / "a")
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - plain).abs().max() > 1e-3


def test_vllm_engines_and_compiled_decode_refuse_mamba_layers_by_name(checkpoint):
    assert_vllm_and_compiled_decode_refuse(checkpoint[0], ARCH)
