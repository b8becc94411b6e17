"""Llama 4, derived with no bridge file: chunked attention layers, NoPE layers with temperature tuning, a q/k norm
without weights on the RoPE layers, interleaved rotary pairs, sigmoid scores on the one chosen expert's input,
experts stored transposed. Parity with transformers at fp32 1e-4 (plain and left-padded) with a control per knob,
its own default configs proven, packed rows kept apart chunk by chunk, the engine's decode against full forwards,
every training mode, and the bound CPU decode step refusing what it does not bind by name."""

import pytest
import torch
from hf_models import build_hf_model
from mixer_checks import (
    FP32_TOL,
    assert_left_padded_rows_match,
    assert_matches_transformers,
    assert_packed_sequences_stay_apart,
    assert_trains,
    model_with,
    moved,
    token_ids,
)

from moerl.bridges import load_model

ARCH = "Llama4ForCausalLM"


def _checkpoint(path, **overrides):
    """The tiny Llama 4 of ``hf_models`` saved to ``path`` with sharper attention (where RoPE and the chunks go
    shows) and routers whose logits matter; returns (path, the transformers model)."""
    hf = build_hf_model(ARCH, **overrides)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)
            elif name.endswith("router.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("llama4") / ARCH)


def test_llama4_matches_transformers_with_a_control_per_knob(checkpoint):
    """40 tokens (five chunks, temperature steps up to 10): logits within fp32 1e-4 of transformers, the same experts
    chosen. Each knob set wrong misses: the chunks (as full attention), the temperature tuning, the q/k norm, the
    gate weight on the expert's output instead of its input, the rotary pairs split in halves, the experts taken as
    stored (untransposed)."""
    path, hf = checkpoint
    model = load_model(path, dtype=torch.float32)
    cfg = model.config
    assert cfg.layer_types == ["chunked", "chunked", "full", "chunked"] and cfg.attention_chunk == 8
    assert cfg.nope_layers == [2] and (cfg.attn_temperature_scale, cfg.attn_temperature_floor) == (0.5, 4)
    assert cfg.qk_norm == "l2" and cfg.rope_interleave and cfg.rope.kind == "llama3"
    assert cfg.router_weight_on_input and cfg.scoring == "sigmoid" and not cfg.norm_topk_prob
    assert cfg.moe_layers == [1, 2, 3] and cfg.intermediate_size == 96 and cfg.shared_expert_size == 32
    ids = token_ids()
    want = assert_matches_transformers(model, hf, ids)
    for fields in (
        {"layer_types": ["full"] * 4, "attention_chunk": None},
        {"attn_temperature_scale": 0.0, "attn_temperature_floor": 0},
        {"qk_norm": "none"},
        {"router_weight_on_input": False},
        {"rope_interleave": False},
    ):
        with torch.no_grad():
            assert (model_with(model, **fields)(ids).logits - want).abs().max() > FP32_TOL, fields
    # the checkpoint's [E, H, 2I] taken as it is stored (square here: 2I = H): the transposition matters
    gate_up = [layer.mlp.experts.gate_up_proj for layer in model.layers if layer.is_moe]
    assert gate_up[0].shape[1:] == (64, 64)
    assert moved(model, ids, want, lambda: [w.copy_(w.transpose(1, 2).clone()) for w in gate_up]) > FP32_TOL


def test_export_writes_llama4s_own_layout(checkpoint, tmp_path):
    """Exported, the experts go back to [E, H, 2I] / [E, I, H] under their own names: transformers loads the
    checkpoint and gives the logits of the original (fp32, exactly)."""
    from transformers import AutoModelForCausalLM

    from moerl.bridges import export_model

    path, hf = checkpoint
    export_model(load_model(path, dtype=torch.float32), tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


def test_left_padded_rows_match_transformers(tmp_path):
    """A left-padded row (its positions from 0 at its first token) and a full one: every real token's logits
    within fp32 1e-4 of transformers given the same mask and positions; the chunks start at each row's first real
    token in both. The temperature steps are the checkpoint's own (8192 positions): transformers counts them from
    the padded row's first slot, moerl from the sequence's first token, as Llama 4's reference code does."""
    path, hf = _checkpoint(tmp_path / ARCH, floor_scale=8192)
    assert_left_padded_rows_match(load_model(path, dtype=torch.float32), hf)


def test_packed_rows_keep_their_chunks_apart(checkpoint):
    """Two sequences packed in one row, and a left-padded one: each keeps its own chunks (by its own positions) and
    gives its own logits; without sequence numbers the second sees the first."""
    assert_packed_sequences_stay_apart(load_model(checkpoint[0], dtype=torch.float32))


def test_llama4s_own_default_configs_are_derived_and_proved():
    """transformers' Llama 4 defaults (Scout's shape: 48 layers, every one MoE, chunks of 8192, a NoPE layer in
    four) and Maverick's MoE layer every second layer pass the proof with its chunks and temperature steps cut to
    what 16 tokens cross."""
    from test_derived import _default_config

    from moerl.bridges.base import HFConfig
    from moerl.bridges.prove import prove

    bridge, variant, layout = prove(_default_config("llama4_text"))
    assert bridge.architectures == (ARCH,) and variant["router_on_input"] and layout.experts_transposed
    cfg = bridge.config_from_hf(HFConfig(_default_config("llama4_text"), "config.json"))
    assert cfg.attention_chunk == 8192 and cfg.nope_layers == list(range(3, 48, 4)) and cfg.num_layers == 48
    maverick = _default_config("llama4_text", moe_layers=None, interleave_moe_layer_step=2)
    bridge, _, _ = prove(maverick)
    assert bridge.config_from_hf(HFConfig(maverick, "config.json")).moe_layers == list(range(1, 48, 2))


def test_the_engine_decodes_llama4_as_its_full_forward(checkpoint):
    """The engine's paged decode with chunked layers (read through the gathered keys and the chunk mask) and
    temperature-tuned NoPE layers, blocks of 4, sequences of up to 24 tokens (three chunks): each sampled token's
    logprobs and experts as a full forward of the finished sequence gives them (k3 <= 1e-6 fp32, routing equal)."""
    from test_engine import engine_vs_full_forward

    from moerl.engine import EngineConfig, LLMEngine

    config = EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8)
    kl, routed_ok = engine_vs_full_forward(LLMEngine(checkpoint[0], config, torch.float32))
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_llama4_trains_in_every_mode(mode, tmp_path):
    """Ten SFT steps on one batch (20 tokens: three chunks) lower the loss in each mode."""
    assert_trains(_checkpoint(tmp_path / ARCH)[0], mode, "layers.1.mlp.shared_experts.up_proj.lora.lora_A")


def test_the_bound_decode_step_and_vllm_refuse_llama4s_knobs_by_name(checkpoint):
    """The CPU backend's bound decode step binds neither chunks nor temperature tuning: it names what it does not bind,
    layer by layer (the engine then runs the modules); vLLM's Llama 4 places its MoE layers by
    interleave_moe_layer_step alone (tests/test_vllm.py serves the family)."""
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
    assert _layer_refusal(model.layers[1], torch.float32) == "chunked attention"
    assert _layer_refusal(model.layers[2], torch.float32) == "temperature tuning of the queries"
    with pytest.raises(ConfigError, match=rf"engine=vllm with {ARCH} .*moe_layers \[1, 2, 3\] are not the layers"):
        make_engine("vllm", checkpoint[0], EngineConfig())


def test_the_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Llama 4 as released (``Llama4ForConditionalGeneration``: ``language_model.*`` beside ``vision_model.*`` and
    ``multi_modal_projector.*``): moerl loads the text model from ``text_config`` and skips the vision tower by name;
    fp32 logits of a text prompt within 1e-4 of transformers' multimodal model. Controls: a vision tensor changed
    changes nothing, a language-model tensor changed misses."""
    from hf_models import DERIVED_CONFIGS
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Llama4ForConditionalGeneration

    text = {k: v for k, v in DERIVED_CONFIGS[ARCH].items() if k != "model_type"}
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32)
    vision |= dict(patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)
    torch.manual_seed(0)
    hf = Llama4ForConditionalGeneration(AutoConfig.for_model("llama4", text_config=text, vision_config=vision)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = (0.16 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.02) if p.ndim >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name.endswith("layernorm.weight") else 0.0))
    hf.save_pretrained(tmp_path)
    ids = token_ids()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        model = load_model(tmp_path, torch.float32)
        assert model.hf_config["architectures"] == [ARCH] and model.config.attention_chunk == 8
        assert (model(ids).logits - want).abs().max() <= FP32_TOL
        file = tmp_path / "model.safetensors"
        tensors = load_file(file)
        tensors["vision_model.patch_embedding.linear.weight"] += 1.0
        tensors["multi_modal_projector.linear_1.weight"] += 1.0
        save_file(tensors, file, metadata={"format": "pt"})
        assert (load_model(tmp_path, torch.float32)(ids).logits - want).abs().max() <= FP32_TOL
        tensors["language_model.model.layers.1.feed_forward.experts.gate_up_proj"] += 0.05
        save_file(tensors, file, metadata={"format": "pt"})
        assert (load_model(tmp_path, torch.float32)(ids).logits - want).abs().max() > FP32_TOL


def test_peft_export_refuses_adapters_on_llama4s_transposed_experts(checkpoint, tmp_path):
    """Llama 4's experts are stored transposed ([E, H, 2I]): moerl's expert adapters are refused by name for PEFT
    export (their rows would need transposing too); its attention's export and reproduce moerl's logits in peft."""
    from test_export import peft_logits

    from moerl.errors import CheckpointError

    _, ours, theirs, plain = peft_logits(checkpoint[0], ["o_proj"], tmp_path / "adapter")
    assert (ours - theirs).abs().max() <= 1e-4 and (ours - plain).abs().max() > 1e-3
    with pytest.raises(CheckpointError, match=r"feed_forward\.experts\.gate_up_proj"):
        peft_logits(checkpoint[0], ["experts"], tmp_path / "experts")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paged_kernel_reads_a_chunked_layers_keys_as_the_chunk_mask_does(checkpoint, dtype):
    """A decode step of a chunked layer read from the pools in place (the CPU kernel: keys from the start of the
    query's chunk of 8, ``first_key``) against the gathered keys under the chunk mask (fp32 oracle), rows at positions
    0, 7, 8, 20 and 45 of tables across blocks: fp32 within 1e-5 of the largest output, bf16 within its rounding.
    Control: the same keys read as a full layer's differ by more."""
    from moerl.cpu.kernels import kernel
    from moerl.engine.kv_cache import KVCache, StepView
    from moerl.model.attention import attend

    if kernel() is None:
        pytest.skip("the CPU backend's kernels do not build on this host")
    cfg = load_model(checkpoint[0], dtype=torch.float32).config
    cache = KVCache(cfg, num_blocks=16, block_size=16, dtype=dtype)
    ref = KVCache(cfg, num_blocks=16, block_size=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for pool, into in zip(cache.k + cache.v, ref.k + ref.v, strict=True):
        pool.copy_(torch.randn(pool.shape, generator=gen))
        into.copy_(pool)
    positions = torch.tensor([[0], [7], [8], [20], [45]])
    tables = torch.randperm(16, generator=gen)[:15].view(5, 3)
    hkv, _, d = cache.k[0].shape
    q, k, v = (torch.randn(5, 1, h, d, generator=gen).to(dtype) for h in (cfg.num_heads, hkv, hkv))
    with torch.no_grad():
        got = StepView(cache, tables, positions, torch.ones(5, dtype=torch.long)).attend(0, q, k, v, "chunked", 4, None)
        view = StepView(ref, tables, positions, torch.ones(5, dtype=torch.long))
        keys, values = view.update(0, k.float(), v.float())
        want = attend(q.float().transpose(1, 2), keys, values, view.mask("chunked"), 4, None)
        full = attend(q.float().transpose(1, 2), keys, values, view.mask("full"), 4, None)
    tol = (1e-5 if dtype == torch.float32 else 2**-8) * want.abs().max().clamp(min=1)
    assert got is not None and (got.float() - want).abs().max() <= tol
    assert (got.float() - full).abs().max() > max(tol, 1e-3)
