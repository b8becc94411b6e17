"""LongCat-Flash (a bridge file): layers of two attention and two MLP sublayers whose MoE runs beside the first MLP
and joins the residual stream after the second (``moe_shortcut``: two moerl layers, the MoE output handed from the
first to the second), MLA with its low-rank parts scaled, zero-computation experts. Parity with transformers at fp32
1e-4 (plain, left-padded, packed) with a control per knob, every training mode, a recomputed step equal to the plain
one, pipeline stages that keep the pairs whole, and what is not built refused by name. Round trip, the engine
against full forwards, replay and PEFT: tests/test_families.py."""

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
from moerl.errors import ConfigError

ARCH = "LongcatFlashForCausalLM"


def _checkpoint(path):
    """The tiny LongCat-Flash of ``hf_models`` saved to ``path`` with routers whose logits matter (a fair share of
    the tokens go to zero-computation experts); returns (path, the transformers model)."""
    hf = build_hf_model(ARCH)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("classifier.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("longcat") / ARCH)


def _joined_at_the_first_sublayer(model) -> None:
    """The negative control of the shortcut: each pair's MoE output added where a plain layer adds it (after the
    first sublayer, beside its dense MLP), in place."""
    for first, second in zip(model.layers[0::2], model.layers[1::2], strict=True):
        block = first.block

        def joined(x, cos, sin, mask, replay=None, cache=None, passed=None, block=block, i=first.layer):
            out, idx = block(x, cos, sin, mask, replay, cache, passed)
            return out + passed.carried.pop(i + 1), idx

        first.block = joined
        second.shortcut = None


def test_longcat_matches_transformers_with_a_control_per_knob(checkpoint):
    """Two HF layers are four moerl layers, the even ones MoE: logits within fp32 1e-4 of transformers, the same
    experts chosen, zero-computation experts among them. Each knob wrong misses: the MoE output joined at the first
    sublayer, the query's or the latent's scale left out."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert cfg.num_layers == 4 and cfg.moe_layers == [0, 2] and cfg.moe_shortcut and cfg.mla_lora_scale
    assert cfg.zero_experts == 4 and cfg.score_correction_bias and not cfg.norm_topk_prob
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)
    with torch.no_grad():
        routed = model(ids, capture=True).routed
    assert (routed >= cfg.num_experts).any() and (routed < cfg.num_experts).any()

    def off(change) -> float:
        again = load_model(path, dtype=torch.float32)
        change(again)
        with torch.no_grad():
            return float((again(ids).logits - want).abs().max())

    assert off(_joined_at_the_first_sublayer) > FP32_TOL
    q_scale = (cfg.hidden_size / cfg.q_lora_rank) ** 0.5
    assert off(lambda m: [setattr(x.self_attn, "scale", x.self_attn.scale / q_scale) for x in m.layers]) > FP32_TOL
    assert off(lambda m: [setattr(x.self_attn, "latent_scale", None) for x in m.layers]) > FP32_TOL


def test_left_padded_and_packed_rows_match(checkpoint):
    """A left-padded row beside a full one within fp32 1e-4 of transformers; two sequences packed in one row give
    each its own logits (without sequence numbers the second sees the first)."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert_left_padded_rows_match(model, hf)
    assert_packed_sequences_stay_apart(model)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_longcat_trains_in_every_mode(mode, tmp_path):
    """Ten SFT steps on one batch lower the loss in each mode; LoRA adapts the dense MLP beside the MoE."""
    assert_trains(_checkpoint(tmp_path / ARCH)[0], mode, "layers.0.dense_mlp.up_proj.lora.lora_A")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_recomputed_step_is_the_plain_step(checkpoint, mode):
    """Activation checkpointing with the MoE output handed between two recomputed layers: the step's loss, gradient
    norm and every gradient equal the plain step's (fp32 1e-6 of each tensor's largest element), R3 on."""
    assert_recomputed_step_is_plain(checkpoint[0], mode)


def test_pipeline_stages_keep_each_pair_whole(checkpoint):
    """The balanced split cuts between pairs; stages given that start inside one are refused by name, as are
    layers that do not pair."""
    import dataclasses

    from moerl.parallel.pipeline import split_layers

    model = load_model(checkpoint[0], dtype=torch.float32)
    assert split_layers(model, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(model, 2, [2, 2]) == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match=r"stages=\[1, 3\]: a stage starts at layer 1, which adds the MoE output"):
        split_layers(model, 2, [1, 3])
    with pytest.raises(ConfigError, match=r"fewer layers a stage can start at"):
        split_layers(model, 3)
    cfg = model.config
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_shortcut=True: needs layers in pairs"):
        dataclasses.replace(cfg, moe_layers=[1, 3])
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_shortcut=True: built for pre-norm layers"):
        dataclasses.replace(cfg, norm_placement="sandwich")
    with pytest.raises(ConfigError, match=r"ModelConfig.mla_lora_scale=True: scales a low-rank query"):
        dataclasses.replace(cfg, q_lora_rank=None)


def test_the_bound_decode_step_vllm_on_a_cpu_and_other_zero_experts_are_refused_by_name(checkpoint, tmp_path):
    """The CPU backend's bound decode step does not carry the MoE output between layers: it names it (the engine
    then runs the modules); vLLM's CPU build cannot route zero-computation experts (a CUDA-only kernel); zero
    experts other than the identity, and unscaled low-rank parts, are not built."""
    import json
    import shutil

    from moerl.cpu import install
    from moerl.cpu.direct import _layer_refusal
    from moerl.cpu.kernels import kernel
    from moerl.engine import EngineConfig
    from moerl.rollout import make_engine

    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match=rf"engine=vllm with {ARCH} .*CPU build routes zero-computation experts"):
        make_engine("vllm", checkpoint[0], EngineConfig())
    for field, value, says in [
        ("zero_expert_type", "drop", r"field 'zero_expert_type' is 'drop'; .* allow: identity"),
        ("mla_scale_q_lora", False, r"unscaled low-rank attention parts \(mla_scale_\*_lora false\): not built"),
    ]:
        other = tmp_path / field
        shutil.copytree(checkpoint[0], other)
        hf = json.loads((other / "config.json").read_text()) | {field: value}
        (other / "config.json").write_text(json.dumps(hf))
        with pytest.raises(ConfigError, match=says):
            load_model(other, dtype=torch.float32)
    if kernel() is None:
        pytest.skip("the CPU backend's kernels do not build on this host")
    model = load_model(checkpoint[0], dtype=torch.float32)
    install(model)
    why = _layer_refusal(model.layers[0], torch.float32)
    assert why == "a MoE output carried past the next layer (LongCat-Flash's pairs)"
