"""N rollout engines behind one InferenceEngine: in this process or each in its own process.

The requests of one call are split into N contiguous slices (balanced by samples) and the outputs gathered back in
request order; the split does not depend on where the engines run, so a seeded run gives the same rollouts in
process and in engine processes. Weight updates go to every engine; each applies them atomically between
generations and tags its outputs with the version.
"""

from __future__ import annotations

import atexit
import os
import weakref
from functools import partial

import torch

from moerl.device import gpu_id
from moerl.engine import Request, RequestOutput
from moerl.errors import ConfigError, EngineDied, EngineError
from moerl.rollout.fanout import gather, split
from moerl.rollout.local import LocalEngine
from moerl.rollout.process import EngineProcess
from moerl.rollout.shm import SharedBuffer, ShmWriter
from moerl.rollout.spec import EngineSpec, build_native
from moerl.rollout.transport import IpcWriter, SyncGroup, choose, share
from moerl.rollout.wire import pack_inline

_live: weakref.WeakSet[EnginePool] = weakref.WeakSet()


def one_rank_per_gpu(members: list[tuple[str, str | None]]) -> None:
    """Refuse a broadcast group whose members (name, GPU id) share a GPU: NCCL holds one rank per GPU (it fails its
    communicator with "duplicate GPU"), so an engine on the trainer's GPU takes its weights another way."""
    seen: dict[str, str] = {}
    for who, gpu in members:
        if gpu is not None and gpu in seen:
            raise ConfigError(
                f"rollout.weight_transport=broadcast: {seen[gpu]} and {who} are on one GPU ({gpu}), and an NCCL group "
                "holds one rank per GPU; there use rollout.weight_transport=cuda_ipc (or auto), or "
                "rollout.placement=inprocess"
            )
        seen[gpu] = who


class EnginePool:
    """``num_engines`` native engines built from ``spec``, ``placement`` ``inprocess`` or ``process``; or the engines
    ``handles`` built elsewhere: vLLM engines (``moerl.rollout.make``) or Ray engine actors, which come back when they
    die (Ray restarts the actor, the pool replays the last weight update into it and re-sends its unfinished
    requests, counted in ``restarts`` / ``requeued``). Every engine is a handle of one kind (``LocalEngine``,
    ``EngineProcess``, ``RayEngine``): the pool drives them the same way wherever they run. The values are the
    rollout config's, checked there (``moerl.run_config.RolloutSection``)."""

    def __init__(
        self,
        spec: EngineSpec,
        placement: str = "inprocess",
        num_engines: int = 1,
        handles=None,
        transport: str = "auto",
        timeout_s: float = 300.0,
    ):
        self.engines: list = []
        self.transport, self.kinds = transport, {}  # each engine's transport, chosen at its first update
        self.shm, self.ipc, self.group = ShmWriter("moerl-weights"), IpcWriter(), None
        self.update: list[tuple[dict, dict]] = []  # the last weight update's commands, for a revived engine
        self.restarts = self.requeued = 0
        self.compiled = False  # every engine told to decode compiled (compile_decode), an engine brought back too
        _live.add(self)
        try:
            if handles is not None:
                self.engines = list(handles)
            for i in range(num_engines if handles is None else 0):
                inproc = placement == "inprocess"
                self.engines.append(LocalEngine(build_native(spec), i) if inproc else EngineProcess(spec, i, timeout_s))
            if transport == "cuda_ipc" and not all(e.device.startswith("cuda") for e in self.engines):
                where = ", ".join(f"{e.name} on {e.device}" for e in self.engines)
                raise ConfigError(f"rollout.weight_transport=cuda_ipc: needs every engine on CUDA ({where})")
            if transport == "broadcast":
                self._form_group()
        except BaseException:
            self.close()
            raise
        self.tokenizer = self.engines[0].tokenizer
        if self.tokenizer is None:  # engines in other processes: the tokenizer is read here
            from moerl.bridges.checkpoint import load_tokenizer

            has_tok = any(os.path.exists(os.path.join(spec.model, f)) for f in ("tokenizer.json",))
            self.tokenizer = load_tokenizer(spec.model) if has_tok else None

    def _form_group(self) -> None:
        """The broadcast group of this process (rank 0) and the engines: NCCL when all of them are on GPUs."""
        nccl = torch.cuda.is_available() and all(e.device.startswith("cuda") for e in self.engines)
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        if nccl:
            one_rank_per_gpu([("the trainer", gpu_id(device))] + [(e.name, e.gpu) for e in self.engines])
        host = "127.0.0.1"
        if not all(e.same_node for e in self.engines):  # engines on other nodes reach this one by its address
            import ray

            host = ray.util.get_node_ip_address()
        self.group = SyncGroup(len(self.engines) + 1, "nccl" if nccl else "gloo", device, host)
        for rank, e in enumerate(self.engines, 1):
            e.send({"op": "join", **self.group.join_fields(rank)})
        self.group.connect()
        gather([partial(e.reply, "join") for e in self.engines])

    @property
    def dense_weights(self) -> str | None:
        """The dtype of the dense form the engines take (vLLM engines as Ray actors), else None (``sync_policy``)."""
        return self.engines[0].dense_weights

    @property
    def weight_version(self) -> int:
        return min(e.weight_version for e in self.engines)

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        parts = split(requests, len(self.engines))
        busy = [(e, s) for e, s in zip(self.engines, parts, strict=True) if requests[s]]
        for e, s in busy:  # engines in other processes generate side by side; in this process they take turns
            e.generate_async(requests[s])
        return [o for outs in gather([partial(self._wait, e, requests[s]) for e, s in busy]) for o in outs]

    def _wait(self, engine, requests: list[Request]) -> list[RequestOutput]:
        """``engine``'s outputs for ``requests``; one that died and came back gets them again (none were returned)."""
        while True:
            try:
                return engine.wait()
            except EngineDied:
                self._revive(engine)
                self.requeued += len(requests)
                engine.generate_async(requests)

    def _revive(self, engine) -> None:
        """Wait for a restarted engine actor, then replay the last weight update into it (it restarts from the base
        weights); EngineError when it does not come back."""
        for _ in range(3):
            engine.revive()
            self.restarts += 1
            copies: dict[int, SharedBuffer] = {}  # the update's shared-memory files again, under new names
            try:
                for msg, payloads in self.update:
                    engine.send(msg | self._replayed(engine, payloads, copies))
                    engine.reply(msg["op"])
                if self.compiled:
                    engine.send({"op": "compile_decode"})
                    engine.reply("compile_decode")
                return
            except EngineDied:
                continue
            finally:
                for c in copies.values():
                    c.unlink()
        raise EngineError(f"{engine.name} kept dying while its weights were restored")

    def _replayed(self, engine, payloads: dict, copies: dict) -> dict:
        """The fields that carry a recorded command's tensors to a revived ``engine`` the way it reads them."""
        if not payloads:
            return {}
        kind = self.kinds[engine.index]
        fields, kept = payloads[kind]
        if kind == "shm" and not os.path.exists(fields["buffer"]):
            if id(kept) not in copies:
                copies[id(kept)] = SharedBuffer.create(kept.nbytes, "moerl-replay")
                copies[id(kept)].data.copy_(kept.data)
            return fields | {"buffer": copies[id(kept)].path}
        if kind == "cuda_ipc":
            return fields | {"ipc": share(kept)}  # a fresh reference for the new process
        if kind == "broadcast":
            raise EngineError(f"{engine.name} came back, but a restarted engine cannot rejoin the broadcast group")
        return fields

    # -- weights ---------------------------------------------------------------------------------------------------
    def _kind(self, engine, tensors: dict[str, torch.Tensor]) -> str:
        if engine.local:
            return "local"
        return choose(self.transport, engine, next(iter(tensors.values())).device)

    def _payload(self, kind: str, tensors: dict[str, torch.Tensor], append: bool) -> tuple[dict, object]:
        """Message fields carrying ``tensors`` by ``kind``, and what must stay alive for a replay."""
        if kind == "shm":
            return self.shm.put(tensors, append), self.shm.buf
        if kind == "cuda_ipc":
            return self.ipc.put(tensors, append), self.ipc.buf
        if kind == "broadcast":
            return self.group.put(tensors), None
        return (pack_inline(tensors) if kind == "inline" else {}), None

    def _broadcast(self, op: str, tensors: dict[str, torch.Tensor] | None = None, **fields) -> None:
        """Send one command to every engine and wait for all; ``tensors`` go as they are to engines in this process
        and by each other engine's transport (``moerl.rollout.transport``), written once per transport (a
        ``stage`` appends to the update's earlier buckets). The command joins the update a revived engine gets
        replayed."""
        msg, payloads = {"op": op, **fields}, {}
        if tensors:
            for e in self.engines:
                self.kinds[e.index] = kind = self._kind(e, tensors)
                if kind not in payloads:
                    payloads[kind] = self._payload(kind, tensors, append=op == "stage")
        if op == "discard":
            self.update = []
        elif op in ("set_adapter", "add_adapter"):  # a whole adapter: it replaces what the update held of it
            self.update = [(m, p) for m, p in self.update if m.get("name") != fields["name"]] + [(msg, payloads)]
        else:
            self.update.append((msg, payloads))
        for e in self.engines:
            e.send(msg | (payloads[self.kinds[e.index]][0] if payloads else {}), tensors)
        sent = None
        if "broadcast" in payloads:
            try:
                self.group.send()  # after the engines got the message: they wait for it in the broadcast
            except EngineError as e:
                sent = e  # an engine that died is named by its reply below

        def answer(e):
            try:
                e.reply(op)
            except EngineDied:
                self._revive(e)  # the replay ends with this command

        gather([partial(answer, e) for e in self.engines])
        if sent is not None:
            raise sent
        if "shm" in payloads:
            self.shm.buf.unlink()  # every engine has mapped it: nothing is left in /dev/shm if we crash

    def _ask(self, op: str, **fields) -> list[dict]:
        """Every engine's answer to command ``op`` with ``fields`` (no weights: nothing to replay); one that died is
        brought back and asked again."""

        def ask(e):
            while True:
                e.send({"op": op} | fields)
                try:
                    return e.reply(op)
                except EngineDied:
                    self._revive(e)

        return gather([partial(ask, e) for e in self.engines])

    def decode_seconds(self) -> float:
        """Seconds the engines spent in decode forwards so far: their sum where they take turns in this process,
        the busiest one's where they run side by side."""
        seconds = [r["seconds"] for r in self._ask("decode_seconds")]
        return max(seconds) if self.engines[0].side_by_side else sum(seconds)

    def decode_tokens(self) -> int:
        """Tokens the engines' decode forwards made so far (all engines')."""
        return sum(r["tokens"] for r in self._ask("decode_seconds"))

    def decode_compile_seconds(self) -> float | None:
        """What compiling the engines' decode step took when it last compiled here (the slowest engine's), or None
        where an engine's is not known."""
        known = [r.get("compile_seconds") for r in self._ask("decode_seconds")]
        return None if None in known else max(known)

    def compile_decode(self, on: bool = True) -> bool:
        """Every engine decodes through its compiled step from its next decode on (``compile_decode: auto``, see
        ``LLMEngine.compile_decode``); an engine brought back later is told again. True if every engine does.
        ``on=False``: every engine back to its eager step."""
        answers = self._ask("compile_decode", on=on)
        self.compiled = on and all(r["on"] for r in answers)
        return self.compiled

    def discard_staged(self) -> None:
        self.shm.reset()
        self.ipc.reset()
        self._broadcast("discard")

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold one bucket of named tensors in every engine until ``commit_weights``."""
        self._broadcast("stage", tensors)

    def commit_weights(self, version: int) -> None:
        self._broadcast("commit", version=version)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.discard_staged()
        self.stage_weights(tensors)
        self.commit_weights(version)

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load (or replace) adapter ``name`` from tensors in every engine, in memory, tagged ``version``."""
        self._broadcast("set_adapter", tensors, name=name, version=version)

    def add_adapter(self, name: str, source) -> None:
        """Load adapter ``name`` from a PEFT directory (every engine reads it) or from tensors."""
        if isinstance(source, dict):
            self._broadcast("add_adapter", source, name=name)
        else:
            self._broadcast("add_adapter", name=name, path=str(source))

    def read_weights(self, names: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each engine's own copy of the named tensors (from its process when it has one)."""
        return [e.read_weights(names) for e in self.engines]

    def close(self) -> None:
        """Stop the engine processes (nothing to do in process); idempotent."""
        for e in self.engines:
            e.close()
        self.shm.close()
        if self.group is not None:
            self.group.close()
        _live.discard(self)


@atexit.register
def _close_all() -> None:  # engines never outlive the program, however the loop ended
    for pool in list(_live):
        pool.close()
