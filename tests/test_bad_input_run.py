"""Run directories are owned and a resume is the same run: every refusal names the problem and leaves the directory
exactly as it was (hash of every file before and after)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from run_helpers import metric_rows, run_cfg, tree_hash

from moerl.cli import main
from moerl.errors import ConfigError, RunDirError
from moerl.loop import train
from moerl.metrics import METRICS
from moerl.rundir import RunDir, RunLock


@pytest.fixture(scope="module")
def done_run(warm_model, tmp_path_factory):
    """A finished 2-step LoRA run (checkpoint at step 2), copied per test by ``run_copy``."""
    run = tmp_path_factory.mktemp("done") / "run"
    train(run_cfg(run, warm_model, steps=2, **{"env.eval_problems": 4}))
    return run


@pytest.fixture
def run_copy(done_run, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(done_run, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["run_dir"] = str(dst)  # as if the run had been started here
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


def _cfg(run, warm_model, steps=2, **over):
    return run_cfg(run, warm_model, steps=steps, **{"env.eval_problems": 4, **over})


def test_a_run_has_one_metrics_row_per_step(done_run):
    assert [r["step"] for r in metric_rows(done_run)] == [0, 1, 2]
    rows = metric_rows(done_run)
    assert "eval_accuracy" in rows[0] and "eval_accuracy_sampled" in rows[-1] and "loss" in rows[-1]
    assert not (done_run / ".lock").exists()  # released at the end


@pytest.mark.parametrize("existing", ["config.yaml", "metrics.jsonl", "checkpoint"])
def test_a_new_run_refuses_a_directory_holding_a_run(existing, warm_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    if existing == "checkpoint":
        (run / existing).mkdir()
    else:
        (run / existing).write_text("step: 1\n")
    before = tree_hash(run)
    with pytest.raises(RunDirError, match=rf"already holds a run \({existing}\).*--resume.*--overwrite"):
        train(_cfg(run, warm_model))
    assert tree_hash(run) == before


def test_overwrite_starts_over_and_says_what_it_removed(run_copy, warm_model, capsys):
    (run_copy / "notes.txt").write_text("mine")
    train(_cfg(run_copy, warm_model, steps=1), overwrite=True)
    err = capsys.readouterr().err
    assert "--overwrite: removed the previous run's" in err and "checkpoint" in err and "metrics.jsonl" in err
    assert [r["step"] for r in metric_rows(run_copy)] == [0, 1]
    assert (run_copy / "notes.txt").read_text() == "mine"  # not a run file: kept


def test_resume_and_overwrite_together_are_refused(run_copy, warm_model):
    before = tree_hash(run_copy)
    with pytest.raises(ConfigError, match="--resume and --overwrite contradict"):
        train(_cfg(run_copy, warm_model), resume=True, overwrite=True)
    assert tree_hash(run_copy) == before


def test_a_second_process_is_refused_while_the_first_holds_the_lock(run_copy, warm_model):
    holder = RunLock(run_copy).acquire()  # another open file description: flock conflicts as across processes
    try:
        before = tree_hash(run_copy)
        with pytest.raises(RunDirError, match=rf"is in use by another process \(pid and host: {os.getpid()} "):
            train(_cfg(run_copy, warm_model, steps=3), resume=True)
        assert tree_hash(run_copy) == before
    finally:
        holder.release()
    assert not (run_copy / ".lock").exists()


def test_a_stale_lock_of_a_killed_process_is_taken_over(run_copy, warm_model, capsys):
    code = "import sys, time; from pathlib import Path; from moerl.rundir import RunLock; "
    code += "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_copy)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirError, match=rf"pid and host: {proc.pid} "):
        RunDir.open(_cfg(run_copy, warm_model, steps=3), resume=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run_copy / ".lock").exists()  # left behind by kill -9, held by nobody
    train(_cfg(run_copy, warm_model, steps=3), resume=True)
    assert f"took over the stale lock of {run_copy} left by an exited process ({proc.pid} " in capsys.readouterr().err
    assert [r["step"] for r in metric_rows(run_copy)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("policy.mode=full", "policy.mode"),
        ("policy.lora.rank=4", "policy.lora.rank"),
        ("algo.loss.kind=gspo", "algo.loss.kind"),
        ("train.seed=5", "train.seed"),
        ("rollout.group_size=4", "rollout.group_size"),
        ("env.kwargs={max_operand: 9}", "env.kwargs"),
    ],
)
def test_resume_refuses_changes_to_fields_that_define_the_run(override, field, run_copy, warm_model):
    key, value = override.split("=", 1)
    before = tree_hash(run_copy)
    with pytest.raises(ConfigError, match=rf"cannot change mid-run \({field}: .* -> "):
        train(_cfg(run_copy, warm_model, steps=3, **{key: yaml.safe_load(value)}), resume=True)
    assert tree_hash(run_copy) == before


def test_resume_applies_and_records_allowed_changes(run_copy, warm_model):
    original = (run_copy / "config.yaml").read_text()
    changes = {"policy.optim.lr": 0.002, "train.eval_every": 1, "policy.compile": False}
    train(_cfg(run_copy, warm_model, steps=3, **changes), resume=True)
    rows = metric_rows(run_copy)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["lr"] != 0.002 and rows[3]["lr"] == 0.002  # applied for real from the resume on
    assert (run_copy / "config.yaml").read_text() == original  # the original record is never rewritten
    history = [json.loads(line) for line in (run_copy / "config_history.jsonl").read_text().splitlines()]
    assert history == [
        {
            "step": 2,
            "changes": {
                "train.steps": {"from": 2, "to": 3},
                "train.eval_every": {"from": 0, "to": 1},
                "policy.optim.lr": {"from": rows[2]["lr"], "to": 0.002},
                "policy.compile": {"from": "auto", "to": False},
            },
        }
    ]
    # resuming the finished run with the same config changes nothing and records nothing
    train(_cfg(run_copy, warm_model, steps=3, **changes), resume=True)
    assert len((run_copy / "config_history.jsonl").read_text().splitlines()) == 1
    assert [r["step"] for r in metric_rows(run_copy)] == [0, 1, 2, 3]


def test_resume_below_the_checkpoint_step_is_refused(run_copy, warm_model):
    before = tree_hash(run_copy)
    with pytest.raises(ConfigError, match=r"'train.steps'=1 is below the checkpoint's step 2"):
        train(_cfg(run_copy, warm_model, steps=1), resume=True)
    assert tree_hash(run_copy) == before


def test_resume_drops_rows_after_the_checkpoint_and_a_cut_last_line(run_copy, warm_model, capsys):
    with (run_copy / "metrics.jsonl").open("a") as f:  # a run killed after logging step 3, mid-way through step 4
        f.write(json.dumps({"step": 3, "reward_mean": 0.5}) + "\n" + '{"step": 4, "rew')
    train(_cfg(run_copy, warm_model, steps=4), resume=True)
    assert "dropped 2 row(s) logged after the checkpoint's step 2" in capsys.readouterr().err
    rows = metric_rows(run_copy)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "loss" in rows[3]


@pytest.mark.parametrize("case", ["no dir", "no checkpoint", "truncated checkpoint", "no config"])
def test_resume_without_a_run_is_refused(case, run_copy, warm_model, tmp_path):
    import shutil

    from moerl.trainer.checkpoint import TENSORS

    run = tmp_path / "nowhere" if case == "no dir" else run_copy
    if case == "no checkpoint":
        shutil.rmtree(run / "checkpoint")
    if case == "truncated checkpoint":  # the file and the fault named (a shard of a sharded one alike)
        tensors = run / "checkpoint" / TENSORS
        tensors.write_bytes(tensors.read_bytes()[:-100])
    if case == "no config":
        (run / "config.yaml").unlink()
    before = tree_hash(run)
    pattern = {
        "no dir": "does not exist",
        "no checkpoint": "no complete checkpoint",
        "truncated checkpoint": rf"no complete checkpoint in \S+ \(\S+/{TENSORS} has \d+ bytes, .* truncated",
        "no config": "config.yaml is",
    }
    with pytest.raises(RunDirError, match=pattern[case]):
        train(_cfg(run, warm_model, steps=3), resume=True)
    assert tree_hash(run) == before


def test_unwritable_run_directory_is_a_named_error(warm_model, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match=r"cannot be created"):
        train(_cfg(blocker / "run", warm_model))
    with pytest.raises(RunDirError, match=r"exists and is not a directory"):
        train(_cfg(blocker, warm_model))
    assert main(["train", f"run_dir={blocker / 'run'}", f"model.path={warm_model}"]) == 2
    assert "moerl: error: run directory" in capsys.readouterr().err
    assert blocker.read_text() == "x"


def test_malformed_yaml_is_a_named_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  mode: full\n  optim: [1, 2\nrollout: {}\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"config file '{bad}' is not valid YAML (line 4, column" in err and "Traceback" not in err


def test_init_model_refuses_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = tree_hash(out)
    assert main(["init-model", "--arch", "qwen3_moe", str(out)]) == 2
    assert "is not empty (notes.txt); pass --overwrite" in capsys.readouterr().err
    assert tree_hash(out) == before
    assert main(["init-model", "--arch", "qwen3_moe", "--overwrite", str(out)]) == 0
    assert (out / "config.json").exists() and (out / "notes.txt").read_text() == "mine"


def test_demo_refuses_a_previous_demo_without_overwrite(tmp_path):
    from moerl.demo import run_demo

    demo = tmp_path / "demo"
    (demo / "rl").mkdir(parents=True)
    (demo / "rl" / "config.yaml").write_text("run_dir: x\n")
    before = tree_hash(demo)
    with pytest.raises(RunDirError, match=r"holds a previous demo .*--overwrite"):
        run_demo(str(demo), sft_steps=1, rl_steps=1)
    assert tree_hash(demo) == before


def test_the_lock_is_released_when_the_run_fails(run_copy, warm_model, monkeypatch):
    from moerl import loop

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "rl_step", boom)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(run_copy, warm_model, steps=3), resume=True)
    assert not (run_copy / ".lock").exists()  # nothing holds it: a new run may start at once
    RunDir.open(_cfg(run_copy, warm_model, steps=3), resume=True).close()


def test_resume_from_a_corrupt_checkpoint_is_refused_and_writes_nothing(run_copy, warm_model):
    from moerl.errors import CheckpointError

    tensors = run_copy / "checkpoint" / "checkpoint.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0x10
    tensors.write_bytes(bytes(data))
    before = tree_hash(run_copy)
    with pytest.raises(CheckpointError, match=r"checkpoint\.safetensors is corrupt: its SHA-256 differs"):
        train(_cfg(run_copy, warm_model, steps=3, **{"policy.optim.lr": 0.002}), resume=True)
    assert tree_hash(run_copy) == before  # no config history, no metrics cut, no lock left


def test_resume_recovers_the_checkpoint_an_interrupted_save_left_complete(run_copy, warm_model, capsys):
    (run_copy / "checkpoint").rename(run_copy / "checkpoint.tmp")  # killed between the two renames of a save
    train(_cfg(run_copy, warm_model, steps=3), resume=True)
    assert "recovered the complete checkpoint checkpoint.tmp left by an interrupted save" in capsys.readouterr().err
    assert not (run_copy / "checkpoint.tmp").exists()
    assert [r["step"] for r in metric_rows(run_copy)] == [0, 1, 2, 3]


def test_overrides_may_follow_the_flags_as_the_readme_writes_them(run_copy, warm_model, capsys):
    # `moerl train CFG --resume train.steps=200`: argparse alone refused the overrides after the flag
    from moerl.cli import parse_args

    args = parse_args(["train", "cfg.yaml", "a.b=1", "--resume", "train.steps=200", "--overwrite", "c=2"])
    assert (args.config, args.resume, args.overwrite) == ("cfg.yaml", True, True)
    assert args.overrides == ["a.b=1", "train.steps=200", "c=2"]
    with pytest.raises(SystemExit):
        parse_args(["train", "cfg.yaml", "--resume", "--bogus"])  # an unknown flag stays refused, named
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["plot", "runs/x", "y=1"])  # only train takes overrides
    assert "unrecognized arguments: y=1" in capsys.readouterr().err
    recorded = str(run_copy / "config.yaml")  # the run's own config, then the README's order
    assert main(["train", recorded, "--resume", "train.steps=3"]) == 0
    assert [r["step"] for r in metric_rows(run_copy)] == [0, 1, 2, 3]


def test_a_bare_train_command_prints_how_to_use_it_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """``moerl train`` with neither a config nor overrides used to start a 50-step run in runs/run."""
    from moerl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert "moerl: error: moerl train needs a config file and/or key=value overrides" in err
    assert "nothing was started" in err and not (tmp_path / "runs").exists()


def test_a_ray_run_without_ray_names_the_extra(tmp_path, monkeypatch, capsys):
    """cluster.backend: ray where Ray does not import: one line naming the install, as vLLM's absence is named."""
    import sys

    from moerl.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # what an interpreter without Ray sees: import fails
    assert main(["train", f"run_dir={tmp_path / 'run'}", "cluster.backend=ray"]) == 2
    err = capsys.readouterr().err
    assert "moerl: error: cluster.backend: ray needs Ray, which is not installed here" in err
    assert "pip install -e '.[ray]'" in err and not (tmp_path / "run").exists()


ROWS = [{"step": s, "reward_mean": 0.1 * s, "accuracy": 0.1, "mismatch_k3_r3": 1e-6, "mismatch_k3_no_r3": 1e-4}
        for s in range(3)]  # fmt: skip
READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1"'  # "$1" read-only in this mount namespace


def test_plot_on_a_read_only_run_directory_names_the_file_and_suggests_out(tmp_path):
    """A real read-only directory (a read-only bind mount in a mount namespace of the command's own: even root may
    not write there): one line naming the file, exit 2, the directory as it was; ``--out`` elsewhere draws."""
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    probe = subprocess.run([*namespace, READ_ONLY, "sh", str(run)], capture_output=True, text=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"no mount namespace here to make a directory read-only: {probe.stderr.strip()}")
    before = tree_hash(run)
    command = f'{READ_ONLY} && exec "$2" -m moerl.cli plot "$1" ${{3:+--out "$3"}}'
    plot = [*namespace, command, "sh", str(run), sys.executable]
    out = subprocess.run(plot, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"moerl: error: cannot write the curves to {run / 'curves.png'} (Read-only file system): pass --out with a "
        "path you can write, e.g. --out curves.png\n"
    )
    assert tree_hash(run) == before
    elsewhere = subprocess.run([*plot, str(tmp_path / "c.png")], capture_output=True, text=True, timeout=300)
    assert elsewhere.returncode == 0, elsewhere.stderr  # control: the same command with --out draws
    assert (tmp_path / "c.png").stat().st_size > 0 and tree_hash(run) == before


def test_plot_where_a_directory_holds_the_files_name_is_named(tmp_path, capsys):
    (tmp_path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "curves.png").mkdir()
    assert main(["plot", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"moerl: error: cannot write the curves to {tmp_path / 'curves.png'} (Is a directory): pass --out with a path "
        "you can write, e.g. --out curves.png\n"
    )
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'c.png'}\n"


def test_plot_of_metrics_nested_too_deep_is_named_by_line(tmp_path, capsys):
    (tmp_path / METRICS).write_text(json.dumps(ROWS[0]) + "\n" + "[" * 200_000 + "]" * 200_000 + "\n{}\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"moerl: error: {tmp_path / METRICS} line 2 is JSON nested too deep to read\n"
    assert not (tmp_path / "curves.png").exists()


def test_a_refused_new_run_takes_back_the_directories_it_made(warm_model, tmp_path, monkeypatch):
    """Bad input found once the run directory is open (W&B asked for, not installed): the directories made for the
    run are gone again, nothing of them left; a run directory that was there before stays, as it was."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    over = {"metrics.wandb.project": "p", "env.eval_problems": 0}
    with pytest.raises(ConfigError, match="Weights & Biases is not installed"):
        train(run_cfg(tmp_path / "a" / "b" / "run", warm_model, steps=1, **over))
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    before = tree_hash(tmp_path / "kept")
    with pytest.raises(ConfigError, match="Weights & Biases is not installed"):
        train(run_cfg(tmp_path / "kept", warm_model, steps=1, **over))
    assert (tmp_path / "kept").is_dir() and tree_hash(tmp_path / "kept") == before
