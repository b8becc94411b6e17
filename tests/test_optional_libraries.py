"""TensorBoard and matplotlib are optional (``metrics.tensorboard`` / ``metrics.plot``: auto, true, false): a GPU
machine's own python may have neither, and ``moerl train`` must still start there. The libraries are made absent
the way a python without them is: their import fails (``sys.modules[name] = None``); an install broken another way
(its import raises TypeError) is a real package of that name first on ``sys.path``."""

import re
import sys

import pytest
from run_helpers import metric_rows

from moerl.cli import main
from moerl.errors import ConfigError
from moerl.metrics import optional, plot_run

ABSENT = ("tensorboard", "torch.utils.tensorboard", "matplotlib", "matplotlib.pyplot")


@pytest.fixture
def without_them(monkeypatch):
    for name in ABSENT:
        monkeypatch.setitem(sys.modules, name, None)


def _args(run, model, *over) -> list[str]:
    return [
        "train",
        f"run_dir={run}",
        f"model.path={model}",
        "policy.dtype=float32",
        "rollout.dtype=float32",
        "train.steps=1",
        "env.eval_problems=4",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_tokens=3",
        "rollout.max_model_len=32",
        *over,
    ]


def test_a_run_without_tensorboard_and_matplotlib_trains_and_says_so(warm_model, tmp_path, without_them, capfd):
    run = tmp_path / "run"
    assert main(_args(run, warm_model)) == 0
    err = capfd.readouterr().err
    assert "metrics.tensorboard=auto: torch.utils.tensorboard does not import here" in err
    assert "metrics.plot=auto: matplotlib does not import here" in err
    assert [r["step"] for r in metric_rows(run)] == [0, 1]
    assert not (run / "tensorboard").exists() and not (run / "curves.png").exists()


def test_the_same_run_with_them_writes_both(warm_model, tmp_path):
    """The control: where the libraries import, auto writes the events and the picture."""
    run = tmp_path / "run"
    assert main(_args(run, warm_model)) == 0
    assert any((run / "tensorboard").iterdir()) and (run / "curves.png").stat().st_size > 0


@pytest.mark.parametrize(("key", "module"), [("tensorboard", "torch.utils.tensorboard"), ("plot", "matplotlib")])
def test_asking_for_a_missing_one_is_refused_before_the_run_writes(
    warm_model, tmp_path, without_them, capfd, key, module
):
    run = tmp_path / "run"
    assert main(_args(run, warm_model, f"metrics.{key}=true")) == 2
    err = capfd.readouterr().err
    assert f"config key 'metrics.{key}'=true: {module} does not import here" in err and "pip install" in err
    assert not run.exists()  # refused before the run wrote anything: the directory made for it is gone too


def test_off_writes_neither_where_they_import(warm_model, tmp_path):
    run = tmp_path / "run"
    assert main(_args(run, warm_model, "metrics.tensorboard=false", "metrics.plot=false")) == 0
    assert not (run / "tensorboard").exists() and not (run / "curves.png").exists()


def test_moerl_plot_without_matplotlib_names_it(tmp_path, without_them):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    with pytest.raises(ConfigError, match="needs matplotlib, which does not import here.*pip install matplotlib"):
        plot_run(tmp_path)


@pytest.mark.parametrize("value", ["always", 1, "none"])
def test_a_setting_other_than_auto_true_false_is_named(value):
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    named = r"'metrics\.tensorboard'.*(allowed: auto, true, false|bool \(true or false\) or one of 'auto')"
    with pytest.raises(ConfigError, match=named):
        load_config(RunConfig, None, [f"metrics.tensorboard={value}"])


def _broken(name: str, tmp_path, monkeypatch) -> None:
    """Package ``name`` installed but raising TypeError as it imports (as a mismatched protobuf makes wandb do): a
    real package first on ``sys.path``, what was imported of the real one forgotten for the test."""
    package = tmp_path / "site" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise TypeError("Descriptors cannot be created directly.")\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        monkeypatch.delitem(sys.modules, loaded)


def test_a_wandb_that_fails_to_import_is_named_with_how_to_fix_or_turn_it_off(warm_model, tmp_path, monkeypatch, capfd):
    _broken("wandb", tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert main(_args(run, warm_model, "metrics.wandb.project=p", "metrics.wandb.mode=offline")) == 2
    assert capfd.readouterr().err.splitlines()[-1] == (
        "moerl: error: config key 'metrics.wandb.project'='p': Weights & Biases is installed but does not import "
        "(importing it raised TypeError: Descriptors cannot be created directly.); reinstall it (pip install "
        "--force-reinstall 'moerl[wandb]') or set metrics.wandb.project to \"\" to log without it"
    )
    assert not run.exists()  # refused before the run wrote anything: the directory made for it is gone too


def test_a_plot_library_that_fails_to_import_is_told_as_a_missing_one(tmp_path, monkeypatch):
    _broken("matplotlib", tmp_path, monkeypatch)
    told = "matplotlib does not import here (importing it raised TypeError: Descriptors cannot be created directly.)"
    with pytest.raises(ConfigError, match=re.escape(f"config key 'metrics.plot'=true: {told}; pip install")):
        optional("plot", True)
    assert optional("plot", "auto") == (False, f"moerl: metrics.plot=auto: {told}, so the run goes without it")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    with pytest.raises(ConfigError, match=re.escape(f"needs matplotlib, which {told.removeprefix('matplotlib ')}")):
        plot_run(tmp_path)
