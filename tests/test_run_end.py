"""How runs end: ``moerl train`` on several ranks exits 0 within a bound after its last step, its exported results
load where they are meant to (transformers, PEFT, moerl), and nothing is left behind: no process of the run's
session, no /dev/shm segment the run made (another process's, made meanwhile, is not the run's). One case per path:
a hybrid family (fused projections: merged weights instead of a PEFT adapter) at ep=2, a Qwen3-MoE LoRA run at pp=2
with engine processes, an MLA family's full run at dp=2 with vLLM rollouts."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BOUND_S = 240  # each of these runs ends in 10-40 s on 2 cores; a run that hangs at its end is killed here
EXAMPLE = Path(__file__).parents[1] / "examples" / "lora_arithmetic.yaml"
SMALL = [
    "model.sft_steps=0",
    "train.steps=2",
    "env.eval_problems=0",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_tokens=4",
]
VLLM_EAGER = 'rollout.vllm_args={"enforce_eager": true}'
CASES = [
    ("qwen3_next", ["parallel.ep=2"], "merged"),
    ("qwen3_moe", ["parallel.pp=2", "rollout.placement=process", "rollout.num_engines=2"], "adapter"),
    # vLLM eager: compiling its graph adds ~40 s and nothing to how a run ends (test_vllm starts a compiled engine)
    ("deepseek_v3", ["parallel.dp=2", "policy.mode=full", "rollout.engine=vllm", VLLM_EAGER], "checkpoint"),
]
MLA_FOR_VLLM = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64}  # the latent vLLM's CPU kernel takes


def _session_processes(sid: int) -> list[str]:
    """The processes still in session ``sid`` (the run's launcher started it): pid and command line."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                left.append(f"{entry.name} {command[:200]}")
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
    return left


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# the creator's pid in a segment's name: moerl's SharedBuffer (``<tag>-<pid>-<12 hex>``), torch's (``torch_<pid>_...``)
SEGMENT_PID = re.compile(r"[\w.]+-(\d+)-[0-9a-f]{12}|torch_(\d+)_.*")


def _record_session(proc: subprocess.Popen) -> set[int]:
    """The pids of ``proc``'s session (it was started in a session of its own), recorded while it runs: polled every
    0.1 s by a thread that stops when ``proc`` ends (the ranks and engines that make segments live for seconds)."""
    pids = {proc.pid}

    def poll() -> None:
        while proc.poll() is None:
            pids.update(int(line.split()[0]) for line in _session_processes(proc.pid))
            time.sleep(0.1)

    threading.Thread(target=poll, daemon=True).start()
    return pids


def _mapped_by_a_live_process(name: str) -> bool:
    """Whether a live process maps /dev/shm segment ``name`` (read from each process's maps)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"/dev/shm/{name}" in (entry / "maps").read_text():
                return True
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return False


def _segments_left(before: set[str], run: set[int]) -> set[str]:
    """The /dev/shm segments a run whose processes were ``run`` (all ended now) made and left, not every segment new
    since ``before``: another process (the other test worker, another job) makes and removes its own meanwhile. A
    name with its creator's pid (``SEGMENT_PID``) is the run's when that pid was one of the run's; one without
    (vLLM's ``psm_*``) is the run's unless a live process maps it (a live one is not the run's)."""
    left = set()
    for name in _shm() - before:
        m = SEGMENT_PID.fullmatch(name)
        creator = int(m.group(1) or m.group(2)) if m else None
        if creator in run or (creator is None and not _mapped_by_a_live_process(name)):
            left.add(name)
    return left


@pytest.mark.parametrize(("arch", "layout", "made"), CASES, ids=[c[0] for c in CASES])
def test_a_run_on_several_ranks_ends_cleanly_with_its_results_loadable(arch, layout, made, tmp_path):
    from moerl.presets import init_model

    model = tmp_path / "model"
    init_model(arch, "tiny", model, seed=0, overrides=MLA_FOR_VLLM if "rollout.engine=vllm" in layout else None)
    run_dir = tmp_path / "run"
    args = [str(EXAMPLE), f"model.path={model}", f"run_dir={run_dir}", *SMALL, *layout]
    shm_before = _shm()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=os.environ | {"GLOO_SOCKET_IFNAME": "lo"},
    )
    run_pids = _record_session(proc)
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"the run did not end within {BOUND_S} s; its last lines:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-4000:]
    assert "training done" in err
    assert _session_processes(proc.pid) == [], "processes of the run outlived it"
    assert _segments_left(shm_before, run_pids) == set(), "shared-memory segments outlived the run"

    saved = json.loads((run_dir / "checkpoint" / "checkpoint.json").read_text())
    assert saved["state"]["step"] == 2
    said = {  # what the run wrote, on a line of its own in words
        "merged": f"moerl: wrote merged weights (the base with the adapters added in: a whole checkpoint, not a PEFT "
        f"adapter) to {run_dir / 'merged'}; PEFT cannot hold these adapters: ",
        "adapter": f"moerl: wrote the trained LoRA adapter (PEFT: peft loads it onto the base) to {run_dir}/adapter",
        "checkpoint": f"moerl: the trained weights are in the run's checkpoint {run_dir / 'checkpoint'} (this mode",
    }
    assert said[made] in err, err[-2000:]
    if made == "merged":  # transformers loads every tensor of the merged export, none missing or unexpected
        from transformers import AutoModelForCausalLM

        assert f"merged={run_dir / 'merged'}" in out
        _, info = AutoModelForCausalLM.from_pretrained(run_dir / "merged", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    elif made == "adapter":  # PEFT loads the adapter onto the base with every adapter tensor placed
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model)
        saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
        peft = PeftModel.from_pretrained(base, run_dir / "adapter")
        placed = {n for n, _ in peft.named_parameters() if "lora_" in n}
        assert len(placed) == len(saved) > 0
    else:  # full mode exports nothing: its last checkpoint, each rank's shards written, every tensor finite
        files = [run_dir / "checkpoint" / "shards" / name for name in saved["shards"]]
        assert len(files) == 2 and all(f.is_file() for f in files)
        tensors = [t for f in files for t in load_file(f).values()]
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


# what a leaking run leaves and what another process makes meanwhile: a moerl buffer (its creator's pid in the name)
# and a segment named as multiprocessing's (vLLM's kind: no pid), made without its resource tracker (a process of
# its own that would unlink the leak)
_SEGMENTS = """
import mmap, os, secrets, sys, time
from moerl.rollout.shm import SharedBuffer
buf, name = SharedBuffer.create(64), f"psm_{secrets.token_hex(4)}"
fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 64)
mp = mmap.mmap(fd, 64)
print(buf.path.rsplit("/", 1)[1], name, flush=True)
if sys.argv[1] == "leak":
    time.sleep(0.5)  # a process of the run lives for seconds, as its ranks and engines do
else:
    sys.stdin.read()  # mapped until the test is done with it
    buf.unlink(); os.unlink(f"/dev/shm/{name}")
"""


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm on this host")
def test_the_segments_a_run_left_are_told_from_those_another_process_made_meanwhile():
    """The check of the run-end test against itself, with real processes: a "run" (its own session, a child
    making segments and leaving them) ends while another process, outside it, holds segments of both kinds it made
    meanwhile. ``_segments_left`` names exactly the run's; the whole of /dev/shm holds the other's too (what the
    test compared before, which failed beside another job)."""
    before = _shm()
    other = subprocess.Popen(
        [sys.executable, "-c", _SEGMENTS, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    leaked: list[str] = []
    try:
        held = other.stdout.readline().split()
        assert len(held) == 2, held
        leader = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_SEGMENTS!r}, 'leak'], check=True)"
        run = subprocess.Popen(
            [sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        run_pids = _record_session(run)
        out, _ = run.communicate(timeout=BOUND_S)
        leaked = out.split()
        assert run.returncode == 0 and len(leaked) == 2 and _session_processes(run.pid) == []
        assert _segments_left(before, run_pids) == set(leaked)
        assert set(held) <= _shm() - before  # the other process's segments are there, and not counted
    finally:
        other.communicate(timeout=BOUND_S)
        for name in leaked:
            Path("/dev/shm", name).unlink(missing_ok=True)
    assert not set(held) & _shm()


# -- preemption: a scheduler's SIGTERM ------------------------------------------------------------------------------

STEPS = 6


def _preempt_args(run_dir, model, *over) -> list[str]:
    from run_helpers import EASY

    args = [f"run_dir={run_dir}", f"model.path={model}", "policy.mode=full", "policy.dtype=float32"]
    args += ["env.name=arithmetic", f"env.kwargs={json.dumps(EASY)}", "env.eval_problems=0", "rollout.max_tokens=3"]
    args += ["rollout.max_model_len=32", "rollout.group_size=4", "rollout.prompts_per_step=4", "policy.optim.lr=1e-3"]
    return [*args, "policy.micro_batch_size=16", f"train.steps={STEPS}", *over]


def _moerl(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moerl.cli", "train", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=BOUND_S, env=os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
    )


def _signalled(args: list[str], after: str, log: Path, wait: float = 0.0) -> tuple[int, str]:
    """``moerl train args`` in a session of its own, sent SIGTERM (to the whole session: a scheduler's way) ``wait``
    seconds after its console shows ``after``; its exit code and console."""
    import signal
    import time

    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moerl.cli", "train", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=os.environ | {"GLOO_SOCKET_IFNAME": "lo"},
        )
        deadline = time.monotonic() + BOUND_S
        while after not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(wait)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            pytest.fail(f"the signalled run did not end within {BOUND_S} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text()


@pytest.mark.parametrize("layout", [[], ["parallel.dp=2"], ["parallel.pp=2"]], ids=["one-rank", "dp2", "pp2"])
def test_sigterm_saves_the_last_complete_step_and_resume_gives_the_uninterrupted_numbers(layout, warm_model, tmp_path):
    """fp32, the same seed: a run sent SIGTERM after its first step saves the step it was in, exits 143 naming the
    resume command, and ``--resume`` gives the uninterrupted run's loss, gradient norm, reward and lr for every step
    after it, exactly."""
    from run_helpers import metric_rows

    straight = _moerl(_preempt_args(tmp_path / "a", warm_model, *layout))
    assert straight.returncode == 0, straight.stderr[-3000:]
    args = _preempt_args(tmp_path / "b", warm_model, "train.checkpoint_every=0", *layout)
    code, console = _signalled(args, f"step 1/{STEPS}", tmp_path / "b.log")
    assert code == 143, console[-3000:]
    saved = json.loads((tmp_path / "b" / "checkpoint" / "checkpoint.json").read_text())["state"]["step"]
    assert 1 <= saved < STEPS and f"SIGTERM after step {saved} of {STEPS}" in console
    assert "Continue with: moerl train" in console and console.count("SIGTERM after step") == 1
    resumed = _moerl([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = {r["step"]: r for r in metric_rows(tmp_path / "a") if "loss" in r}
    got = {r["step"]: r for r in metric_rows(tmp_path / "b") if "loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert any(want[s]["loss"] != 0 for s in range(saved + 1, STEPS + 1))  # steps that learn, not zero advantages
    for step in range(saved + 1, STEPS + 1):
        for key in ("loss", "grad_norm", "reward_mean", "lr"):
            assert got[step][key] == want[step][key], (step, key)


def test_the_grace_running_out_stops_the_run_and_keeps_the_last_checkpoint(warm_model, tmp_path):
    """A grace far shorter than a step (a step of 32 x 4 samples, the signal 0.1 s into it): the run stops before its
    save, exit 143, and the last periodic checkpoint is complete where it was."""
    from moerl.trainer.checkpoint import recover_checkpoint

    run = tmp_path / "run"
    over = ["train.checkpoint_every=1", "train.steps=400", "train.preempt_grace_s=0.01", "rollout.prompts_per_step=32"]
    code, console = _signalled(_preempt_args(run, warm_model, *over), "step 2/400", tmp_path / "log", wait=0.1)
    assert code == 143, console[-3000:]
    assert "train.preempt_grace_s=0.01 s passed before the save was done: stopping now" in console, console[-2000:]
    found, _ = recover_checkpoint(run / "checkpoint", dry_run=True)
    assert found == run / "checkpoint"
    assert json.loads((found / "checkpoint.json").read_text())["state"]["step"] >= 2


def test_copies_of_one_signal_count_once_and_a_later_one_stops_at_once(monkeypatch):
    """In one process: SIGTERM is noted, not fatal; its copy within SAME_EVENT_S is the same event; a signal after
    that stops at once; after ``saved()`` the grace timer stops nothing."""
    import signal
    import time

    from moerl import preempt

    stops, before = [], signal.getsignal(signal.SIGTERM)  # another test's library (Ray) may have set one
    monkeypatch.setattr(preempt, "_stop_now", stops.append)
    with preempt.Preemption(grace_s=0.3) as p:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of this thread
        assert p.signal_name == "SIGTERM" and stops == []
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forward of the same event
        time.sleep(0.05)
        assert stops == []
        monkeypatch.setattr(preempt, "SAME_EVENT_S", 0.0)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stops == ["a second SIGUSR1"]
        time.sleep(0.4)
        assert stops[1:] == ["train.preempt_grace_s=0.3 s passed before the save was done"]
    with preempt.Preemption(grace_s=0.2) as p:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        p.saved()
        time.sleep(0.3)
    assert len(stops) == 2
    assert signal.getsignal(signal.SIGTERM) is before  # restored


# -- one rank out of memory -----------------------------------------------------------------------------------------

OOM = Path(__file__).parent / "oom_check.py"


def test_a_rank_out_of_memory_is_named_with_what_to_lower(tmp_path):
    """A rank's address space capped (RLIMIT_AS) before a 16 x 4096-token batch: one process names the stage and the
    batch, says what to lower and saves the weights before the step (equal to them); at dp=2, rank 1 capped, the
    error names rank 1 and its place, and the launcher stops rank 0 (no hang: within the bound)."""
    from moerl.presets import init_model

    model = tmp_path / "model"
    init_model("qwen3_moe", "tiny", model, seed=0)
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
    one = tmp_path / "one"
    one.mkdir()
    done = subprocess.run(
        [sys.executable, str(OOM), str(model), str(one), "1", "0"], capture_output=True, text=True, timeout=BOUND_S
    )
    assert done.returncode == 2, done.stderr[-3000:]
    said = (one / "oom.txt").read_text()
    assert said.startswith("the trainer ran out of memory in the forward and backward of a training step of a batch "
                           "of 16 rows x 4096 tokens (65536 real), micro-batches of at most 16 rows (")  # fmt: skip
    assert "can't allocate memory" in said and "lower policy.micro_batch_size (now 16) or the lengths" in said
    assert said.endswith(f"checkpoint of the last good state saved to {one / 'stop'}")
    saved, before = load_file(one / "stop" / "checkpoint.safetensors"), load_file(one / "before.safetensors")
    assert before and all(torch.equal(saved[f"weights/{n}"], t) for n, t in before.items())

    two = tmp_path / "two"
    two.mkdir()
    run = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(OOM),
        str(model),
        str(two),
        "2",
        "1",
    ]
    done = subprocess.run([sys.executable, *run], capture_output=True, text=True, timeout=BOUND_S, env=env)
    assert done.returncode != 0
    said = (two / "oom.txt").read_text()
    assert said.startswith("trainer rank 1 of 2 (pipeline rank 0, expert slice 0, data-parallel rank 1) ran out of "
                           "memory in the forward and backward of a training step")  # fmt: skip
    assert said.endswith("nothing saved (last good checkpoint: none yet)")
    assert "exitcode  : -15" in done.stderr  # rank 0, inside the step's collectives, stopped by the launcher


# -- every wait at a run's end has a deadline -----------------------------------------------------------------------


def _rank_process(rank: int, seconds: float) -> subprocess.Popen:
    """A child of this process that torchrun could have started as ``rank``: it sleeps ``seconds`` and ends."""
    code = f"import time; time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], env=os.environ | {"RANK": str(rank)})


def test_the_launcher_stops_a_rank_still_running_long_after_another_ended(capfd):
    """Rank 0 ends after 0.5 s, rank 1 would run 10 minutes: 1 s after rank 0's end the watch kills rank 1 and says so.
    Controls: ranks that all end in time, and ranks that all run on (no rank ended: no deadline), are left alone."""
    import time

    from moerl.parallel.ends import EndWatch

    ranks = [_rank_process(0, 0.5), _rank_process(1, 600)]
    with EndWatch(2, end_s=1.0, poll_s=0.1) as watch:
        ranks[0].wait()  # reaped at its end, as torchrun does: the rank is gone from the process table
        assert ranks[1].wait(timeout=30) == -9
    assert watch.stopped == [1] and watch.first_end == 0
    assert "trainer rank(s) 1 still running 1 s after rank 0 ended; stopping them" in capfd.readouterr().err

    ranks = [_rank_process(0, 0.5), _rank_process(1, 0.9)]  # the later one ends 0.4 s after: within the deadline
    with EndWatch(2, end_s=1.0, poll_s=0.1) as watch:
        assert [p.wait(timeout=30) for p in ranks] == [0, 0]
        time.sleep(1.5)
    assert watch.stopped == [] and watch.first_end == 0

    ranks = [_rank_process(0, 2.5), _rank_process(1, 2.5)]  # both run past end_s: nothing ended, nothing is late
    with EndWatch(2, end_s=1.0, poll_s=0.1) as watch:
        assert [p.wait(timeout=30) for p in ranks] == [0, 0]
    assert watch.stopped == []


def test_closing_the_rollouts_ahead_waits_for_the_call_in_flight_at_most_its_deadline():
    """The generator thread blocked in its engine call: ``close`` returns False after its deadline instead of
    waiting; once the call ends, ``close`` returns True."""
    import threading
    import time

    from moerl.rollout.ahead import RolloutsAhead

    class Blocked:  # an engine call that does not return until released
        def __init__(self):
            self.release, self.started = threading.Event(), threading.Event()

        def collect(self, step):
            self.started.set()
            self.release.wait()
            return f"rollouts of step {step}"

    gen = Blocked()
    ahead = RolloutsAhead(gen, 0, 3, max_staleness=1)
    assert gen.started.wait(10)
    t0 = time.monotonic()
    assert ahead.close(0.3) is False
    assert 0.25 < time.monotonic() - t0 < 5
    gen.release.set()
    assert ahead.close(10) is True
