"""Weight transports to engine processes (moerl.rollout.transport): every bucket arrives bit for bit by each one the
CPU can run (shared memory, inline bytes over the socket, a gloo broadcast group), a transport the ends cannot use
is refused by name, and an engine that dies before a broadcast is named, not waited for. CUDA IPC runs in
``make gpu-check`` (it needs a GPU)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from moerl.engine import EngineConfig, Request, SamplingParams
from moerl.errors import ConfigError, EngineError
from moerl.rollout import make_engine
from moerl.rollout.transport import choose
from moerl.sync import sync_policy
from moerl.trainer import Policy, PolicyConfig

DTYPE = {"full": "bfloat16", "mxfp8": "float32"}  # the trainer's and the engines' (full: bf16 weights, fp32 routers)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moerl.presets import init_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    init_model("qwen3_moe", "tiny", path, seed=0)
    return path


def _pool(model, transport: str, n: int = 2, dtype: str = "float32"):
    cfg = EngineConfig(max_num_seqs=4, max_model_len=32)
    return make_engine(
        "native", model, cfg, placement="process", num_engines=n, threads=1, dtype=dtype, weight_transport=transport
    )


def _moved_policy(model, mode: str) -> Policy:
    """A policy whose every weight differs from the engines' base weights (so a tensor that did not arrive shows)."""
    pol = Policy(model, PolicyConfig(mode=mode, dtype=DTYPE[mode]))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in pol.master.master.values():
            p.add_(torch.randn_like(p) * 0.01)
        pol.master.master_to_model()
    return pol


def _differing(pool, sent: dict[str, torch.Tensor]) -> list[list[str]]:
    """Per engine, the names whose engine tensor is not ``sent``'s bit for bit (dtype included)."""
    out = []
    for got in pool.read_weights(list(sent)):
        out.append([n for n, t in sent.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)])
    return out


@pytest.mark.parametrize("transport", ["shm", "inline", "broadcast"])
@pytest.mark.parametrize("mode", ["full", "mxfp8"])
def test_every_bucket_arrives_bit_for_bit_by_each_transport(model, mode, transport):
    """Many buckets (64 KiB); the engines' tensors after the commit equal what the policy's sync sends, the fp32
    routers bit for bit. Negative control: a trainer weight changed after the sync shows as that one tensor."""
    from moerl.model.mx import MX_SCALE

    policy = _moved_policy(model, mode)
    pool = _pool(model, transport, dtype=DTYPE[mode])
    try:
        stats = sync_policy(policy, pool, version=3, bucket_bytes=1 << 16)
        assert stats.buckets > 5 and pool.weight_version == 3
        assert set(pool.kinds.values()) == {transport}
        sent = dict(policy.sync_tensors())
        if mode == "mxfp8":  # the engines hold the dequantized values of what was sent
            from moerl.model.mx import mx_dequantize

            for name in [n for n in sent if n.endswith(MX_SCALE)]:
                data = name.removesuffix(MX_SCALE)
                sent[data] = mx_dequantize(sent.pop(name), sent[data], torch.float32).to(policy.dtype)
        routers = [n for n in sent if ".router." in n]
        assert routers and all(sent[n].dtype == torch.float32 for n in routers)
        assert _differing(pool, sent) == [[], []]
        victim = next(n for n in sent if n.endswith("experts.down_proj"))
        sent[victim] = sent[victim].clone()
        sent[victim].view(-1)[0] += 1e-2
        assert _differing(pool, sent) == [[victim], [victim]]
    finally:
        pool.close()


def test_a_broadcast_engine_that_died_is_named_not_waited_for(model):
    policy = _moved_policy(model, "full")
    pool = _pool(model, "broadcast", dtype="bfloat16")
    try:
        dead = pool.engines[1]
        os.kill(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait()
        with pytest.raises(EngineError, match=rf"rollout engine 1 \(pid {dead.proc.pid}\) was killed by signal 9"):
            sync_policy(policy, pool, version=1, bucket_bytes=1 << 16)
    finally:
        pool.close()


def test_transports_the_two_ends_cannot_use_are_refused_by_name(model):
    with pytest.raises(ConfigError, match=r"weight_transport=cuda_ipc: needs every engine on CUDA \(rollout engine 0 "):
        _pool(model, "cuda_ipc", n=1)
    with pytest.raises(ConfigError, match=r"transport'='tcp': allowed: auto, shm, inline, cuda_ipc, broadcast"):
        _pool(model, "tcp", n=1)
    with pytest.raises(ConfigError, match=r"'broadcast' with rollout.placement=inprocess: engines in the trainer's"):
        make_engine("native", model, EngineConfig(max_num_seqs=4, max_model_len=32), weight_transport="broadcast")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    here = SimpleNamespace(name="rollout engine 0", device="cuda:0", same_node=True)
    away = SimpleNamespace(name="rollout engine 1", device="cuda:0", same_node=False)
    assert choose("auto", here, gpu) == "cuda_ipc" and choose("auto", here, cpu) == "shm"
    assert choose("auto", away, gpu) == "inline"
    with pytest.raises(ConfigError, match=r"cuda_ipc for rollout engine 0: .*weights on cpu, engine on cuda:0\)"):
        choose("cuda_ipc", here, cpu)
    with pytest.raises(ConfigError, match=r"cuda_ipc for rollout engine 1: .*engine on cuda:0, another node\)"):
        choose("cuda_ipc", away, gpu)
    with pytest.raises(ConfigError, match=r"weight_transport=shm for rollout engine 1: it runs on another node"):
        choose("shm", away, cpu)


def test_the_run_config_refuses_a_transport_it_would_ignore():
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    with pytest.raises(ConfigError, match=r"'rollout.weight_transport'='shm' with rollout.placement=inprocess"):
        load_config(RunConfig, None, ["rollout.weight_transport=shm"])
    with pytest.raises(ConfigError, match=r"rollout.weight_transport'='broadcast': native engines only"):
        load_config(RunConfig, None, ["rollout.engine=vllm", "rollout.weight_transport=broadcast"])


def test_an_engine_that_stops_answering_is_named_and_ended(model):
    """Liveness: a SIGSTOPped engine sends no heartbeat and is named once ``timeout_s`` passes without progress; one
    that lives but is stuck (joining a broadcast group nobody forms: heartbeats, no progress) is named too; closing
    the pool ends both processes."""
    from moerl.rollout.process import EngineProcess

    pool = make_engine(
        "native", model, EngineConfig(max_num_seqs=4, max_model_len=32), placement="process", num_engines=2,
        threads=1, dtype="float32", timeout_s=3.0,
    )  # fmt: skip
    try:
        stopped, stuck = pool.engines
        assert isinstance(stopped, EngineProcess)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        with pytest.raises(EngineError, match=r"rollout engine 0 \(pid \d+\) has not answered for 3 s while generate "
                           r"\(it is stopped \(SIGSTOP\?\)\); rollout.engine_timeout_s"):  # fmt: skip
            pool.generate([Request([5, 6, 7], SamplingParams(max_tokens=2))])
        stuck.send({"op": "join", "host": "127.0.0.1", "port": _free_port(), "rank": 1, "size": 2, "backend": "gloo"})
        with pytest.raises(EngineError, match=r"rollout engine 1 .* for 3 s while join \(its heartbeats go on, but it"):
            stuck.reply("join")
    finally:
        pool.close()
    assert stopped.proc.poll() is not None and stuck.proc.poll() is not None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
