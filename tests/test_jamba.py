"""Mamba-1 layers (Jamba): the scan and its step against transformers' reference kernels, the family derived with no
bridge file at fp32 parity with a control per knob, packed sequences, the engine's state slots (chunked prefill, n
samples copying the prompt's state) against full forwards, every training mode, PEFT."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
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
from moerl.model.mamba1 import selective_scan
from moerl.model.transformer import MoEModel

ARCH = "JambaForCausalLM"
FP32_TOL = 1e-4  # logits against transformers in fp32 (as the other families' parity tests)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Jamba with a conv, decays and an attention that matter (where RoPE goes shows)."""
    return live_mamba_checkpoint(
        tmp_path_factory.mktemp("mamba1") / ARCH, ARCH, ("mamba.in_proj.weight", "q_proj.weight", "k_proj.weight")
    )


def test_the_scan_and_its_step_are_transformers_reference_kernels():
    """moerl's scan (from zeros, as transformers' scan starts) against transformers' pure-PyTorch
    ``mamba_selective_scan``, and token by token from a nonzero state against its ``mamba_selective_state_update``:
    outputs and states within fp32 1e-5. Negative control: the decay's sign flipped misses."""
    from transformers.models.jamba import modeling_jamba as ref

    g = torch.Generator().manual_seed(0)
    b, t, i, n = 2, 17, 12, 6
    x, raw = torch.randn(b, t, i, generator=g), torch.randn(b, t, i, generator=g)
    a = -torch.rand(i, n, generator=g) - 0.1
    bb, cc = torch.randn(b, t, n, generator=g), torch.randn(b, t, n, generator=g)
    dt = F.softplus(raw)
    want_y, want_s = ref.mamba_selective_scan(
        x.transpose(1, 2), raw.transpose(1, 2), a, bb.transpose(1, 2), cc.transpose(1, 2), delta_softplus=True,
        return_last_state=True, use_mambapy=False, use_associative_scan=False,
    )  # fmt: skip
    y, s = selective_scan(x, dt, a, bb, cc)
    assert (y - want_y.transpose(1, 2)).abs().max() <= 1e-5 and (s - want_s).abs().max() <= 1e-5

    state = torch.randn(b, i, n, generator=g)
    s = state.clone()
    for k in range(t):
        s_ref = s.clone()  # transformers' step updates the state in place
        want = ref.mamba_selective_state_update(s_ref, x[:, k], raw[:, k], a, bb[:, k], cc[:, k], dt_softplus=True)
        yk, s = selective_scan(x[:, k : k + 1], dt[:, k : k + 1], a, bb[:, k : k + 1], cc[:, k : k + 1], s)
        assert (yk[:, 0] - want).abs().max() <= 1e-5 and (s - s_ref).abs().max() <= 1e-5, k
    flipped, _ = selective_scan(x, dt, -a, bb, cc)
    assert not torch.allclose(flipped, want_y.transpose(1, 2), atol=1e-3)


def test_jamba_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens: logits within fp32 1e-4 of transformers, the same experts chosen; each knob moved misses: the decay,
    the step's bias, the skip D, the conv, the gate, the dt / B / C norms, and RoPE in the attention (Jamba's has
    none, and no field says so: the proof found it)."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert cfg.layer_types == ["mamba1", "mamba1", "full", "mamba1"] and cfg.moe_layers == [1, 3]
    assert (cfg.mamba_inner_size, cfg.mamba_dt_rank, cfg.nope_layers) == (128, 4, [2])  # rank "auto": 64 / 16
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)

    mambas = mixers_of(model, "mamba1")
    knobs = {
        "decay": lambda: [m.A_log.add_(0.5) for m in mambas],
        "dt bias": lambda: [m.dt_proj.bias.add_(0.5) for m in mambas],
        "skip": lambda: [m.D.mul_(0.5) for m in mambas],
        "conv": lambda: [m.conv1d.weight.copy_(m.conv1d.weight.flip(-1)) for m in mambas],
        "gate": lambda: [m.in_proj.weight[m.inner :].mul_(0.5) for m in mambas],
        "dt norm": lambda: [m.dt_layernorm.weight.mul_(1.5) for m in mambas],
        "B norm": lambda: [m.b_layernorm.weight.mul_(1.5) for m in mambas],
        "C norm": lambda: [m.c_layernorm.weight.mul_(1.5) for m in mambas],
    }
    for knob, change in knobs.items():
        assert moved(model, ids, want, change) > FP32_TOL, f"negative control '{knob}' matched transformers"
    rotated = MoEModel(dataclasses.replace(cfg, nope_layers=[]), torch.float32)
    rotated.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (rotated(ids).logits - want).abs().max() > FP32_TOL


def test_jambas_own_default_config_is_derived_and_proved():
    """The real Jamba layout (transformers' defaults: 32 layers, attention every 8th from 4, experts every 2nd from
    1, the step's rank "auto") passes the derived bridge's proof at its tiny size, with its Mamba-1 layers."""
    from test_derived import _default_config

    from moerl.bridges.prove import prove

    bridge, variant, layout = prove(_default_config("jamba"))
    assert layout.mamba == "mamba1" and variant["nope_attention"]
    assert bridge.architectures == (ARCH,)


def test_packing_restarts_the_state_and_padding_stays_out(checkpoint):
    """Packed sequences and a left-padded row give each sequence's own logits: the conv and the state restart at
    each sequence start (control: one state through both)."""
    assert_packed_sequences_stay_apart(load_model(checkpoint[0], dtype=torch.float32))


def test_the_engine_continues_each_sequence_from_its_state_as_a_full_forward(checkpoint, monkeypatch):
    """The engine's state slots (chunked prefill, n samples copying the prompt's state) against full forwards
    (k3 <= 1e-6 fp32, R3's rows equal), with its negative control: ``assert_engine_states_follow_full_forwards``."""
    assert_engine_states_follow_full_forwards(checkpoint[0], monkeypatch, [0, 1, 3], (128, 16))


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_jamba_trains_in_every_mode(mode, checkpoint):
    """Gradients flow through the scan, the conv and the dt / B / C norms: ten SFT steps on one batch lower the loss
    in each mode (LoRA: on the Mamba projections too; MXFP8 quantizes their GEMMs)."""
    if mode == "mxfp8":
        pytest.importorskip("torchao")
    losses, policy = sft_losses(checkpoint[0], mode)
    # measured: full 4.59 -> 0.91, mxfp8 4.59 -> 0.93, LoRA (rank 8) 4.59 -> 3.78
    assert losses[-1] < (losses[0] - 0.1 if mode == "lora" else 0.85 * losses[0]), losses
    if mode == "lora":
        names = {n for n, _ in policy.model.named_parameters() if n.startswith("layers.0.self_attn.")}
        assert {f"layers.0.self_attn.{p}.lora.lora_A" for p in ("in_proj", "x_proj", "out_proj")} <= names


def test_a_peft_adapter_on_the_mamba_projections_reproduces_moerl_in_peft(checkpoint, tmp_path):
    """Adapters on the Mamba-1 projections, attention and the experts, written for PEFT: peft on the transformers
    model gives moerl's logits (fp32 1e-4), far from the base model's."""
    from test_export import peft_logits

    targets = ["in_proj", "x_proj", "out_proj", "o_proj", "experts"]
    _, ours, theirs, plain = peft_logits(checkpoint[0], targets, tmp_path / "a")
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - plain).abs().max() > 1e-3


def test_vllm_engines_and_compiled_decode_refuse_mamba1_layers_by_name(checkpoint):
    assert_vllm_and_compiled_decode_refuse(checkpoint[0], ARCH)


# -- export of merged weights (adapters PEFT cannot hold: dense MLPs) ------------------------------------------------


def _checkpoint_names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as handle:
        return set(handle.keys())


def test_lora_on_dense_mlps_exports_merged_weights_transformers_loads_first_time_and_again(checkpoint, tmp_path):
    """The LoRA mode's export with an adapter on the dense MLPs (which PEFT cannot hold): merged weights, every tensor
    once under the checkpoint's own names (per expert, as transformers saves Jamba), that transformers loads with none
    missing or unexpected and whose logits are moerl's with the adapters (fp32 1e-4), far from the base's. A second
    export into the same run directory (a resumed run's end), after the adapters moved, replaces it whole."""
    from test_export import IDS, _trained_policy
    from transformers import AutoModelForCausalLM

    from moerl.model.lora import lora_modules

    path = checkpoint[0]
    pol = _trained_policy(path, "per_expert", ["in_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts"])
    run_dir = tmp_path / "run"
    for turn in ("first", "resumed"):
        exported = pol.mode.export(pol, run_dir)
        assert set(exported) == {"merged", "adapter_note"}, exported
        assert "layers.0.mlp.gate_proj" in exported["adapter_note"]
        assert _checkpoint_names(run_dir / "merged") == _checkpoint_names(path), turn
        merged = run_dir / "merged"
        hf, info = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (turn, info)
        with torch.no_grad():
            ours, plain, theirs = pol.model(IDS, adapters=0).logits, pol.model(IDS).logits, hf.eval()(IDS).logits
        assert (theirs - ours).abs().max() <= 1e-4, turn
        assert (theirs - plain).abs().max() > 1e-3, turn
        with torch.no_grad():  # the adapters move on before the resumed run's end
            for lora in lora_modules(pol.model).values():
                for p in lora.parameters():
                    p.mul_(1.5)


def test_a_bridge_that_writes_a_tensor_twice_is_refused_by_name_before_anything_is_deleted(checkpoint, tmp_path):
    """Negative control of the fix: Jamba's catch-all ``feed_forward.{x}`` rule writing again (as before) would put
    each expert tensor out twice (per expert and whole, one memory): refused naming the moerl tensor and both names,
    and the export already in the directory is left as it was."""
    import dataclasses

    from run_helpers import tree_hash

    from moerl.bridges import export_model
    from moerl.bridges.checkpoint import write_model
    from moerl.bridges.find import get_bridge
    from moerl.errors import CheckpointError

    model = load_model(checkpoint[0], dtype=torch.float32)
    export_model(model, tmp_path / "out")
    before = tree_hash(tmp_path / "out")
    bridge = get_bridge(model.hf_config)
    writing = [dataclasses.replace(r, write=True) if r.hf.endswith("feed_forward.{x}") else r for r in bridge.rules]
    assert writing != list(bridge.rules)
    with pytest.raises(CheckpointError, match=r"moerl tensor 'layers\.1\.mlp\.(experts\.\w+|router\.weight)' would "
                       r"be written twice, as 'model\.layers\.1\.feed_forward\.[\w.]+' and as"):  # fmt: skip
        write_model(model, dataclasses.replace(bridge, rules=tuple(writing)), tmp_path / "out")
    assert tree_hash(tmp_path / "out") == before
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(CheckpointError, match="would be written twice"):
        write_model(model, dataclasses.replace(bridge, rules=tuple(writing)), tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_a_lora_run_ends_with_exit_0_and_merged_weights_on_its_first_run_and_on_resume(checkpoint, tmp_path):
    """``moerl train`` with LoRA on every layer (dense MLPs too: merged weights, not a PEFT adapter) exits 0 and its
    merged checkpoint loads in transformers with no tensor missing or unexpected; ``--resume`` with more steps ends
    the same way, the merged weights rewritten whole (measured: ~13 s a run on 2 cores)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from moerl.tokenizer import save_tokenizer

    model, run_dir = tmp_path / "model", tmp_path / "run"
    shutil.copytree(checkpoint[0], model)
    save_tokenizer(model)
    example = Path(__file__).parents[1] / "examples" / "lora_arithmetic.yaml"
    args = [str(example), f"model.path={model}", f"run_dir={run_dir}", "model.sft_steps=0", "env.eval_problems=0"]
    args += ["rollout.prompts_per_step=4", "rollout.group_size=4", "policy.dtype=float32", "rollout.dtype=float32"]
    for steps, resume in ((2, []), (3, ["--resume"])):
        done = subprocess.run(
            [sys.executable, "-m", "moerl.cli", "train", *args, f"train.steps={steps}", *resume],
            capture_output=True, text=True, timeout=240, env=os.environ | {"GLOO_SOCKET_IFNAME": "lo"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"moerl: wrote merged weights (the base with the adapters added in: a whole checkpoint, not a PEFT " \
            f"adapter) to {run_dir / 'merged'}" in done.stderr, done.stderr[-2000:]  # fmt: skip
        _, info = AutoModelForCausalLM.from_pretrained(run_dir / "merged", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (steps, info)
        assert _checkpoint_names(run_dir / "merged") == _checkpoint_names(model)
