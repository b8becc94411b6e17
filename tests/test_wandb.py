"""``metrics.wandb``: a run logs its metrics and config to Weights & Biases, here in wandb's offline mode (files in
``run_dir/wandb``, read back record by record): the config the run recorded, every step's numbers as
``metrics.jsonl`` has them, one W&B run id per run directory (a resume goes on in the same W&B run). Off by default;
a run asking for it where wandb is missing is a named error."""

import json
import sys
from pathlib import Path

import pytest
from run_helpers import metric_rows, run_cfg

from moerl.errors import ConfigError
from moerl.loop import train

pytest.importorskip("wandb")

BLOCK = 32 * 1024  # wandb's transaction log: LevelDB's log format, 32 KiB blocks of checksummed records


def _records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file (wandb's own reader lives in its Go core now)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _logged(run_dir: Path) -> tuple[set[str], dict, dict[int, dict]]:
    """(the W&B run ids, the config, step -> numbers) of every offline W&B run under ``run_dir``."""
    ids, config, history = set(), {}, {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in _records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add(r.run.run_id)
                config |= {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif kind == "config":
                config |= {i.key: json.loads(i.value_json) for i in r.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history[row.pop("_step")] = row
    return ids, config, history


def test_a_run_logs_its_metrics_and_config_to_wandb_offline(warm_model, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # the run's own dir wins
    over = {"metrics.wandb.project": "moerl-test", "metrics.wandb.mode": "offline", "env.eval_problems": 0}
    train(run_cfg(tmp_path / "run", warm_model, "lora", steps=2, **over))
    ids, config, history = _logged(tmp_path / "run")
    assert ids == {(tmp_path / "run" / "wandb_id").read_text().strip()}
    value = lambda v: v["value"] if isinstance(v, dict) and "value" in v else v  # noqa: E731 - wandb wraps values
    assert value(config["policy"])["mode"] == "lora" and value(config["train"])["steps"] == 2
    rows = {r["step"]: r for r in metric_rows(tmp_path / "run")}
    assert sorted(history) == sorted(rows) == [0, 1, 2]
    for step, row in rows.items():
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and v is not None}
        assert {k: history[step][k] for k in numbers} == numbers, step
    # a resume goes on in the same W&B run
    train(run_cfg(tmp_path / "run", warm_model, "lora", steps=3, **over), resume=True)
    ids, _, history = _logged(tmp_path / "run")
    assert ids == {(tmp_path / "run" / "wandb_id").read_text().strip()} and 3 in history
    # off by default: nothing of W&B in a run that does not ask
    train(run_cfg(tmp_path / "plain", warm_model, "lora", steps=1, **{"env.eval_problems": 0}))
    assert not (tmp_path / "plain" / "wandb").exists() and not (tmp_path / "plain" / "wandb_id").exists()


def test_wandb_asked_for_where_it_is_not_installed_is_named(warm_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    over = {"metrics.wandb.project": "p", "metrics.wandb.mode": "offline", "env.eval_problems": 0}
    with pytest.raises(ConfigError, match=r"'metrics.wandb.project'='p': Weights & Biases is not installed here; pip"):
        train(run_cfg(tmp_path / "run", warm_model, "lora", steps=1, **over))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # before the run's records were written
