"""An engine in this process behind the handle engine processes and Ray engine actors have (``send`` / ``reply``,
``generate_async`` / ``wait``, ``read_weights``, ``close``), so the pool drives every placement the same way.

A command's tensors are handed over as they are (no shared memory, no copy); the command runs when it is sent and
its error is raised by ``reply``, as a remote engine's would be.
"""

from __future__ import annotations

import torch

from moerl.engine import LLMEngine, Request, RequestOutput
from moerl.rpc import Dispatcher

COMMANDS = ("stage", "commit", "discard", "set_adapter", "add_adapter", "compile_decode", "decode_seconds")


class LocalEngine:
    """Handle on ``engine``, the pool's engine ``index``."""

    local = True  # the pool hands it tensors as they are
    same_node = True

    def __init__(self, engine: LLMEngine, index: int = 0):
        self.engine, self.index = engine, index
        self.tokenizer = engine.tokenizer
        self.calls = Dispatcher(self, COMMANDS, self.name)
        self.pending: tuple[str, object] | None = None

    @property
    def name(self) -> str:
        return f"rollout engine {self.index} (in process)"

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def send(self, msg: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        try:
            self.pending = ("ok", self.calls.call(msg["op"], msg, tensors))
        except Exception as e:  # raised by reply, after every engine of the pool got the command
            self.pending = ("error", e)

    def reply(self, op: str, timeout: float | None = None):
        kind, value = self.pending
        self.pending = None
        if kind == "error":
            raise value
        return value

    def generate_async(self, requests: list[Request]) -> None:
        self.pending = ("requests", requests)  # one process: the engines of a pool take turns, in order

    def wait(self) -> list[RequestOutput]:
        _, requests = self.pending
        self.pending = None
        return self.engine.generate(requests)

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        params = dict(self.engine.model.named_parameters()) | dict(self.engine.model.named_buffers())
        return {n: params[n].detach().clone() for n in names}

    def close(self) -> None:
        pass

    # -- the commands ----------------------------------------------------------------------------------------
    def stage(self, msg: dict, tensors) -> None:
        self.engine.stage_weights(tensors)

    def commit(self, msg: dict, tensors) -> None:
        self.engine.commit_weights(msg["version"])

    def discard(self, msg: dict, tensors) -> None:
        self.engine.discard_staged()

    def set_adapter(self, msg: dict, tensors) -> None:
        self.engine.set_adapter(msg["name"], tensors, msg["version"])

    def add_adapter(self, msg: dict, tensors) -> None:
        self.engine.add_adapter(msg["name"], tensors if tensors is not None else msg["path"])

    def compile_decode(self, msg: dict, tensors) -> dict:
        return {"on": self.engine.compile_decode()}

    def decode_seconds(self, msg: dict, tensors) -> dict:
        return {"seconds": self.engine.decode_seconds}
