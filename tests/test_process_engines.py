"""Rollout engines in their own processes: the same rollouts as in process (bit for bit), weight sync in every
mode through shared memory, routers read back bit for bit, named errors, no orphans."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from moerl.engine import EngineConfig, Request, SamplingParams
from moerl.errors import EngineError, RequestError
from moerl.rollout import make_engine
from moerl.rollout.fanout import split
from moerl.rollout.shm import BufferCache, SharedBuffer
from moerl.sync import sync_policy
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import sft_loss

THREADS = torch.get_num_threads()  # engine processes compute with this process's threads: same kernels, same bits


def _requests(seed: int = 0) -> list[Request]:
    prompts = ["1+2=", "3+1=", "2+2=", "4+0=", "0+3=", "1+1=", "2+3="]
    return [
        Request(p, SamplingParams(temperature=1.0, max_tokens=4, n=1 + i % 3, seed=seed + i))
        for i, p in enumerate(prompts)
    ]


def _same(a, b) -> None:
    assert [o.request_id for o in a] == [o.request_id for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.weight_version == y.weight_version and x.error == y.error
        for c, d in zip(x.outputs, y.outputs, strict=True):
            assert c.token_ids == d.token_ids and c.text == d.text and c.finish_reason == d.finish_reason
            assert torch.equal(c.logprobs, d.logprobs) and c.logprobs.dtype == torch.float32
            assert torch.equal(c.routed_experts, d.routed_experts) and c.routed_experts.dtype == torch.uint8


def _pool(model, placement, n, mode="full", dtype="float32", **kw):
    lora = mode == "lora"
    cfg = EngineConfig(
        max_num_seqs=16, max_model_len=32, max_loras=int(lora), max_lora_rank=8, lora_layout="shared_outer"
    )
    threads = THREADS if placement == "process" else 0
    mx = "rceil" if mode == "mxfp8" else None
    return make_engine(
        "native", model, cfg, placement=placement, num_engines=n, threads=threads, mx_scale_mode=mx, dtype=dtype, **kw
    )


def _trained_policy(model, mode):
    from moerl.model.lora import LoraConfig

    lora = LoraConfig(rank=8, alpha=16, layout="shared_outer")
    pol = Policy(model, PolicyConfig(mode=mode, dtype="float32", lora=lora, optim=OptimConfig(lr=1e-2)))
    ids = torch.randint(4, 100, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for _ in range(2):
        pol.train_step(Batch(ids, mask, mask), sft_loss)
    return pol


def test_shared_buffer_round_trip_keeps_every_dtype_bit_for_bit():
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "fp32": torch.randn(7),
        "e4m3": torch.randn(4, 32).to(torch.float8_e4m3fn),
        "e8m0": torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3),
        "i16": torch.tensor([-3, 300], dtype=torch.int16),
        "scalar": torch.tensor(2.5),
    }
    buf = SharedBuffer.create(1 << 12)
    specs = buf.pack(tensors)
    assert all(s["offset"] % 64 == 0 for s in specs)
    got = BufferCache(unlink_on_open=True).get(buf.path, buf.nbytes).read(specs)
    assert not os.path.exists(buf.path)  # the only reader removed the file once it had mapped it
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    with pytest.raises(ValueError, match=r"do not fit the 4096-byte shared buffer"):
        buf.pack({"big": torch.zeros(2000)})
    with pytest.raises(ValueError, match=r"tensor 'x' lies outside the shared buffer"):
        buf.read([{"name": "x", "dtype": "float32", "shape": [2000], "offset": 0}])


def test_split_balances_samples_and_keeps_order():
    reqs = _requests()  # samples per request: 1 2 3 1 2 3 1 = 13
    parts = split(reqs, 2)
    assert parts[0].start == 0 and parts[0].stop == parts[1].start and parts[1].stop == len(reqs)
    counts = [sum(r.params.n for r in reqs[s]) for s in parts]
    assert abs(counts[0] - counts[1]) <= 3
    assert [len(reqs[s]) for s in split(reqs[:1], 3)] == [1, 0, 0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moerl.presets import init_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    init_model("qwen3_moe", "tiny", path, seed=0)
    return path


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [("full", "float32"), ("lora", "float32"), ("mxfp8", "float32"), ("full", "bfloat16"), ("lora", "bfloat16")],
)
def test_process_engines_give_the_inprocess_rollouts_bit_for_bit_before_and_after_a_sync(mode, dtype, model):
    """Engines in child processes compute with this process's thread count, the same kernels on the same shapes:
    their rollouts equal the in-process engines' bit for bit, in either dtype."""
    policy = _trained_policy(model, mode)
    pools = {(p, n): _pool(model, p, n, mode, dtype) for p in ("inprocess", "process") for n in (1, 2)}
    try:
        adapter = "policy" if mode == "lora" else None
        for version in (0, 1):
            if version:
                for pool in pools.values():
                    stats = sync_policy(policy, pool, version=1, bucket_bytes=1 << 16)  # several buckets
                    assert pool.weight_version == 1
                assert mode == "lora" or stats.buckets > 1
            reqs = _requests(seed=version)
            if mode == "lora" and version == 0:
                continue  # no adapter loaded yet
            for r in reqs:
                r.adapter = adapter
            outs = {k: pool.generate(reqs) for k, pool in pools.items()}
            ref = outs[("inprocess", 1)]
            assert all(o.weight_version == version for o in ref)
            for k in outs:
                _same(ref if k[1] == 1 else outs[("inprocess", 2)], outs[k])
        # the engine processes hold the trainer's fp32 routers bit for bit (and the synced weights as sent)
        routers = [n for n in policy.trainable_state() if ".router." in n]
        if mode == "lora":
            routers = [n for n, _ in policy.model.named_parameters() if ".router." in n]
        masters = dict(policy.model.named_parameters()) | policy.trainable_state()
        for per_engine in pools[("process", 2)].read_weights(routers):
            for name in routers:
                assert per_engine[name].dtype == torch.float32
                assert torch.equal(per_engine[name], masters[name].detach()), name
    finally:
        for pool in pools.values():
            pool.close()


def test_errors_keep_their_type_and_a_dead_engine_is_named(model):
    pool = _pool(model, "process", 2)
    try:
        with pytest.raises(RequestError, match=r"request \d+: prompt token 500 outside the vocabulary"):
            pool.generate([Request([5, 500], SamplingParams())] + _requests())
        outs = pool.generate(_requests()[:3] + [Request("", SamplingParams())] + _requests()[3:])
        assert re.fullmatch(r"request \d+: empty prompt", outs[3].error) and outs[3].error_kind == "rejected"
        assert all(o.error is None and o.outputs for i, o in enumerate(outs) if i != 3)  # an empty prompt fails alone
        assert len(pool.generate(_requests())) == 7  # both engines still answer in step
        victim = pool.engines[1]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        with pytest.raises(EngineError, match=rf"rollout engine 1 \(pid {victim.proc.pid}\) was killed by signal 9"):
            pool.generate(_requests())
    finally:
        pool.close()
    assert all(e.proc.poll() is not None for e in pool.engines)


def test_pools_in_and_out_of_process_speak_the_whole_inference_engine_protocol(model):
    """What the loop, the generator and the weight sync ask of an engine is declared once (``InferenceEngine``) and
    a pool has every member of it, wherever its engines run; a bare ``LLMEngine`` does not (no restarts, no
    ``close``): the check fails where a member is missing."""
    from moerl.engine import LLMEngine
    from moerl.rollout import InferenceEngine

    cfg = EngineConfig(max_num_seqs=4, max_model_len=32)
    for placement in ("inprocess", "process"):
        pool = make_engine("native", model, cfg, placement=placement, num_engines=1, threads=THREADS)
        try:
            assert isinstance(pool, InferenceEngine), placement
            assert pool.dense_weights is None and pool.restarts == pool.requeued == 0
        finally:
            pool.close()
    assert not isinstance(LLMEngine(model, cfg, dtype=torch.float32), InferenceEngine)


def test_engine_processes_report_their_decode_seconds_and_compile_when_told(tmp_path):
    """``compile_decode: auto`` across processes: each engine process answers ``decode_seconds`` (0 before a
    generate, more after), the tokens its decode steps made (every sampled token after a sequence's first, which
    its prefill makes) and ``compile_decode`` (its compiled step is built; True for the pool; told off, it is eager
    again); engines built with compile_decode False answer False and stay eager. (q / k / v biases: a model whose
    decode steps do not run as bound calls, which auto never compiles: tests/test_compiled_decode.py.)"""
    from moerl.presets import init_model

    model = tmp_path / "biased"
    init_model("qwen3_moe", "tiny", model, seed=0, overrides={"attention_bias": True})
    for setting in ("auto", False):
        cfg = EngineConfig(max_num_seqs=16, max_model_len=32, compile_decode=setting)
        pool = make_engine("native", model, cfg, placement="process", num_engines=1, threads=THREADS)
        try:
            assert pool.decode_seconds() == 0 and pool.decode_tokens() == 0
            outs = pool.generate(_requests())
            assert pool.decode_seconds() > 0
            assert pool.decode_tokens() == sum(len(c.token_ids) - 1 for o in outs for c in o.outputs)
            assert pool.compile_decode() is (setting == "auto") and pool.compiled is (setting == "auto")
            assert pool.compile_decode(False) is False and pool.compiled is False
        finally:
            pool.close()


SCRIPT = """
import signal, sys, time
# Ctrl-C as in a terminal: a shell starts background jobs with SIGINT ignored, and children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
from moerl.engine import EngineConfig
from moerl.rollout import make_engine
pool = make_engine("native", sys.argv[1], EngineConfig(max_num_seqs=2, max_model_len=16), placement="process",
                   num_engines=2)
print(" ".join(str(e.proc.pid) for e in pool.engines), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_engine_processes_do_not_outlive_their_parent(how, model):
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(model)], stdout=subprocess.PIPE, text=True
    )
    children = [int(p) for p in parent.stdout.readline().split()]
    assert len(children) == 2 and all(_alive(p) for p in children)
    parent.send_signal(getattr(signal, how))
    parent.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_run_with_engine_processes_is_the_inprocess_run(warm_model, tmp_path):
    from run_helpers import metric_rows, run_cfg

    from moerl.loop import train

    keys = ("reward_mean", "loss", "grad_norm", "mismatch_k3_r3", "mismatch_k3_no_r3", "eval_accuracy")
    rows = {}
    for placement, transport in (("inprocess", "auto"), ("process", "auto"), ("process", "broadcast")):
        over = {"rollout.placement": placement, "rollout.num_engines": 2, "rollout.engine_threads": THREADS}
        run = tmp_path / f"{placement}-{transport}"
        over["rollout.weight_transport"] = transport  # the adapters through /dev/shm or a gloo broadcast
        train(run_cfg(run, warm_model, "lora", steps=2, **{"env.eval_problems": 4, **over}))
        rows[run.name] = metric_rows(run)
    ref = rows.pop("inprocess-auto")
    for got in rows.values():
        assert [r["step"] for r in got] == [0, 1, 2]
        for a, b in zip(ref, got, strict=True):
            assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
        assert got[-1]["mismatch_k3_r3"] < 1e-3


@pytest.mark.parametrize(("ahead", "how"), [(False, "kill"), (True, "kill"), (False, "stop")])
def test_an_engine_that_dies_stops_the_run_with_its_trained_state_saved(ahead, how, warm_model, tmp_path, monkeypatch):
    """Synchronous: step 2's rollouts find the engine gone (killed, or stopped: named after
    ``rollout.engine_timeout_s`` without a heartbeat); the state after step 1 is saved. Asynchronous (k=1): step 2's
    rollouts were generated during step 1, step 2 trains, its weights cannot reach the dead engine: the state after
    step 2 is saved with its metrics row, and the resume goes on from there."""
    import json

    from run_helpers import metric_rows, run_cfg

    from moerl import loop
    from moerl.errors import TrainingStopped

    real = loop.rl_step

    def step_then_die(cfg, gen, policy, loss_fn, step, ahead):
        if step == 1:  # the second step's rollouts find engine 0 gone
            victim.append(gen.engine.engines[0].proc)
            os.kill(victim[0].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        return real(cfg, gen, policy, loss_fn, step, ahead)

    victim = []
    monkeypatch.setattr(loop, "rl_step", step_then_die)
    over = {
        "rollout.placement": "process",
        "rollout.num_engines": 2,
        "env.eval_problems": 0,
        "train.checkpoint_every": 5,
        "algo.async": str(ahead).lower(),
        "rollout.engine_timeout_s": 3,
    }
    cfg = run_cfg(tmp_path / "run", warm_model, "lora", steps=3, **over)
    doing = "set_adapter" if ahead else "generate"  # the LoRA sync, or the rollouts
    fault = "was killed by signal 9" if how == "kill" else r"has not answered for 3 s"
    stopped = rf"rollout engine 0 \(pid \d+\) {fault} while {doing}.*checkpoint of the last good state"
    with pytest.raises(TrainingStopped, match=stopped):
        loop.train(cfg)
    assert victim[0].poll() is not None  # ended, not left stopped
    meta = json.loads((tmp_path / "run" / "checkpoint" / "checkpoint.json").read_text())
    done = 2 if ahead else 1
    assert meta["state"] == {"step": done} and [r["step"] for r in metric_rows(tmp_path / "run")] == [*range(done + 1)]
    monkeypatch.setattr(loop, "rl_step", real)
    loop.train(cfg, resume=True)  # new engines, the run goes on from step 1
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [0, 1, 2, 3]


def _small_shm(script: str, tmp_path) -> subprocess.CompletedProcess:
    """Run ``script`` (shell) with a 1 MiB /dev/shm of its own (a private mount namespace: root only)."""
    cmd = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1M tmpfs /dev/shm && {script}"]
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"], timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare on this host")
    if probe.returncode != 0:
        pytest.skip("this host does not let a test mount a private /dev/shm")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_a_small_dev_shm_is_a_named_error_not_a_bus_error(tmp_path):
    script = textwrap.dedent(
        """
        import os, torch
        from moerl.errors import SharedMemoryFull
        from moerl.rollout.shm import ShmWriter
        w = ShmWriter("moerl-weights")
        w.put({"small": torch.zeros(1 << 16)})  # 256 KiB: fits
        try:
            w.put({"big": torch.zeros(1 << 20)})  # 4 MiB: does not
        except SharedMemoryFull as e:
            print("REFUSED", e)
        w.close()
        print("LEFT", sorted(os.listdir("/dev/shm")))
        """
    )
    (tmp_path / "put.py").write_text(script)
    out = _small_shm(f"{sys.executable} put.py", tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED shared memory for engine processes: /dev/shm has" in out.stdout
    assert "a buffer of 4.0 MiB does not fit" in out.stdout and "--shm-size" in out.stdout
    assert "LEFT []" in out.stdout  # the refused buffer's file is gone too


def test_a_run_whose_engines_lack_shared_memory_stops_named_with_its_state_saved(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [
        f"{repo}/examples/full_arithmetic_engines.yaml",
        f"run_dir={tmp_path}/run",
        "train.steps=2",
        "env.eval_problems=0",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.dtype=float32",
        "policy.dtype=float32",
        "model.sft_steps=0",  # the random model: this is about shared memory, not learning
    ]
    out = _small_shm(f"{sys.executable} -m moerl.cli train {' '.join(args)}", tmp_path)
    assert out.returncode not in (0, 135, -7), out.stderr[-2000:]  # 135 / -7: SIGBUS
    assert "shared memory for engine processes: /dev/shm has" in out.stderr
    assert (tmp_path / "run" / "checkpoint" / "checkpoint.json").exists()  # the trained step is kept


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_hybrid_models_engine_process_gives_the_inprocess_rollouts_after_a_sync(mode, tmp_path):
    """The Qwen3.5-MoE tiny (linear-attention layers: state slots in the engine) in an engine process: after a sync
    of a trained policy (LoRA: its adapters), the same rollouts as the in-process engine, bit for bit."""
    from moerl.presets import init_model

    init_model("qwen3_5_moe", "tiny", tmp_path / "hybrid", seed=0)
    policy = _trained_policy(tmp_path / "hybrid", mode)
    pools = {p: _pool(tmp_path / "hybrid", p, 1, mode) for p in ("inprocess", "process")}
    try:
        reqs = _requests(seed=1)
        for r in reqs:
            r.adapter = "policy" if mode == "lora" else None
        before = {p: pool.generate(reqs) for p, pool in pools.items()} if mode == "full" else None
        for pool in pools.values():
            sync_policy(policy, pool, version=1, bucket_bytes=1 << 16)
        outs = {p: pool.generate(reqs) for p, pool in pools.items()}
        _same(outs["inprocess"], outs["process"])
        assert all(o.weight_version == 1 for o in outs["process"])
        if before is not None:  # the sync changed what the engine computes
            assert [c.logprobs.tolist() for o in before["process"] for c in o.outputs] != [
                c.logprobs.tolist() for o in outs["process"] for c in o.outputs
            ]
    finally:
        for pool in pools.values():
            pool.close()
