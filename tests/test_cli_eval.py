"""``moerl eval``: a checkpoint's (and adapter's) held-out accuracy with its interval, as the run measured it."""

import json
import re
import shutil

import pytest
import torch
from run_helpers import EASY, metric_rows, run_cfg
from safetensors.torch import load_file, save_file

from moerl.cli import main
from moerl.loop import train


def run(args: list, capsys) -> tuple[int, str, str]:
    code = main(["eval", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_of_a_trained_adapter_reproduces_the_runs_final_evaluation(warm_model, tmp_path, capsys):
    """A LoRA run exports its adapter; ``moerl eval`` of the base with that adapter, on the run's env and held-out
    problems (same seed, fp32, greedy), prints the run's final accuracy, interval and problem count; the base alone
    scores what the run measured before training."""
    env = json.dumps(EASY | {"test_fraction": 0.6})  # ~15 distinct held-out problems of the 25
    over = {"policy.optim.lr": 3e-3, "env.kwargs": env}
    train(run_cfg(tmp_path / "run", warm_model, "lora", steps=4, **over))
    rows = metric_rows(tmp_path / "run")
    args = [warm_model, "--env", "arithmetic", "--env-kwargs", env, "--problems", 16]
    args += ["--max-tokens", 3, "--dtype", "float32"]
    capsys.readouterr()
    code, out, err = run([*args, "--adapter", tmp_path / "run" / "adapter"], capsys)
    assert code == 0, err
    got = re.fullmatch(r"held-out accuracy (\d+\.\d)% \(95% CI (\d+\.\d)%-(\d+\.\d)%, (\d+) problems\) on .*\n", out)
    assert got, out
    after = rows[-1]
    want = [f"{100 * after[k]:.1f}" for k in ("eval_accuracy", "eval_accuracy_low", "eval_accuracy_high")]
    assert list(got.groups()) == [*want, str(after["eval_problems"])]
    code, out, err = run(args, capsys)
    assert code == 0, err
    assert float(re.match(r"held-out accuracy (\d+\.\d)%", out).group(1)) == round(100 * rows[0]["eval_accuracy"], 1)
    # negative control: the adapter with its B matrices perturbed scores differently, so the adapter is what is read
    shutil.copytree(tmp_path / "run" / "adapter", tmp_path / "bad")
    tensors = load_file(tmp_path / "bad" / "adapter_model.safetensors")
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + torch.randn(v.shape, generator=gen) if "lora_B" in k else v for k, v in tensors.items()}
    save_file(noisy, tmp_path / "bad" / "adapter_model.safetensors")
    code, out, err = run([*args, "--adapter", tmp_path / "bad"], capsys)
    assert code == 0, err
    assert float(re.match(r"held-out accuracy (\d+\.\d)%", out).group(1)) != round(100 * after["eval_accuracy"], 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--env-kwargs", "{max_operand: 4}"], r"--env-kwargs '\{max_operand: 4\}' is not JSON"),
        (["--env-kwargs", "[4]"], r"--env-kwargs '\[4\]': must be a JSON object"),
        (["--env-kwargs", '{"max_op": 4}'], r"environment 'arithmetic' \(env.kwargs\): .*'max_op'"),
        (["--env", "chess"], r"unknown environment 'chess'"),
        (["--problems", "0"], r"--problems 0: must be >= 1"),
        (["--adapter", "/nowhere"], r"/nowhere/adapter_config.json does not exist"),
    ],
)
def test_bad_eval_options_are_named(warm_model, capsys, extra, message):
    code, out, err = run([warm_model, *extra], capsys)
    assert code == 2 and out == ""
    assert re.fullmatch(rf"moerl: error: [^\n]*{message}[^\n]*\n", err), err
