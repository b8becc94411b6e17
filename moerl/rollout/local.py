"""An engine in this process behind the handle engine processes and Ray engine actors have (``send`` / ``reply``,
``generate_async`` / ``wait``, ``read_weights``, ``close``), so the pool drives every placement the same way.

The commands are the engine server's own (``moerl.rollout.server``: one body each, wherever the engine runs); a
command's tensors are handed over as they are (no shared memory, no copy); it runs when it is sent and its error is
raised by ``reply``, as a remote engine's would be.
"""

from __future__ import annotations

import torch

from moerl.engine import LLMEngine, Request, RequestOutput
from moerl.rollout.server import EngineServer
from moerl.rpc import Dispatcher

COMMANDS = ("stage", "commit", "discard", "set_adapter", "add_adapter", "compile_decode", "decode_seconds")


class LocalEngine:
    """Handle on ``engine``, the pool's engine ``index``."""

    local = True  # the pool hands it tensors as they are
    same_node = True

    def __init__(self, engine: LLMEngine, index: int = 0):
        self.engine, self.index = engine, index
        self.tokenizer, self.dense_weights = engine.tokenizer, engine.dense_weights
        self.calls = Dispatcher(EngineServer(engine), COMMANDS, self.name)
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
