"""Quantized released checkpoints load directly: a tiny DeepSeek-V3 stored as the FP8 release is (E4M3 weights,
fp32 weight_scale_inv per block) and a tiny GPT-OSS with MXFP4 experts (uint8 blocks of E2M1 pairs, E8M0 scales)
give the logits and router choices of transformers' own dequantized model (fp32, 1e-4); negative control: the
scales read as 1. Unknown quant methods, mismatched scales and vLLM engines on quantized checkpoints are refused
by name; export writes a dequantized checkpoint transformers loads."""

import json

import pytest
import torch
from hf_models import VOCAB, build_hf_model, hf_router_choices
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from moerl.bridges import export_model, load_model
from moerl.bridges.quantized import dequantize_fp8
from moerl.errors import CheckpointError, ConfigError

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BLOCK = [8, 8]  # the released V3 uses 128 x 128; transformers' dequantizer needs whole blocks, so tiny ones here


def _ids():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize [rows, cols] as DeepSeek stores it: E4M3 data and fp32 scale_inv = block amax / 448."""
    r, c = w.shape
    blocks = w.reshape(r // BLOCK[0], BLOCK[0], c // BLOCK[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    data = (blocks / scale[:, None, :, None]).reshape(r, c).to(torch.float8_e4m3fn)
    return data, scale


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] as GPT-OSS stores it: blocks uint8 [..., out, in / 32, 16] (low nibble first), scales uint8."""
    groups = w.unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = ((groups / torch.exp2(exp)[..., None])[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def _rewrite(src, dst, hf_cfg_extra: dict, convert) -> None:
    """Copy checkpoint ``src`` to ``dst`` with each tensor through ``convert(name, tensor) -> {name: tensor}``."""
    dst.mkdir()
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: v for name in f.keys() for k, v in convert(name, f.get_tensor(name)).items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text()) | hf_cfg_extra
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    build_hf_model("DeepseekV3ForCausalLM").save_pretrained(root / "full")

    def convert(name, t):
        skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.")
        if name.endswith(".weight") and t.ndim == 2 and not any(s in name for s in skip):
            data, scale = _fp8(t)
            return {name: data, name + "_scale_inv": scale}
        return {name: t}

    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
    _rewrite(root / "full", root / "q", {"quantization_config": q}, convert)
    return root / "q"


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    build_hf_model("GptOssForCausalLM").save_pretrained(root / "full")

    def convert(name, t):
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            blocks, scales = _mxfp4(t.transpose(1, 2))  # stored per output row, blocks along the input
            return {name + "_blocks": blocks, name + "_scales": scales}
        return {name: t}

    q = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]}
    _rewrite(root / "full", root / "q", {"quantization_config": q}, convert)
    return root / "q"


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_checkpoints_match_transformers_dequantized(kind, fp8_checkpoint, mxfp4_checkpoint, tmp_path):
    path = fp8_checkpoint if kind == "fp8" else mxfp4_checkpoint
    # transformers keeps MXFP4 experts dequantized in bf16 (exact: E2M1 times a power of two); fp32 to compare in fp32
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).float().eval()
    ids = _ids()
    ref, choices = hf_router_choices(ref_model, ids)
    model = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(ids, capture=True)
    assert (out.logits - ref).abs().max() <= 1e-4
    for layer, choice in enumerate(choices):
        ours = out.routed[:, :, layer].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values)

    export_model(model, tmp_path / "plain")  # written dequantized, without the quantization_config
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(ids).logits - ref).abs().max() <= 1e-4


def test_scales_are_what_makes_them_match(fp8_checkpoint, monkeypatch):
    """Negative control: with every FP8 scale read as 1 the logits miss the tolerance by far."""
    import moerl.bridges.checkpoint as ckpt

    ref = AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.float32).eval()
    monkeypatch.setattr(ckpt, "dequantize", lambda q, name, data, scales: data.float())
    with torch.no_grad():
        assert (load_model(fp8_checkpoint, torch.float32)(_ids()).logits - ref(_ids()).logits).abs().max() > 1e-2


def test_nibble_order_is_what_makes_mxfp4_match(mxfp4_checkpoint, monkeypatch):
    """Negative control: MXFP4 bytes read high nibble first miss the tolerance by far."""
    import moerl.bridges.quantized as quantized

    ref = AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, dtype=torch.float32).float().eval()
    swap = quantized.dequantize_mxfp4
    monkeypatch.setattr(quantized, "dequantize_mxfp4", lambda n, b, s: swap(n, (b << 4) | (b >> 4), s))
    with torch.no_grad():
        assert (load_model(mxfp4_checkpoint, torch.float32)(_ids()).logits - ref(_ids()).logits).abs().max() > 1e-3


def test_fp8_partial_edge_blocks():
    """DeepSeek's reference scales partial edge blocks (e.g. 576 rows in 128-row blocks) by their own scale."""
    w = torch.randn(20, 12) * 3
    scale = torch.rand(3, 2) + 0.5  # ceil(20 / 8) x ceil(12 / 8)
    data = w.to(torch.float8_e4m3fn)
    expected = data.float().clone()
    for i in range(3):
        for j in range(2):
            expected[8 * i : 8 * i + 8, 8 * j : 8 * j + 8] *= scale[i, j]
    assert torch.equal(dequantize_fp8("w", data, scale, BLOCK), expected)
    with pytest.raises(CheckpointError, match=r"tensor 'w': weight_scale_inv has shape \(2, 2\); .* needs \(3, 2\)"):
        dequantize_fp8("w", data, scale[:2], BLOCK)
    with pytest.raises(CheckpointError, match=r"tensor 'w': FP8 checkpoint weight of dtype torch.float32"):
        dequantize_fp8("w", w, scale, BLOCK)


def test_bad_quantized_checkpoints_are_refused_by_name(fp8_checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "awq"
    shutil.copytree(fp8_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match=r"quantization_config.quant_method='awq' is not supported"):
        load_model(bad)
    cfg["quantization_config"]["weight_block_size"] = [8]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"weight_block_size=\[8\]: needs \[rows, cols\]"):
        load_model(bad)

    from moerl.engine import EngineConfig
    from moerl.rollout import make_engine

    with pytest.raises(ConfigError, match=r"rollout.engine=vllm with a quantized checkpoint"):
        make_engine("vllm", fp8_checkpoint, EngineConfig())
