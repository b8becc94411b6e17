"""``moerl init-model`` writes real HF checkpoints; the char tokenizer loads with AutoTokenizer."""

import pytest
import torch
from hf_models import ARCHS
from transformers import AutoModelForCausalLM, AutoTokenizer

from moerl.bridges import load_model
from moerl.cli import main
from moerl.presets import count_params, init_model
from moerl.tokenizer import CHARS, EOS_ID


@pytest.mark.parametrize("arch", ARCHS)
def test_init_model_output_loads_in_transformers(arch, tmp_path):
    assert main(["init-model", "--arch", arch, "--preset", "tiny", str(tmp_path)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, dtype=torch.float32)
    assert type(hf).__name__ == arch
    assert 0.9e6 < count_params(ours) < 1.3e6  # the tiny preset: ~1M parameters
    ids = torch.randint(0, 100, (2, 20))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4


def test_small_preset_size():
    model = init_model("qwen3_moe", "small")
    cfg = model.config
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.head_dim) == (8, 16, 2, 512, 64)
    assert 55e6 < count_params(model) < 59e6


def test_init_model_accepts_model_type_and_is_seeded(tmp_path):
    a = init_model("mixtral", "tiny", seed=3)
    b = init_model("MixtralForCausalLM", "tiny", seed=3)
    c = init_model("mixtral", "tiny", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


def test_char_tokenizer_round_trips(tmp_path):
    init_model("qwen3_moe", "tiny", tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Q: 12 + 30 = ?\nA: 42!"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == 0
    assert len(tok) == 4 + len(CHARS)
    assert tok.decode(tok("a~b")["input_ids"] + [EOS_ID], skip_special_tokens=True) == "a~b"


def test_cli_unknown_arch_is_a_clear_error(tmp_path, capsys):
    assert main(["init-model", "--arch", "llama", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown architecture 'llama'" in err and "Qwen3MoeForCausalLM" in err


def test_cli_generate_runs_from_a_checkpoint(tmp_path, capsys):
    init_model("qwen3_moe", "tiny", tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "1+1=", "--max-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("'1+1=' -> ") and "tokens" in out
