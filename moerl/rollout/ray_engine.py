"""Engines as Ray actors (native, or vLLM: the actor starts vLLM's processes), behind the same handle as an engine
process.

The actor runs the engine process's command server (``moerl.rollout.server``): JSON commands, weights by the
transport ``moerl.rollout.transport`` chooses (shared memory or CUDA IPC on the trainer's node, bytes in the message
through Ray's object store between nodes, or a broadcast group); outputs through shared memory on the trainer's node,
else inline. Ray restarts an actor that dies
(``cluster.engine_restarts`` times); the pool then replays the last weight update into it and re-sends its
unfinished requests.
"""

from __future__ import annotations

import os
import time

import torch

from moerl.device import gpu_id
from moerl.engine import Request, RequestOutput
from moerl.errors import ConfigError, EngineDied, EngineError
from moerl.rollout.server import EngineServer
from moerl.rollout.shm import BufferCache
from moerl.rollout.spec import EngineSpec
from moerl.rollout.wire import outputs_from_json, request_to_json, tensors_of
from moerl.rpc import check_reply

PROGRESS_EVERY_S = 1.0  # how often the handle asks a busy engine actor how far it got


class EngineActor:
    """The actor: one native engine built from ``spec`` with ``threads`` torch threads (Ray re-runs this on a
    restart, so a restarted engine starts from the base weights)."""

    def __init__(self, spec: dict, threads: int):
        torch.set_num_threads(max(1, threads))
        if spec["kind"] == "vllm":  # vLLM's CPU worker: the actor's CPUs as threads, not vLLM's own core binding
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ["OMP_NUM_THREADS"] = str(max(1, threads))
        self.server = EngineServer()
        reply = self.server.handle({"op": "init", "spec": spec})
        if not reply["ok"]:
            raise EngineError(f"{reply['type']}: {reply['message']}")

    def call(self, msg: dict) -> dict:
        return self.server.handle(msg)

    def progress(self) -> int:
        """The engine's generation steps so far: answered beside a running ``call`` (the actor has two threads)."""
        return self.server.progress()

    def where(self) -> dict:
        import ray

        node = ray.get_runtime_context().get_node_id()
        engine = self.server.engine
        dense = engine.dense_weights
        return {
            "node": node,
            "pid": os.getpid(),
            "device": str(engine.device),
            "gpu": gpu_id(engine.device),
            "dense": dense,
        }


class RayEngine:
    """The loop's handle on one engine actor: ``send`` / ``reply`` like an engine process, ``generate_async`` /
    ``wait`` so engines run side by side. ``same_node``: it shares the trainer's node; ``inline``: its outputs travel
    in the replies (no shared memory)."""

    local = False  # tensors reach it by a transport (moerl.rollout.transport)
    side_by_side = True  # it works in its own process while the others work

    START_TIMEOUT_S = 600.0

    def __init__(self, actor, index: int, same_node: bool, inline: bool, timeout_s: float = 300.0):
        import ray

        self.actor, self.index, self.same_node, self.inline = actor, index, same_node, inline
        self.timeout_s = timeout_s  # how long a call may go without progress
        self.outputs = BufferCache(unlink_on_open=True)
        self.weight_version, self.tokenizer, self.pending = 0, None, None
        where = ray.get(actor.where.remote(), timeout=self.START_TIMEOUT_S)
        self.pid, self.device, self.gpu = where["pid"], where["device"], where["gpu"]
        self.dense_weights = where["dense"]  # a vLLM engine's dtype: it takes LoRA merged, MX values

    @property
    def name(self) -> str:
        return f"rollout engine {self.index} (Ray actor, pid {self.pid})"

    def send(self, msg: dict, tensors=None) -> None:
        """Send command ``msg`` (its tensors as ``msg`` locates them; ``tensors`` is for engines in this process)."""
        self.pending = (msg["op"], self.actor.call.remote(msg))

    def reply(self, op: str, timeout: float | None = None) -> dict:
        """The reply to ``op``; EngineDied when the actor died (Ray may restart it), EngineError naming it when it
        goes ``timeout`` seconds (default ``timeout_s``) without progress: its ``progress`` call unanswered (the
        process stopped or frozen) or no generation step."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        _, ref = self.pending
        self.pending = None
        limit = timeout or self.timeout_s
        last, progress = time.monotonic(), None
        try:
            while not ray.wait([ref], timeout=min(PROGRESS_EVERY_S, limit))[0]:
                left = last + limit - time.monotonic()
                try:
                    now = ray.get(self.actor.progress.remote(), timeout=max(left, 0.1))
                except GetTimeoutError:
                    raise self._hung(op, limit, "it does not answer (stopped or frozen)") from None
                if now != progress:
                    last, progress = time.monotonic(), now
                elif time.monotonic() - last > limit:
                    raise self._hung(op, limit, "it answers, but it made no progress")
            reply = ray.get(ref)
        except RayActorError as e:
            raise EngineDied(f"{self.name} died while {op}: {type(e).__name__}") from None
        check_reply(self.name, reply)
        self.weight_version = reply["version"]
        return reply

    def _hung(self, op: str, limit: float, why: str) -> EngineError:
        import ray

        ray.kill(self.actor, no_restart=True)  # a hung engine is not brought back: the run stops
        return EngineError(
            f"{self.name} has not answered for {limit:.0f} s while {op} ({why}); rollout.engine_timeout_s sets how "
            "long an engine may go without progress"
        )

    def generate_async(self, requests: list[Request]) -> None:
        self.send({"op": "generate", "requests": [request_to_json(r) for r in requests], "inline_out": self.inline})

    def wait(self) -> list[RequestOutput]:
        reply = self.reply("generate")
        return outputs_from_json(reply["outputs"], tensors_of(reply, self.outputs))

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        self.send({"op": "read_weights", "names": list(names), "inline_out": self.inline})
        return tensors_of(self.reply("read_weights"), self.outputs)

    def revive(self) -> None:
        """Wait until Ray has restarted the actor (from the base weights); EngineError when it will not (its restarts
        are used up: ``ActorDiedError``) or does not come back in time."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        deadline = time.monotonic() + self.START_TIMEOUT_S
        while True:
            try:
                self.pid = ray.get(self.actor.where.remote(), timeout=30)["pid"]
                self.weight_version = 0
                return
            except ActorDiedError as e:
                raise EngineError(f"{self.name} died and was not restarted: {e}") from None
            except (ActorUnavailableError, GetTimeoutError):  # restarting
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name} died and did not come back") from None
            time.sleep(0.2)

    def close(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def start_engines(
    spec: EngineSpec, num_engines: int, placement, transport: str, restarts: int, timeout_s: float = 300.0
) -> list[RayEngine]:
    """``num_engines`` engine actors in the bundles ``placement.engine_bundles`` of ``placement.group`` (each with
    ``placement.engine_cpus`` CPUs and as many torch threads), restarted up to ``restarts`` times; outputs through
    shared memory from those on this node, inline from the others and wherever ``transport`` is ``inline``."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if len(placement.engine_bundles) != num_engines:
        raise ConfigError(f"{num_engines} engines need {num_engines} placement bundles, got {placement.engine_bundles}")
    here = ray.get_runtime_context().get_node_id()
    cls = ray.remote(EngineActor)
    actors = [
        cls.options(
            num_cpus=placement.engine_cpus,
            num_gpus=placement.engine_gpus,
            max_restarts=restarts,
            max_task_retries=0,  # a restarted engine has the base weights: the pool replays the update, then retries
            max_concurrency=2,  # a progress call is answered while a command runs
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=b),
        ).remote(spec.to_json(), max(1, int(placement.engine_cpus)))
        for b in placement.engine_bundles
    ]
    nodes = ray.get([a.where.remote() for a in actors], timeout=RayEngine.START_TIMEOUT_S)
    same = [n["node"] == here for n in nodes]
    return [
        RayEngine(a, i, s, transport == "inline" or not s, timeout_s)
        for i, (a, s) in enumerate(zip(actors, same, strict=True))
    ]
