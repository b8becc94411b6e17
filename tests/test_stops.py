"""Nothing lost however a run stops (issue 66). Ctrl-C at any moment of a step saves a state that a ``--resume`` goes
on from exactly as the run that never stopped (bit for bit: fp32, ``train.deterministic``, one process): during its
generation the last complete step, during its training the step itself once it ends, never a step half-trained. A
scheduler's signal or Ctrl-C during the supervised warm-up stops it saying so, leaves no half-built base and no lock,
and the requeued ``--resume`` starts the run. Real ``moerl train`` processes and real signals throughout."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import EASY, metric_rows

BOUND_S = 240  # each run here ends in 5-30 s on 2 cores; one that hangs is killed at this bound
CTRL_C_RUN = Path(__file__).parent / "ctrl_c_run.py"
STEPS = 4


def _args(run_dir, model, *over) -> list[str]:
    """The issue's run, shorter: rollouts of 8 prompts x 8 samples x 8 tokens, two optimizer steps a step, fp32 and
    deterministic; a checkpoint every 2 steps."""
    args = [f"run_dir={run_dir}", f"model.path={model}", "policy.mode=full", "policy.dtype=float32"]
    args += ["rollout.dtype=float32", "env.name=arithmetic", f"env.kwargs={json.dumps(EASY)}", "env.eval_problems=0"]
    args += ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_tokens=8", "rollout.max_model_len=32"]
    args += ["algo.mini_batches=2", "train.deterministic=true", f"train.steps={STEPS}", "train.checkpoint_every=2"]
    return [*args, "policy.optim.lr=1e-3", "policy.micro_batch_size=64", *over]


def _moerl(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=BOUND_S)


def _numbers(run_dir) -> dict[int, dict]:
    """Every metrics row by step, without its wall-clock measurements."""
    timed = lambda key: key.startswith("seconds_") or key.endswith("_per_s")  # noqa: E731
    return {r["step"]: {k: v for k, v in r.items() if not timed(k)} for r in metric_rows(run_dir)}


def _saved(run_dir) -> tuple[int, int]:
    """The run's checkpoint: the loop's step and the optimizer steps taken (two per loop step here)."""
    meta = json.loads((Path(run_dir) / "checkpoint" / "checkpoint.json").read_text())
    return meta["state"]["step"], meta["step"]


def _signalled(argv: list[str], after: str, sig: signal.Signals, log: Path) -> tuple[int, str]:
    """``python argv`` in a session of its own, sent ``sig`` (to the whole session, as a terminal's Ctrl-C or a
    scheduler's signal reaches it) as soon as its console shows ``after``; its exit code and console."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            # Ctrl-C as in a terminal: a test run in the background would hand SIGINT down ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + BOUND_S
        while after not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before {after!r}:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the signalled run did not end within {BOUND_S} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text()


@pytest.fixture(scope="module")
def straight(warm_model, tmp_path_factory):
    """The run that never stopped: its metrics rows."""
    run = tmp_path_factory.mktemp("straight") / "run"
    done = _moerl("-m", "moerl.cli", "train", *_args(run, warm_model))
    assert done.returncode == 0, done.stderr[-3000:]
    return _numbers(run)


# -- Ctrl-C in a step ------------------------------------------------------------------------------------------------

HELD = "moerl: Ctrl-C: step 3 has begun training; the run saves it and stops once it is complete (Ctrl-C again: stop"
MOMENTS = {  # where step 3's Ctrl-C lands (tests/ctrl_c_run.py): the step saved, what the console says
    "generating": (2, "moerl: interrupted after step 2; saving it"),
    "training": (3, HELD),
    "syncing": (3, HELD),
    "twice": (2, "moerl: stopped by a second Ctrl-C before step 3 was complete: nothing of it is saved; the last "
                 "checkpoint ("),
}  # fmt: skip


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_anywhere_in_a_step_resumes_as_the_run_that_never_stopped(moment, straight, warm_model, tmp_path):
    """A real SIGINT at each moment of step 3: exit 130, the state of a complete step saved (its two optimizer steps
    both taken, or neither), and ``--resume`` gives every metrics row of the uninterrupted run, exactly."""
    run = tmp_path / "run"
    stopped = _moerl(str(CTRL_C_RUN), moment, "train", *_args(run, warm_model))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    step, said = MOMENTS[moment]
    assert said in stopped.stderr, stopped.stderr[-3000:]
    assert _saved(run) == (step, 2 * step)
    resumed = _moerl("-m", "moerl.cli", "train", *_args(run, warm_model), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _numbers(run) == straight


def test_ctrl_c_from_outside_resumes_as_the_run_that_never_stopped(straight, warm_model, tmp_path):
    """``moerl train`` as a user runs it, Ctrl-C (SIGINT to its process group) once step 2 is done, wherever in step 3
    it lands: the resume's rows are the uninterrupted run's."""
    run = tmp_path / "run"
    argv = ["-m", "moerl.cli", "train", *_args(run, warm_model)]
    code, console = _signalled(argv, f"step 2/{STEPS}", signal.SIGINT, tmp_path / "log")
    assert code == 130, console[-3000:]
    step, optimizer_steps = _saved(run)
    assert step in (2, 3) and optimizer_steps == 2 * step
    assert f"moerl: interrupted after step {step}; saving it" in console
    resumed = _moerl(*argv, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _numbers(run) == straight


def test_the_comparison_sees_a_resume_from_a_half_trained_step(straight, warm_model, tmp_path):
    """The control: a KeyboardInterrupt raised between step 3's optimizer steps, where the signal lands (what Python's
    own handler does, and moerl did before it held the step), saves one optimizer step of step 3 as the state after
    step 2; the resume from it differs from the uninterrupted run in the numbers the issue saw (loss, pg_loss,
    grad_norm, entropy), its rows before agreeing."""
    run = tmp_path / "run"
    stopped = _moerl(str(CTRL_C_RUN), "unheld", "train", *_args(run, warm_model))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert _saved(run) == (2, 5)  # one optimizer step of step 3 in it
    resumed = _moerl("-m", "moerl.cli", "train", *_args(run, warm_model), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = _numbers(run)
    assert [got[s] for s in (0, 1, 2)] == [straight[s] for s in (0, 1, 2)]
    for step in (3, 4):
        differ = {k for k in straight[step] if got[step].get(k) != straight[step][k]}
        assert {"loss", "pg_loss", "grad_norm", "entropy"} <= differ, (step, differ)


def test_ctrl_c_is_held_from_a_steps_first_optimizer_step_to_its_end():
    """In one process, real SIGINTs: at once outside a hold; held (noted, no exception) from ``hold`` until
    ``step_done`` raises it; a second one while held raises at once, marked ``mid_step``. The handler is Python's
    again after; where SIGINT is ignored (a background job) it is left ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from moerl.preempt import CtrlC

        with CtrlC() as ctrl_c:
            ctrl_c.begin(0)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs between bytecodes of this thread
            ctrl_c.hold()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert ctrl_c.noted and not ctrl_c.mid_step
            with pytest.raises(KeyboardInterrupt):
                ctrl_c.step_done()
            ctrl_c.begin(1)
            ctrl_c.step_done()  # nothing noted: the step just ends
            ctrl_c.begin(2)
            ctrl_c.hold()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            assert ctrl_c.mid_step
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with CtrlC() as ctrl_c:
            ctrl_c.hold()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert not ctrl_c.noted
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()


def test_a_stop_saves_the_rng_streams_of_the_state_it_saves(warm_model, tmp_path):
    """A stop checkpoint of the state reached at a mark holds the RNG streams of that mark, not those the step in
    progress has drawn since: loaded, they draw what the run drew from the mark. Control: without a mark it holds
    the streams of the save's moment, which draw otherwise."""
    from moerl.trainer import Policy, PolicyConfig
    from moerl.trainer.checkpoint import load_checkpoint, rng_state

    cfg = PolicyConfig(mode="lora", dtype="float32")
    policy = Policy(warm_model, cfg)
    policy.stop_checkpoint_dir = tmp_path / "stop"
    policy.stop_state, policy.stop_rng = {"step": 1}, rng_state()
    after_mark = _draws()  # the step in progress draws
    policy.save_stop_checkpoint()
    load_checkpoint(tmp_path / "stop", Policy(warm_model, cfg))
    assert _draws() == after_mark

    policy.stop_rng = None
    policy.save_stop_checkpoint()
    load_checkpoint(tmp_path / "stop", Policy(warm_model, cfg))
    assert _draws() != after_mark


# -- a signal in the supervised warm-up ------------------------------------------------------------------------------

SFT_STEPS = 30


def _warm_up_args(tmp_path) -> list[str]:
    """A run from a random tiny model warmed up for SFT_STEPS supervised steps in its own base cache."""
    args = ["-m", "moerl.cli", "train", f"run_dir={tmp_path / 'run'}", f"model.base_cache={tmp_path / 'bases'}"]
    args += ["model.arch=qwen3_moe", "model.preset=tiny", f"model.sft_steps={SFT_STEPS}", "env.name=arithmetic"]
    args += [f"env.kwargs={json.dumps(EASY)}", "env.eval_problems=0", "rollout.prompts_per_step=4"]
    return [*args, "rollout.group_size=4", "rollout.max_tokens=4", "rollout.max_model_len=32", "train.steps=1"]


def _left(tmp_path) -> list[str]:
    """What the base cache and the run directory hold."""
    return sorted(str(p.relative_to(tmp_path)) for d in ("bases", "run") for p in (tmp_path / d).glob("*"))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_in_the_warm_up_stops_it_cleanly_and_the_resume_starts_the_run(sig, tmp_path):
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C) while the base model is being warmed up: one line naming the warm-up
    and what became of it, exit 143 / 130, no half-built base and no lock left. After SIGTERM the requeued command
    (the one the message gives, with --resume) starts the run: it builds the base again and trains."""
    argv = _warm_up_args(tmp_path)
    code, console = _signalled(argv, "[sft] step", getattr(signal, sig), tmp_path / "log")
    base = Path(next(x for x in console.splitlines() if "warming up a random" in x).split("reuse ")[1][:-1])
    gone = "before the run's first step: its partial build is removed (a later run builds it again)"
    if sig == "SIGTERM":
        assert code == 143, console[-3000:]
        line = next(x for x in console.splitlines() if x.startswith("moerl: stopped: "))
        assert line.startswith("moerl: stopped: SIGTERM during the warm-up, after "), line
        assert f"of {SFT_STEPS} supervised steps of the base model {base.name}, {gone}. Continue with: moerl" in line
        assert line.endswith(" --resume")
    else:
        assert code == 130, console[-3000:]
        assert f"moerl: Ctrl-C during the warm-up of the base model {base.name}, {gone}\n" in console
    assert "Traceback" not in console
    assert _left(tmp_path) == []  # no .building-*, no base, no .lock: nothing held, nothing half-written
    if sig == "SIGINT":
        return
    requeued = _moerl(*argv, "--resume")
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    said = f"moerl: {tmp_path / 'run'}: --resume: no run here yet (one stopped before its first step records none)"
    assert said in requeued.stderr
    assert (base / "config.json").exists() and _saved(tmp_path / "run")[0] == 1
    assert not list((tmp_path / "bases").glob(".building-*"))


def test_a_warm_up_killed_outright_is_cleared_by_the_next_build(tmp_path):
    """The control: SIGKILL in the warm-up (nothing can clean up) leaves its .building-* directory and the run's
    .lock, which the checks above would see. The next run's build removes the abandoned one, saying so (a live
    build, its lock held, is never taken for one), and a SIGTERM of that run leaves nothing again."""
    argv = _warm_up_args(tmp_path)
    code, console = _signalled(argv, "[sft] step", signal.SIGKILL, tmp_path / "log")
    assert code == -9
    left = _left(tmp_path)
    assert len(left) == 2 and left[0].startswith("bases/.building-") and left[1] == "run/.lock", left
    code, console = _signalled([*argv, "--resume"], "[sft] step", signal.SIGTERM, tmp_path / "log2")
    assert code == 143, console[-3000:]
    assert f"moerl: removed {tmp_path / left[0]}, a warm-up left half-built by a process that was killed" in console
    assert _left(tmp_path) == []
