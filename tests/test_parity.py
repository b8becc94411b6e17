"""Day-0 proof: every bridge reproduces transformers' logits and router choices, and exports back."""

import pytest
import torch
from hf_models import ARCHS, VOCAB, build_hf_model, hf_router_choices
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from moerl.bridges import export_model, load_model

FP32_TOL = 1e-4  # max abs logits difference, fp32
BF16_TOL = 0.02  # max abs logits difference, bf16 vs transformers bf16 (measured 0.002-0.008; |logits| < 1)


def _tensor_names(path) -> set[str]:
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as handle:
            names |= set(handle.keys())
    return names


def _ids(b=2, t=24, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_router_choices_match_transformers_fp32(arch, hf_checkpoints):
    path, hf = hf_checkpoints[arch]
    model = load_model(path, dtype=torch.float32)
    ids = _ids()
    ref_logits, ref_choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        out = model(ids, capture=True)
    assert (out.logits - ref_logits).abs().max().item() <= FP32_TOL
    assert out.routed.shape == (2, 24, len(ref_choices), model.config.top_k)
    for layer, ref in enumerate(ref_choices):
        ours = out.routed[:, :, layer].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, ref.sort(-1).values), f"MoE layer {layer} chose other experts"


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_and_loop_expert_paths_agree(arch, hf_checkpoints):
    model = load_model(hf_checkpoints[arch][0], dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        grouped = model(ids).logits
        model.set_expert_path(grouped=False)
        loop = model(ids).logits
    assert (grouped - loop).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batch_matches_transformers(arch, hf_checkpoints):
    path, hf = hf_checkpoints[arch]
    model = load_model(path, dtype=torch.float32)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding on the first row
    mask[1, -3:] = 0  # right padding on the second
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        ours = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - ref[real]).abs().max().item() <= FP32_TOL
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_close_to_transformers(arch, hf_checkpoints):
    path, hf32 = hf_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = load_model(path, dtype=torch.bfloat16)
    assert model.layers[model.moe_layer_ids[0]].mlp.router.weight.dtype == torch.float32
    ids = _ids()
    with torch.no_grad():
        exact = hf32(ids).logits
        ours, theirs = model(ids).logits.float(), hf(ids).logits.float()
    assert (ours - theirs).abs().max().item() <= BF16_TOL
    # and moerl's bf16 error against the fp32 oracle is no worse than transformers' own bf16 error
    assert (ours - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_export_reloads_in_transformers_with_same_logits(arch, hf_checkpoints, tmp_path):
    model = load_model(hf_checkpoints[arch][0], dtype=torch.float32)
    export_model(model, tmp_path / "export", max_shard_bytes=64 * 1024)  # small shards: exercise the index
    assert (tmp_path / "export" / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids).logits).abs().max().item() <= FP32_TOL
    # the same tensor names as the checkpoint transformers wrote (other readers, e.g. vLLM, map by name)
    assert _tensor_names(tmp_path / "export") == _tensor_names(hf_checkpoints[arch][0])
    again = load_model(tmp_path / "export", dtype=torch.float32)  # and our own loader reads the shards
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_sharded_hf_checkpoint_loads(tmp_path):
    arch = "Qwen3MoeForCausalLM"
    hf = build_hf_model(arch)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(tmp_path, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max().item() <= FP32_TOL


def test_deepseek_without_q_lora_matches(tmp_path):
    arch = "DeepseekV3ForCausalLM"
    hf = build_hf_model(arch, q_lora_rank=None, rope_interleave=False)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max().item() <= FP32_TOL


def test_mla_latent_norms_use_deepseeks_fixed_eps(tmp_path):
    """transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps is. At
    rms_norm_eps=1e-5, fp32: measured 1.2e-7 with the fixed eps, 8.2e-5 with the latent norms at rms_norm_eps (the
    negative control), which FP32_TOL would let through: hence 1e-5 here."""
    hf = build_hf_model("DeepseekV3ForCausalLM", rms_norm_eps=1e-5)
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.config.rms_norm_eps == 1e-5
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        assert (model(ids).logits - ref).abs().max() <= 1e-5
        for layer in model.layers:
            layer.self_attn.q_a_layernorm.eps = layer.self_attn.kv_a_layernorm.eps = 1e-5
        assert (model(ids).logits - ref).abs().max() > 1e-5
