"""Zero-code Day-0: with a family's bridge file switched off, the bridge moerl derives from the config and proves
against transformers loads the checkpoint to the hand-written bridge's logits; families whose features the
decoder lacks are refused by name (config fields, tensors) or by the proof (the first layer that differs).
``moerl check-arch`` prints the derived bridge as a file that loads the checkpoint once registered."""

import importlib.util
import json

import pytest
import torch
from hf_models import VOCAB, build_hf_model, hf_router_choices

from moerl.bridges import derived, load_model
from moerl.bridges import registry as bridge_registry
from moerl.errors import UnknownArchitectureError

DERIVABLE = [
    "Qwen3MoeForCausalLM",  # per-head q/k norms, per-expert tensors
    "Qwen2MoeForCausalLM",  # shared expert with its sigmoid gate, qkv biases, sliding-window switch off
    "MixtralForCausalLM",  # block_sparse_moe, w1 / w3 / w2 experts, softmax over the top-k logits
    "OlmoeForCausalLM",  # q/k norms over the whole projection, clip_qkv
    "FlexOlmoForCausalLM",  # post-sublayer norms
    "HunYuanMoEV1ForCausalLM",  # gate.wg router, shared_mlp, query_layernorm after the rotation
]


@pytest.fixture
def without_bridge(monkeypatch):
    """Switch a family's bridge file off for one test (and forget derived bridges proven before)."""
    derived._proven.cache_clear()
    bridge_registry._load_families()

    def off(arch: str):
        monkeypatch.delitem(bridge_registry._BRIDGES, arch)

    yield off
    derived._proven.cache_clear()


def _ids():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", DERIVABLE)
def test_derived_bridge_reproduces_the_hand_written_one(arch, without_bridge, tmp_path):
    hf = build_hf_model(arch)
    hf.save_pretrained(tmp_path)
    ids = _ids()
    ref, choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        written = load_model(tmp_path, torch.float32)(ids).logits
        without_bridge(arch)
        model = load_model(tmp_path, torch.float32)
        out = model(ids, capture=True)
    assert arch not in bridge_registry._BRIDGES  # loaded through the derived bridge
    assert (out.logits - written).abs().max() <= 1e-5
    assert (out.logits - ref).abs().max() <= 1e-4
    for j, choice in enumerate(choices):
        ours = out.routed[:, :, j].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values)


def test_unknown_config_fields_and_tensors_are_refused_by_name(without_bridge, tmp_path):
    granite = json.loads(build_hf_model("GraniteMoeForCausalLM").config.to_json_string())
    without_bridge("GraniteMoeForCausalLM")
    with pytest.raises(UnknownArchitectureError, match=r"'attention_multiplier', 'embedding_multiplier'.* not under"):
        derived.prove(granite)
    # a hybrid linear-attention family (derived since issue 26: tests/test_hybrid.py) with a field nobody reads
    from transformers import AutoConfig

    hybrid = AutoConfig.for_model("qwen3_next").to_dict() | {"architectures": ["Qwen3NextForCausalLM"]}
    with pytest.raises(UnknownArchitectureError, match=r"for Qwen3NextForCausalLM: config field\(s\) 'linear_chunk'"):
        derived.prove(hybrid | {"linear_chunk": 64})
    # a name that contradicts the model_type
    qwen = json.loads(build_hf_model("Qwen3MoeForCausalLM").config.to_json_string())
    with pytest.raises(UnknownArchitectureError, match=r"model_type 'qwen3_moe' builds Qwen3MoeForCausalLM"):
        derived.prove(qwen | {"architectures": ["LlamaForCausalLM"]})


def test_the_proof_refuses_what_names_cannot_tell(without_bridge):
    """PhiMoE's sparsemixer routing looks like a softmax router by its names: no variant matches transformers."""
    phimoe = json.loads(build_hf_model("PhimoeForCausalLM").config.to_json_string())
    without_bridge("PhimoeForCausalLM")
    with pytest.raises(UnknownArchitectureError, match=r"no variant matches transformers .*first difference: layer 0"):
        derived.prove(phimoe)


def test_check_arch_prints_a_bridge_file_that_loads_the_checkpoint(without_bridge, tmp_path, capsys):
    from moerl.cli import main

    arch = "MixtralForCausalLM"
    hf = build_hf_model(arch)
    hf.save_pretrained(tmp_path / "ckpt")
    without_bridge(arch)
    assert main(["check-arch", str(tmp_path / "ckpt")]) in (None, 0)
    source = capsys.readouterr().out
    assert "topk_before_softmax': True" in source and "register(derive(" in source
    (tmp_path / "mixtral_derived.py").write_text(source)
    spec = importlib.util.spec_from_file_location("mixtral_derived", tmp_path / "mixtral_derived.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # registers the bridge, as a bridge file does
    assert arch in bridge_registry._BRIDGES
    ids = _ids()
    with torch.no_grad():
        assert (load_model(tmp_path / "ckpt", torch.float32)(ids).logits - hf(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("case", ["tensor shape", "config size"])
def test_check_arch_refuses_a_checkpoint_its_config_does_not_describe(case, without_bridge, tmp_path, capsys):
    """Names are not enough: a tensor of the wrong shape, or a config whose sizes the tensors do not have (a
    10^9-wide hidden size), fails by name from the headers, with nothing allocated."""
    from safetensors.torch import load_file, save_file

    from moerl.cli import main

    arch = "MixtralForCausalLM"
    build_hf_model(arch).save_pretrained(tmp_path / "ckpt")
    without_bridge(arch)
    weights, config = tmp_path / "ckpt" / "model.safetensors", tmp_path / "ckpt" / "config.json"
    if case == "tensor shape":
        tensors = load_file(weights)
        name = next(n for n in tensors if n.startswith("model.layers.1.") and n.endswith("gate.weight"))
        tensors[name] = tensors[name][:, :-1].clone()
        save_file(tensors, weights, metadata={"format": "pt"})
    else:
        config.write_text(json.dumps(json.loads(config.read_text()) | {"hidden_size": 10**9}))
    assert main(["check-arch", str(tmp_path / "ckpt")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "moerl: error: tensor '" in out.err
    assert ("gate.weight' in model.safetensors has shape" if case == "tensor shape" else "1000000000") in out.err


BAD_VALUES = [
    ("hidden_size", "abc"), ("num_hidden_layers", None), ("num_experts_per_tok", -3), ("rms_norm_eps", 0),
    ("tie_word_embeddings", "yes"), ("sliding_window", 0), ("mlp_only_layers", 1.5), ("num_key_value_heads", 0),
    ("vocab_size", [1, 2]), ("max_position_embeddings", {"a": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_check_arch_names_a_config_value_of_the_wrong_type_or_range(field, value, without_bridge, tmp_path, capsys):
    """Strings, nulls, negatives, lists where sizes go: one line naming the field (``moerl: error: ...``), rc 2,
    whether moerl's check or transformers' own finds it."""
    from moerl.cli import main

    arch = "Qwen3MoeForCausalLM"
    build_hf_model(arch).save_pretrained(tmp_path / "ckpt")
    without_bridge(arch)
    config = tmp_path / "ckpt" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {field: value}))
    assert main(["check-arch", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moerl: error: ") and field in err, err
