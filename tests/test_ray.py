"""``cluster.backend: ray`` on a real local Ray cluster (``ray start --head``, 2 CPUs; each run joins it through
``cluster.address``; disaggregated: one trainer actor, one engine actor): the same numbers as the local run with
the same seeds, learning, an engine actor killed mid-run (restarted, its requests re-sent, nothing lost or counted
twice), a trainer actor killed mid-run (stopped, resumable), colocated data-parallel ranks, and the configurations
that are refused."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from run_helpers import metric_rows, run_cfg

from moerl.config import load_config
from moerl.errors import ConfigError, MoerlError, TrainingStopped
from moerl.loop import train
from moerl.run_config import RunConfig

ray = pytest.importorskip("ray")

TESTS = str(Path(__file__).parent)
KEYS = ("reward_mean", "loss", "grad_norm", "mismatch_k3_r3", "mismatch_k3_no_r3", "eval_accuracy", "samples")
# the actors train on the four fixed problems the local run's fixture gives: a setup hook in every Ray worker
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": TESTS}, "worker_process_setup_hook": "run_helpers.fix_four_problems"}
OVER = {"env.eval_problems": 4, "rollout.prompts_per_step": 4, "policy.optim.lr": 3e-3}


@pytest.fixture(scope="module")
def cluster():
    """A running local Ray cluster (``ray start --head``, 2 CPUs) that every run joins (``cluster.address: auto``,
    the README's way) and leaves again; stopped at the end of the module."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    head = ["start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run([*ray_cli, *head], check=True, capture_output=True)
    yield "auto"
    subprocess.run([*ray_cli, "stop", "--force"], check=False, capture_output=True)


@pytest.fixture
def one_thread():
    """The local run computes with the actors' thread count (1 CPU each), so its numbers are theirs bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ray_cfg(run_dir, model, steps, address, mode="lora", **over):
    ray_over = {"cluster.backend": "ray", "cluster.address": address, "cluster.runtime_env": json.dumps(RUNTIME_ENV)}
    return run_cfg(run_dir, model, mode, steps=steps, **OVER, **ray_over, **over)


def _pids(title: str) -> list[int]:
    """The processes whose command line names the Ray actor class ``title`` (Ray sets ``ray::Class.method``)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(f"ray::{title}"):
                out.append(int(d))
    return out


def _kill_when(run_dir: Path, title: str, ready, sig: int = signal.SIGKILL) -> threading.Thread:
    """A thread that sends ``sig`` to the ``title`` actor's process once ``ready(run_dir)`` holds."""

    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if ready(run_dir) and _pids(title):
                for pid in _pids(title):
                    os.kill(pid, sig)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _rows_from(step: int):
    def ready(run_dir: Path) -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and any(json.loads(x)["step"] >= step for x in path.read_text().splitlines())

    return ready


def test_a_ray_run_gives_the_local_numbers_learns_and_survives_a_killed_engine(
    cluster, one_thread, warm_model, four_problems, tmp_path
):
    """Disaggregated, weights through Ray's object store (the cross-node transport; the colocated test below goes
    through /dev/shm). The engine actor is SIGKILLed once step 1 is logged: Ray restarts it, the pool replays the
    last weight update and re-sends the requests it had. Every step has all its samples, each counted once, and the
    same numbers as the undisturbed local run bit for bit (same seeds, same thread counts); reward rises over the 8
    steps on the four problems (first 3 -> last 3; measured 0.58 -> 0.78)."""
    from moerl.cluster import run_on_ray

    train(run_cfg(tmp_path / "local", warm_model, "lora", steps=8, **OVER))
    killer = _kill_when(tmp_path / "ray", "EngineActor", _rows_from(1))
    over = {"rollout.weight_transport": "inline"}
    summary = run_on_ray(_ray_cfg(tmp_path / "ray", warm_model, 8, cluster, **over))
    killer.join(timeout=1)
    local, remote = metric_rows(tmp_path / "local"), metric_rows(tmp_path / "ray")
    assert [r["step"] for r in remote] == list(range(9))
    assert remote[-1]["engine_restarts"] >= 1, "the engine actor was not killed"
    for a, b in zip(local, remote, strict=True):
        assert {k: a.get(k) for k in KEYS} == {k: b.get(k) for k in KEYS}, a["step"]
    assert all(r["samples"] == 4 * 8 for r in remote[1:])  # prompts_per_step x group_size
    rewards = [r["reward_mean"] for r in remote[1:]]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert Path(summary["adapter"], "adapter_config.json").exists()


def test_a_trainer_actor_killed_mid_run_stops_the_run_and_resume_continues(cluster, warm_model, tmp_path):
    """Asynchronous rollouts on Ray; the trainer actor is SIGKILLed after the step-2 checkpoint: the run stops naming
    the dead rank, the checkpoint is intact, and ``--resume`` (on Ray again) finishes the run."""
    from moerl.cluster import run_on_ray

    run = tmp_path / "ray"
    saved = run / "checkpoint" / "checkpoint.json"
    killer = _kill_when(run, "TrainerRank", lambda d: saved.exists() and json.loads(saved.read_text())["state"]["step"])
    cfg = _ray_cfg(run, warm_model, 6, cluster, **{"algo.async": "true"})
    with pytest.raises(TrainingStopped, match=r"trainer rank 0 \(Ray actor, pid \d+\) died.*--resume"):
        run_on_ray(cfg)
    killer.join(timeout=1)
    done = json.loads(saved.read_text())["state"]["step"]
    assert done in (2, 4)
    run_on_ray(cfg, resume=True)
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(7)) and all(r["staleness_max"] <= 1 for r in rows[1:])
    assert json.loads(saved.read_text())["state"]["step"] == 6


def test_an_engine_actor_that_stops_answering_is_named_and_the_run_stops_resumable(cluster, warm_model, tmp_path):
    """A SIGSTOPped engine actor answers neither its command nor the progress calls: named after
    ``rollout.engine_timeout_s``, killed (not restarted: a hung engine is not a dead one), the run stopped with the
    last step's state saved."""
    from moerl.cluster import run_on_ray

    run = tmp_path / "ray"
    stopper = _kill_when(run, "EngineActor", _rows_from(1), signal.SIGSTOP)
    cfg = _ray_cfg(run, warm_model, 4, cluster, **{"rollout.engine_timeout_s": 3, "train.checkpoint_every": 1})
    with pytest.raises(TrainingStopped, match=r"rollout engine 0 \(Ray actor, pid \d+\) has not answered for 3 s"):
        run_on_ray(cfg)
    stopper.join(timeout=1)
    done = json.loads((run / "checkpoint" / "checkpoint.json").read_text())["state"]["step"]
    assert done >= 1 and [r["step"] for r in metric_rows(run)] == list(range(done + 1))
    deadline = time.monotonic() + 15  # Ray ends a killed actor's process asynchronously
    while _pids("EngineActor") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids("EngineActor")


def test_trainer_ranks_stop_when_their_ray_driver_is_killed(cluster, warm_model, tmp_path):
    """kill -9 of the driver (`moerl train ... cluster.backend=ray`): its rank actors notice within seconds and
    stop, naming it, instead of training on until Ray notices their owner is gone."""
    import subprocess
    import sys

    run = tmp_path / "ray"
    over = {"cluster.backend": "ray", "cluster.address": cluster, "cluster.runtime_env": json.dumps(RUNTIME_ENV)}
    args = [f"run_dir={run}", f"model.path={warm_model}", "train.steps=500", "train.checkpoint_every=1"]
    args += ["policy.dtype=float32", "rollout.dtype=float32", "rollout.max_tokens=3", "rollout.max_model_len=32"]
    args += ["rollout.prompts_per_step=4", "rollout.group_size=4", "env.eval_problems=4", "env.name=arithmetic"]
    args += [f"{k}={v}" for k, v in over.items()]
    driver = subprocess.Popen([sys.executable, "-m", "moerl.cli", "train", *args], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoint" / "checkpoint.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = _pids("TrainerRank")
        assert ranks, "no trainer rank actor runs"
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks)
    finally:
        driver.kill()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ray_addresses_fail_fast_by_name_and_empty_starts_a_cluster_of_the_runs_own(cluster, tmp_path, monkeypatch):
    """An address nobody serves is refused within CONNECT_TIMEOUT_S (Ray would retry for ever); ``auto`` with no
    cluster recorded is refused; ``""`` starts a fresh local cluster in a directory of moerl's own even while
    another one (the module's) is recorded, and that directory is removed afterwards by the run."""
    from moerl.cluster import CONNECT_TIMEOUT_S, init_ray

    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"cluster.address='127.0.0.1:1': no Ray cluster answers at 127.0.0.1:1"):
        init_ray("127.0.0.1:1")
    assert time.monotonic() - start < CONNECT_TIMEOUT_S + 5
    with monkeypatch.context() as m:
        m.delenv("RAY_ADDRESS", raising=False)
        m.setenv("RAY_TMPDIR", str(tmp_path))
        with pytest.raises(ConfigError, match=r"cluster.address='auto': no running Ray cluster is recorded"):
            init_ray("auto")
    recorded = Path("/tmp/ray/ray_current_cluster").read_text().strip()  # the module's cluster
    # a new local cluster turns Ray's token auth on by default and leaves ~/.ray/auth_token behind, which later
    # clusters of this machine then require: this test's cluster goes without
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    own = init_ray("")
    try:
        assert Path(own).name.startswith("moerl-ray-") and ray.get_runtime_context().gcs_address != recorded
    finally:
        ray.shutdown()
    assert Path("/tmp/ray/ray_current_cluster").read_text().strip() == recorded


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_vllm_engines_as_ray_actors_learn_with_r3(cluster, warm_model, tmp_path, mode):
    """rollout.engine=vllm on Ray: the engine actor starts vLLM (its processes under the actor) and takes every
    sync like a local vLLM engine (LoRA merged); samples come back with vLLM's routed experts, replayed (R3), and the
    run learns on the four problems (measured: reward 0.6 -> 0.8 over 8 steps)."""
    pytest.importorskip("vllm")
    from moerl.cluster import run_on_ray

    over = {"rollout.engine": "vllm", "rollout.vllm_args": json.dumps({"enforce_eager": True})}
    run_on_ray(_ray_cfg(tmp_path / "ray", warm_model, 8, cluster, mode, **over))
    rows = metric_rows(tmp_path / "ray")
    assert [r["step"] for r in rows] == list(range(9))
    assert all(r["samples"] == 4 * 8 for r in rows[1:]) and rows[-1]["weight_version"] == 8.0
    assert all(r["mismatch_k3_r3"] is not None and r["mismatch_k3_r3"] < 0.05 for r in rows[1:])
    rewards = [r["reward_mean"] for r in rows[1:]]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_ray_configurations_that_are_not_built_or_do_not_fit_are_refused(cluster, warm_model, tmp_path):
    from moerl.cluster import run_on_ray

    with pytest.raises(ConfigError, match=r"'cluster.cpus_per_engine' is only used with cluster.backend: ray"):
        load_config(RunConfig, None, ["cluster.cpus_per_engine=2"])
    with pytest.raises(ConfigError, match=r"rollout.placement='process' with cluster.backend: ray"):
        load_config(RunConfig, None, ["cluster.backend=ray", "rollout.placement=process"])
    with pytest.raises(ConfigError, match=r"weight_transport'='nccl': allowed: auto, shm, inline, cuda_ipc, broadc"):
        load_config(RunConfig, None, ["cluster.backend=ray", "rollout.weight_transport=nccl"])
    with pytest.raises(ConfigError, match=r"'broadcast' with cluster.engine_restarts=3: a restarted engine cannot"):
        load_config(RunConfig, None, ["cluster.backend=ray", "rollout.weight_transport=broadcast"])
    with pytest.raises(ConfigError, match=r"needs 9 CPUs.*the cluster has 2"):
        run_on_ray(_ray_cfg(tmp_path / "big", warm_model, 1, cluster, **{"cluster.cpus_per_trainer": 8}))
    gpus = {"cluster.gpus_per_trainer": 1, "cluster.gpus_per_engine": 0.5}  # this CPU cluster has none
    with pytest.raises(ConfigError, match=r"gpus_per_trainer=1 .*gpus_per_engine=0.5\) needs 1.5 GPUs, .*has 0"):
        run_on_ray(_ray_cfg(tmp_path / "gpu", warm_model, 1, cluster, **gpus))
    with pytest.raises(ConfigError, match=r"'cluster.gpus_per_engine'=-1.0: must be >= 0"):
        load_config(RunConfig, None, ["cluster.backend=ray", "cluster.gpus_per_engine=-1"])
    # what a rank raises comes back as moerl's own error, naming the rank
    with pytest.raises(MoerlError, match=r"trainer rank 0: .*nope"):
        run_on_ray(_ray_cfg(tmp_path / "bad", tmp_path / "nope", 1, cluster))


def test_gpus_go_into_the_placement_bundles_and_colocated_engines_share_their_ranks_gpu(warm_model, tmp_path):
    from moerl.cluster import bundles

    gpus = {"cluster.gpus_per_trainer": 1, "cluster.gpus_per_engine": 0.5, "parallel.dp": 2}
    specs, where = bundles(_ray_cfg(tmp_path / "x", warm_model, 1, "auto", **gpus, **{"rollout.num_engines": 2}))
    assert specs == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 0.5}] * 2
    assert where.engine_bundles == [2, 3] and where.engine_gpus == 0.5
    colocated = {"cluster.gpus_per_trainer": 1, "cluster.placement": "colocated", "parallel.dp": 2}
    specs, where = bundles(_ray_cfg(tmp_path / "y", warm_model, 1, "auto", **colocated))
    assert specs == [{"CPU": 1.0, "GPU": 1.0}] * 2  # the engine takes half of rank 0's CPU and GPU
    assert where.engine_bundles == [0] and where.engine_cpus == 0.5 and where.engine_gpus == 0.5
    specs, _ = bundles(_ray_cfg(tmp_path / "z", warm_model, 1, "auto", **{"parallel.dp": 2}))
    assert specs == [{"CPU": 1.0}] * 3  # two ranks and an engine; no GPU asked: none in the bundles


def test_an_engine_actor_out_of_restarts_is_an_engine_error_named(cluster, warm_model):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from moerl.cluster import EnginePlacement
    from moerl.engine import EngineConfig, Request, SamplingParams
    from moerl.errors import EngineError
    from moerl.rollout.pool import EnginePool
    from moerl.rollout.ray_engine import start_engines
    from moerl.rollout.spec import EngineSpec

    ray.init(address=cluster, logging_level="warning")
    group = placement_group([{"CPU": 1}])
    try:
        ray.get(group.ready(), timeout=60)
        spec = EngineSpec(str(warm_model), EngineConfig(max_num_seqs=8, max_model_len=32))
        engines = start_engines(spec, 1, EnginePlacement(group, [0], 1.0, 1), "auto", restarts=0)
        pool = EnginePool(spec, "ray", 1, handles=engines)
        requests = [Request("1+2=", SamplingParams(max_tokens=3, seed=0))]
        assert pool.generate(requests)[0].outputs[0].token_ids
        os.kill(engines[0].pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"rollout engine 0 \(Ray actor, pid \d+\) died and was not restarted"):
            pool.generate(requests)
        pool.close()
    finally:
        remove_placement_group(group)
        ray.shutdown()


def test_colocated_data_parallel_ranks_on_ray_train_as_one_process(
    cluster, one_thread, warm_model, four_problems, tmp_path
):
    """dp=2 as two trainer actors, the engine colocated in rank 0's bundle (2 CPUs in all): the first step's
    rollouts equal the local one-process run's bit for bit and its loss and gradient norm agree to 1e-5 (fp32; the
    ranks sum their shares in another order)."""
    from moerl.cluster import bundles, run_on_ray

    over = {"cluster.placement": "colocated", "parallel.dp": 2}
    specs, where = bundles(_ray_cfg(tmp_path / "x", warm_model, 1, cluster, **over))
    assert specs == [{"CPU": 1.0}, {"CPU": 1.0}] and where.engine_bundles == [0] and where.engine_cpus == 0.5
    train(run_cfg(tmp_path / "local", warm_model, "lora", steps=2, **OVER))
    run_on_ray(_ray_cfg(tmp_path / "ray", warm_model, 2, cluster, **over))
    local, remote = metric_rows(tmp_path / "local")[1], metric_rows(tmp_path / "ray")[1]
    for k in ("reward_mean", "samples", "mismatch_k3_no_r3"):
        assert local[k] == remote[k], k
    for k in ("loss", "grad_norm"):
        assert abs(local[k] - remote[k]) <= 1e-5 * max(1.0, abs(local[k])), (k, local[k], remote[k])
    assert [r["step"] for r in metric_rows(tmp_path / "ray")] == [0, 1, 2]


def test_ranks_that_do_not_return_long_after_another_are_left_and_named(cluster, capfd):
    """``await_ranks`` on real Ray tasks: rank 0 returns its summary, rank 1 runs on; 2 s later rank 0's summary is
    returned and rank 1 is named. Rank 0 the late one: the run's end is named, pointing at its results."""
    import ray

    from moerl.cluster import await_ranks

    @ray.remote(num_cpus=0.5)
    def rank_run(seconds, out):
        time.sleep(seconds)
        return out

    ray.init(address=cluster, logging_level="warning")
    try:
        late = rank_run.remote(600, None)
        runs = {rank_run.remote(0.0, {"reward": 1.0}): 0, late: 1}
        t0 = time.monotonic()
        assert await_ranks(runs, [10, 11], "runs/x", end_s=2.0) == {"reward": 1.0}
        assert time.monotonic() - t0 < 60
        assert "trainer rank(s) 1 still running 2 s after rank 0 returned; stopping them" in capfd.readouterr().err
        ray.cancel(late, force=True)

        late = rank_run.remote(600, {"reward": 1.0})
        runs = {late: 0, rank_run.remote(0.0, None): 1}
        with pytest.raises(TrainingStopped, match=r"trainer rank 0 did not return within 2 s of rank 1; .* runs/x"):
            await_ranks(runs, [10, 11], "runs/x", end_s=2.0)
        ray.cancel(late, force=True)
    finally:
        ray.shutdown()
