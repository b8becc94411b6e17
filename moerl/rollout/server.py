"""The engine's side of the command protocol: what an engine process and a Ray engine actor both run.

Each command names one method of ``EngineServer`` (the allowlist below) through moerl's one dispatcher
(``moerl.rpc``); its JSON fields are the arguments, its tensors come through shared memory or inline bytes
(``moerl.rollout.wire``). Errors become replies; the engine stays up.
"""

from __future__ import annotations

import os

import torch

from moerl.device import gpu_id
from moerl.engine import LLMEngine
from moerl.rollout.shm import BufferCache, ShmWriter
from moerl.rollout.spec import EngineSpec, build_native
from moerl.rollout.transport import IpcReader, SyncMember
from moerl.rollout.wire import outputs_to_json, pack_inline, request_from_json, tensors_of
from moerl.rpc import Dispatcher

COMMANDS = (
    "init",
    "join",
    "generate",
    "stage",
    "commit",
    "discard",
    "set_adapter",
    "add_adapter",
    "read_weights",
    "compile_decode",
    "decode_seconds",
)


class EngineServer:
    """One engine (native, or vLLM in a Ray actor) behind the command protocol; ``handle`` answers one command."""

    def __init__(self, engine: LLMEngine | None = None):
        """``engine``: one already built (an engine in this process, ``moerl.rollout.local``); else ``init``."""
        self.reader, self.writer = BufferCache(), ShmWriter("moerl-out")
        self.engine = engine
        self.ipc, self.member = IpcReader(), None  # cuda_ipc buffers; the pool's broadcast group once joined
        self.dispatch = Dispatcher(self, COMMANDS, "engine")

    def handle(self, msg: dict) -> dict:
        """Answer command ``msg`` (its tensors read where it says they are); an error is the reply."""
        reply = self.dispatch.reply(msg["op"], msg)
        return reply | {"version": self.engine.weight_version if self.engine else 0} if reply["ok"] else reply

    def progress(self) -> int:
        """How far the engine got: its generation steps so far (a heartbeat carries it while a command runs)."""
        return self.engine.steps if self.engine is not None else 0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.writer.close()
        if self.member is not None:
            self.member.close()

    def _tensors_out(self, tensors: dict[str, torch.Tensor], inline: bool) -> dict:
        return pack_inline(tensors) if inline else self.writer.put(tensors)

    def _tensors_in(self, msg: dict, given: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The command's tensors: ``given`` as they are (an engine in this process), else read where ``msg`` says
        (None: it carries none)."""
        if given is not None or "tensors" not in msg:
            return given
        # views, no copy: the parent writes each bucket of an update to its own place in the buffer (a broadcast
        # bucket gets a buffer of its own), so the staged views stay valid until the commit copies them
        if "broadcast" in msg:
            return self.member.receive(msg).read(msg["tensors"], copy=False)
        if "ipc" in msg:
            return self.ipc.get(msg).read(msg["tensors"], copy=False)
        return tensors_of(msg, self.reader, copy=False)

    # -- the commands: each takes the message (and tensors given as they are) and returns the reply's fields ------
    def init(self, msg: dict, tensors=None) -> dict:
        spec = EngineSpec.from_json(msg["spec"])
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.engine = build(spec)
        return {
            "pid": os.getpid(),
            "kv_cache_bytes": getattr(self.engine, "kv_cache_bytes", 0),
            "device": str(self.engine.device),
            "gpu": gpu_id(self.engine.device),  # the pool's broadcast group holds one rank per GPU
            "dense_weights": self.engine.dense_weights,  # vLLM: LoRA merged, MX values
        }

    def join(self, msg: dict, tensors=None) -> None:
        """Become rank ``msg["rank"]`` of the pool's broadcast group (``transport.SyncGroup``)."""
        self.member = SyncMember(msg, self.engine.device)

    def generate(self, msg: dict, tensors=None) -> dict:
        rows, tensors = outputs_to_json(self.engine.generate([request_from_json(r) for r in msg["requests"]]))
        return {"outputs": rows, **self._tensors_out(tensors, msg.get("inline_out", False))}

    def stage(self, msg: dict, tensors=None) -> None:
        self.engine.stage_weights(self._tensors_in(msg, tensors))

    def commit(self, msg: dict, tensors=None) -> None:
        self.engine.commit_weights(msg["version"])

    def discard(self, msg: dict, tensors=None) -> None:
        self.engine.discard_staged()

    def set_adapter(self, msg: dict, tensors=None) -> None:
        self.engine.set_adapter(msg["name"], self._tensors_in(msg, tensors), msg["version"])

    def add_adapter(self, msg: dict, tensors=None) -> None:
        tensors = self._tensors_in(msg, tensors)
        self.engine.add_adapter(msg["name"], tensors if tensors is not None else msg["path"])

    def compile_decode(self, msg: dict, tensors=None) -> dict:
        return {"on": self.engine.compile_decode(msg.get("on", True))}

    def decode_seconds(self, msg: dict, tensors=None) -> dict:
        e = self.engine
        return {"seconds": e.decode_seconds, "tokens": e.decode_tokens, "compile_seconds": e.compile_seconds}

    def read_weights(self, msg: dict, tensors=None) -> dict:
        """The engine's own tensors by name: moerl's for a native engine, vLLM's for a vLLM engine."""
        return self._tensors_out(self.engine.read_weights(msg["names"]), msg.get("inline_out", False))


def build(spec: EngineSpec, timeout_s: float = 300.0):
    """The engine ``spec`` describes: native, or one vLLM engine (its own processes, started from here)."""
    if spec.kind == "vllm":
        from moerl.rollout.vllm import VLLMEngine, say_what_it_serves

        say_what_it_serves(spec, spec.config.max_loras > 0)
        return VLLMEngine(spec, lora=spec.config.max_loras > 0, timeout_s=timeout_s)
    return build_native(spec)
