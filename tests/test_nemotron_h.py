"""Nemotron-H: layers of one block each (Mamba-2, attention, an MLP or an MoE alone, one norm a layer), un-gated relu2
experts and MLPs, checkpoints under ``backbone.`` with per-expert tensors. Derived with no bridge file at fp32 parity
with transformers with a control per knob; packed sequences, the engine's state slots, every training mode, export
and PEFT."""

import dataclasses

import pytest
import torch
from mixer_checks import (
    assert_engine_states_follow_full_forwards,
    assert_matches_transformers,
    assert_packed_sequences_stay_apart,
    assert_vllm_and_compiled_decode_refuse,
    live_mamba_checkpoint,
    moved,
    sft_losses,
    token_ids,
)

from moerl.bridges import load_model
from moerl.model.transformer import MoEModel

ARCH = "NemotronHForCausalLM"
FP32_TOL = 1e-4  # logits against transformers in fp32 (as the other families' parity tests)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Nemotron-H (Mamba, MoE, attention, MLP, MoE) with a conv, decays and an attention that matter."""
    sharpen = ("mixer.in_proj.weight", "q_proj.weight", "k_proj.weight")
    return live_mamba_checkpoint(tmp_path_factory.mktemp("nemotron_h") / ARCH, ARCH, sharpen)


def test_nemotron_h_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens: logits within fp32 1e-4 of transformers, the same experts chosen; each knob moved misses: the
    gated norm per B / C group, attention without RoPE (no field says: the proof found it), the step's floor
    (time_step_min), the routed scaling, the selection bias, the relu2 of the dense MLP and of the experts, the shared
    expert."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert cfg.layer_types == ["mamba", "none", "full", "none", "none"] and cfg.mixer_only_layers == [0, 2]
    assert (cfg.moe_layers, cfg.nope_layers, cfg.activation, cfg.mamba_norm_groups) == ([1, 4], [2], "relu2", 2)
    assert not hasattr(model.layers[1], "self_attn") and not hasattr(model.layers[0], "mlp")
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)

    for field, wrong in (("mamba_norm_groups", 1), ("nope_layers", []), ("mamba_dt_min", 2.0)):
        off = MoEModel(dataclasses.replace(cfg, **{field: wrong}), torch.float32)
        off.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (off(ids).logits - want).abs().max() > FP32_TOL, field
    moe, dense = model.layers[1].mlp, model.layers[3].mlp
    knobs = {
        "routed scaling": lambda: setattr(moe.router, "scale", 1.0),
        "selection bias": lambda: moe.router.e_score_correction_bias.zero_(),
        "dense relu2 (a relu)": lambda: dense.up_proj.weight.mul_(-1),  # relu(-z)^2 != relu(z)^2
        "experts' relu2": lambda: moe.experts.gate_up_proj.mul_(-1),
        "shared expert": lambda: moe.shared_experts.down_proj.weight.mul_(0.5),
    }
    scale = moe.router.scale
    for knob, change in knobs.items():
        assert moved(model, ids, want, change) > FP32_TOL, f"negative control '{knob}' matched transformers"
        moe.router.scale = scale


def test_nemotron_h_refuses_what_it_does_not_compute():
    """Latent expert projections, a residual in fp32, another MLP activation: refused naming the feature."""
    from test_derived import _default_config

    from moerl.bridges.prove import prove
    from moerl.errors import UnknownArchitectureError

    for change, feature in (
        ({"moe_latent_size": 32}, "latent expert projections"),
        ({"residual_in_fp32": True}, "a residual stream kept in fp32"),
        ({"mlp_hidden_act": "silu"}, "un-gated MLPs with another activation"),
    ):
        with pytest.raises(UnknownArchitectureError, match=feature):
            prove(_default_config("nemotron_h", **change))


def test_nemotron_hs_own_default_config_and_an_old_pattern_string_are_proved():
    """transformers' default Nemotron-H (8 B / C groups, 128 heads) passes the derived bridge's proof at its tiny size;
    so does an older config spelling its layers as ``hybrid_override_pattern`` (M, E, *, -)."""
    from test_derived import _default_config

    from moerl.bridges.prove import prove

    _, variant, layout = prove(_default_config("nemotron_h"))
    assert layout.one_block and layout.mamba == "mamba" and variant["nope_attention"]
    old = _default_config("nemotron_h")
    old["hybrid_override_pattern"] = "ME*-E"
    del old["layers_block_type"]
    assert prove(old)[2].moe_layers == (1,)  # cut to its first layer of each kind: M, E, *, -


def test_packing_restarts_the_state_and_padding_stays_out(checkpoint):
    """Packed sequences and a left-padded row give each sequence's own logits (control: one state through both)."""
    assert_packed_sequences_stay_apart(load_model(checkpoint[0], dtype=torch.float32))


def test_the_engine_continues_each_sequence_from_its_state_as_a_full_forward(checkpoint, monkeypatch):
    """The engine's state slots (chunked prefill, n samples copying the prompt's state) against full forwards
    (k3 <= 1e-6 fp32, R3's rows equal), with its negative control; layers without a mixer keep no keys."""
    assert_engine_states_follow_full_forwards(checkpoint[0], monkeypatch, [0], (4, 16, 16))


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_nemotron_h_trains_in_every_mode(mode, checkpoint):
    """Ten SFT steps on one batch lower the loss in each mode (LoRA: on the Mamba, attention, MLP and un-gated expert
    projections; MXFP8 quantizes their GEMMs)."""
    if mode == "mxfp8":
        pytest.importorskip("torchao")
    losses, policy = sft_losses(checkpoint[0], mode)
    assert losses[-1] < (losses[0] - 0.1 if mode == "lora" else 0.85 * losses[0]), losses
    if mode == "lora":
        names = {n for n, _ in policy.model.named_parameters() if ".lora." in n}
        assert {"layers.0.self_attn.in_proj.lora.lora_A", "layers.3.mlp.up_proj.lora.lora_A"} <= names
        assert "layers.1.mlp.experts.lora.gate_up_B" in names


def test_export_writes_a_checkpoint_transformers_loads(checkpoint, tmp_path):
    """moerl's export of the loaded model (``backbone.`` names, per-expert tensors) loads in transformers with the
    same logits (fp32 1e-4)."""
    from transformers import AutoModelForCausalLM

    from moerl.bridges import export_model

    model = load_model(checkpoint[0], dtype=torch.float32)
    export_model(model, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = token_ids()
    with torch.no_grad():
        assert (again(ids).logits - model(ids).logits).abs().max() <= FP32_TOL


def test_a_peft_adapter_on_its_projections_reproduces_moerl_in_peft(checkpoint, tmp_path):
    """Adapters on the Mamba input projection, attention and the un-gated experts, written for PEFT (under
    transformers' ``model.`` names, the experts' ``up_proj``): peft on the transformers model gives moerl's logits
    (fp32 1e-4), far from the base model's. An adapter on the Mamba out_proj, which PEFT refuses for Nemotron-H, is
    refused by name before anything is written."""
    from test_export import _trained_policy, peft_logits

    from moerl.bridges.peft import write_peft_adapter
    from moerl.errors import CheckpointError

    _, ours, theirs, plain = peft_logits(checkpoint[0], ["in_proj", "q_proj", "o_proj", "experts"], tmp_path / "a")
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - plain).abs().max() > 1e-3
    pol = _trained_policy(checkpoint[0], "per_expert", ["out_proj"])
    with pytest.raises(CheckpointError, match=r"'layers.0.self_attn.out_proj'.*PEFT refuses LoRA on a Mamba"):
        write_peft_adapter(pol.model, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_vllm_engines_and_compiled_decode_refuse_it_by_name(checkpoint):
    assert_vllm_and_compiled_decode_refuse(checkpoint[0], ARCH)
