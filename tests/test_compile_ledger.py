"""What a compilation cost, remembered beside inductor's cache (``moerl.dynamo``): a graph's identity across runs
(the same model and settings: one key; another size, dtype, LoRA slot count or setting: another), the ledger
written and read back, robust to a missing, torn or foreign file, and bounded."""

import json

import pytest
import torch

from moerl import dynamo
from moerl.model.lora import LoraConfig, attach_lora
from moerl.presets import init_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moerl.bridges import load_model

    path = tmp_path_factory.mktemp("tiny")
    init_model("qwen3_moe", "tiny", path)
    return lambda dtype=torch.float32: load_model(path, dtype=dtype)


def test_a_graph_key_names_the_model_and_the_settings_it_is_traced_with(tiny):
    key = dynamo.graph_key("step", tiny(), True)
    assert key == dynamo.graph_key("step", tiny(), True)  # another load of the same checkpoint: the same graph
    other = tiny()
    with torch.no_grad():
        other.layers[0].self_attn.q_proj.weight.add_(1.0)  # values are not the graph's
    assert dynamo.graph_key("step", other, True) == key
    different = {
        "the setting": dynamo.graph_key("step", tiny(), False),
        "what": dynamo.graph_key("blocks", tiny(), True),
        "the dtype": dynamo.graph_key("step", tiny(dtype=torch.bfloat16), True),
    }
    for slots in (1, 2):
        model = tiny()
        attach_lora(model, LoraConfig(rank=4, slots=slots))
        different[f"LoRA, {slots} slot(s)"] = dynamo.graph_key("step", model, True)
    assert len({key, *different.values()}) == 1 + len(different), (key, different)


def test_the_ledger_remembers_the_last_compilation_and_refuses_what_it_cannot_read(tmp_path, capsys):
    assert dynamo.remembered_seconds("a") is None and dynamo.remembered_seconds(None) is None
    assert dynamo.price(dynamo.remembered_seconds("a"), 30.0) == (30.0, "the ~30 s a first compilation takes")
    with dynamo.first_compile("the step", "rollout.compile_decode", True, graph="a"):
        pass
    assert 0 <= dynamo.remembered_seconds("a") < 1
    assert "moerl: compiled the step: the first call took" in capsys.readouterr().err
    dynamo._remember("a", 12.345)
    dynamo._remember("b", 3.0)
    assert dynamo.remembered_seconds("a") == 12.35 and dynamo.remembered_seconds("b") == 3.0
    assert dynamo.price(dynamo.remembered_seconds("a"), 30.0) == (
        12.35,
        "the 12.3 s it took when it last compiled here",
    )
    with dynamo.first_compile("the step", "x", True):  # no graph: nothing recorded
        pass
    assert set(json.loads(dynamo.ledger_path().read_text())) == {"a", "b"}
    path = dynamo.ledger_path()
    for text in ["{not json", '["a", 1]', '{"a": "12"}', '{"a": -1}', '{"a": NaN}', ""]:
        path.write_text(text)
        assert dynamo.remembered_seconds("a") is None, text  # priced as a first compilation
    dynamo._remember("c", 2.0)  # a torn file is replaced, not a crash
    assert json.loads(path.read_text()) == {"c": 2.0}


def test_the_ledger_keeps_the_latest_graphs(monkeypatch):
    monkeypatch.setattr(dynamo, "LEDGER_GRAPHS", 3)
    for i in range(5):
        dynamo._remember(f"g{i}", float(i))
    dynamo._remember("g2", 7.0)  # compiled again: its record is the newest
    dynamo._remember("g5", 5.0)
    assert list(json.loads(dynamo.ledger_path().read_text())) == ["g4", "g2", "g5"]


def test_a_cache_directory_that_cannot_be_written_leaves_the_run_alone(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(dynamo, "ledger_path", lambda: blocked / "sub" / dynamo.LEDGER)
    dynamo._remember("a", 1.0)  # its parent is a file: nothing written, nothing raised
    assert dynamo.remembered_seconds("a") is None
