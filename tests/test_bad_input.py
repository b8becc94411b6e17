"""Bad checkpoints and configs fail with errors that name the thing that is wrong."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moerl.bridges import load_model
from moerl.errors import CheckpointError, ConfigError, UnknownArchitectureError

ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture
def ckpt(hf_checkpoints, tmp_path):
    """A writable copy of the Qwen3-MoE test checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints[ARCH][0], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unknown_architecture_lists_supported(ckpt):
    _edit_config(ckpt, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnknownArchitectureError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "'LlamaForCausalLM'" in msg
    for arch in (
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        "OlmoeForCausalLM",
        "DeepseekV3ForCausalLM",
        "GptOssForCausalLM",
    ):
        assert arch in msg


def test_missing_architectures_field(ckpt):
    _edit_config(ckpt, architectures=...)
    with pytest.raises(UnknownArchitectureError, match="'architectures' is missing"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    pattern = r"missing tensor\(s\).*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"
    with pytest.raises(CheckpointError, match=pattern):
        load_model(ckpt)


def test_missing_plain_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.0.self_attn.q_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\).*model\.layers\.0\.self_attn\.q_norm\.weight"):
        load_model(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.mystery\.weight'"):
        load_model(ckpt)


def test_expert_beyond_num_experts_is_unexpected(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.8\.up_proj"):
        load_model(ckpt)


def test_wrong_shape_names_both_shapes(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)))
    pattern = r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*shape \(16, 64\).*expects \(32, 64\)"
    with pytest.raises(CheckpointError, match=pattern):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"hidden_size": 10**9}, r"this config needs \d+\.\d TB for its weights alone .*; cpu has [\d.]+ GB available"),
        ({"num_experts": 10**7}, r"this config needs \d+\.\d (TB|GB) for its weights alone"),
        ({"num_hidden_layers": 10**6}, r"num_layers=1000000: moerl builds a module per layer and takes at most 4096"),
    ],
)
def test_a_config_too_large_for_this_machine_is_refused_before_anything_is_allocated(ckpt, changes, pattern):
    """Judged from the config on meta tensors (the 10^9-wide model would need terabytes): refused in well under a
    second, before the weights' memory is asked for; the same check guards ``moerl generate`` and the trainer."""
    import time

    _edit_config(ckpt, **changes)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=pattern):
        load_model(ckpt)
    assert time.monotonic() - start < 30


def test_a_wrong_shape_is_refused_from_the_header_before_the_weights_are_allocated(ckpt, monkeypatch):
    """The safetensors header is enough: the model is never materialised (``to_empty`` would be its allocation)."""
    from moerl.model.transformer import MoEModel

    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.2.mlp.gate.weight", torch.zeros(8, 63)))

    def never(self, *a, **k):
        raise AssertionError("the model was allocated before its tensors' shapes were checked")

    monkeypatch.setattr(MoEModel, "to_empty", never)
    wrong = r"'model\.layers\.2\.mlp\.gate\.weight'.*shape \(8, 63\).*expects \(8, 64\)"
    with pytest.raises(CheckpointError, match=wrong):
        load_model(ckpt)


def test_config_field_missing(ckpt):
    _edit_config(ckpt, hidden_size=...)
    with pytest.raises(ConfigError, match=r"config\.json: required field 'hidden_size' is missing"):
        load_model(ckpt)


def test_config_field_wrong_type(ckpt):
    _edit_config(ckpt, num_experts_per_tok="2")
    with pytest.raises(ConfigError, match=r"field 'num_experts_per_tok' must be int, got str '2'"):
        load_model(ckpt)


def test_config_bool_is_not_an_int(ckpt):
    _edit_config(ckpt, num_hidden_layers=True)
    with pytest.raises(ConfigError, match=r"'num_hidden_layers' must be int, got bool"):
        load_model(ckpt)


def test_config_value_outside_allowed(ckpt):
    _edit_config(ckpt, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match=r"top_k=9.*\[1, num_experts=8\]"):
        load_model(ckpt)


@pytest.mark.parametrize(
    "field, value", [("topk_method", "greedy"), ("topk_method", "group_limited_greedy"), ("scoring_func", "softmax")]
)
def test_deepseek_v3_router_the_decoder_does_not_compute_is_refused(hf_checkpoints, tmp_path, field, value):
    """DeepSeek-V3's router is noaux_tc with sigmoid scores; another method in config.json would be computed wrong."""
    dst = tmp_path / "ds"
    shutil.copytree(hf_checkpoints["DeepseekV3ForCausalLM"][0], dst)
    _edit_config(dst, **{field: value})
    with pytest.raises(ConfigError, match=rf"field '{field}' is '{value}'; DeepSeek-V3 allows"):
        load_model(dst)


def test_config_json_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("text", "told"),
    [
        ("[1, 2]", "holds a JSON array; a model's config.json is an object"),
        ('"qwen3_moe"', "holds a JSON string; a model's config.json is an object"),
        ("null", "holds a JSON null; a model's config.json is an object"),
        ("[" * 200_000 + "]" * 200_000, "is JSON nested too deep to read"),
    ],
)
def test_a_config_json_that_is_not_an_object_is_named_by_every_command(tmp_path, capsys, text, told):
    """Each command that reads the config names the file (an array used to end in AttributeError, deep nesting in
    RecursionError, generate's in the tokenizer's TypeError): a checkpoint with its tokenizer, as init-model writes
    one."""
    from moerl.cli import main
    from moerl.presets import init_model

    ckpt = tmp_path / "ckpt"
    init_model("qwen3_moe", "tiny", ckpt)
    (ckpt / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'config.json'} {told}")):
        load_model(ckpt)
    for argv in (
        ["plan", f"model.path={ckpt}", "--gpus", "1", "--workers", "1"],
        ["train", f"model.path={ckpt}", f"run_dir={tmp_path / 'run'}", "train.steps=1"],
        ["check-arch", str(ckpt)],
        ["generate", str(ckpt), "--prompt", "12+7="],
        ["eval", str(ckpt), "--problems", "2"],
    ):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == f"moerl: error: {ckpt / 'config.json'} {told}\n", argv


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated or corrupt|cannot be read)"):
        load_model(ckpt)


def test_corrupt_safetensors_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage-header}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(ckpt)


def test_no_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_model(ckpt)


def test_shard_listed_in_index_but_absent(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors is listed"):
        load_model(ckpt)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"weight_map": {"a": ', r"model\.safetensors\.index\.json is not valid JSON"),
        ("[1, 2]", r"model\.safetensors\.index\.json has no 'weight_map' object"),
        ('{"weight_map": {"a": 3}}', r"model\.safetensors\.index\.json has no 'weight_map' object"),
    ],
)
def test_malformed_index_file(text, pattern, ckpt):
    (ckpt / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(ckpt)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/../../model.safetensors"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(name, ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
    with pytest.raises(CheckpointError, match=rf"lists the weight file '{re.escape(name)}', outside the checkpoint"):
        load_model(ckpt)


def test_a_json_file_larger_than_any_checkpoint_has_is_refused_before_it_is_read(ckpt, monkeypatch):
    from moerl.bridges import checkpoint as bridge_checkpoint

    monkeypatch.setattr(bridge_checkpoint, "MAX_JSON_BYTES", 64)  # the 64 MiB bound, scaled to this tiny config
    with pytest.raises(CheckpointError, match=r"config\.json has \d+ bytes; a checkpoint's JSON file has at most 64"):
        load_model(ckpt)


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_a_config_that_is_not_a_regular_file_is_refused_unread(ckpt, target):
    """``config.json`` -> ``/dev/zero`` would be read until memory runs out, a FIFO would block: neither is read."""
    import os

    (ckpt / "config.json").unlink()
    if target == "fifo":
        os.mkfifo(ckpt / "config.json")
    else:
        (ckpt / "config.json").symlink_to(target)
    with pytest.raises(CheckpointError, match=r"config\.json is not a regular file"):
        load_model(ckpt)


def test_a_weight_file_with_a_bad_header_is_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 8 + b"{not a header")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(ckpt)


def test_path_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint path '.*nowhere' does not exist"):
        load_model(tmp_path / "nowhere")


def test_path_without_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json does not exist"):
        load_model(tmp_path)
