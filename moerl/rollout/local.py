"""An engine in this process behind the handle engine processes and Ray engine actors have (``send`` / ``reply``,
``generate_async`` / ``wait``, ``read_weights``, ``close``), so the pool drives every placement the same way.

The commands are the engine server's own (``moerl.rollout.server``: one body each, wherever the engine runs); a
command's tensors are handed over as they are (no shared memory, no copy); its error is raised by ``reply``, as a
remote engine's would be. A native engine runs each command when it is sent (the engines of a pool take turns: they
share this process's cores); a vLLM engine works in its own processes, so its handle runs commands on a thread of
its own and the engines of a pool work side by side.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moerl.engine import LLMEngine, Request, RequestOutput
from moerl.rollout.server import EngineServer
from moerl.rpc import Dispatcher

COMMANDS = ("stage", "commit", "discard", "set_adapter", "add_adapter", "compile_decode", "decode_seconds")


class LocalEngine:
    """Handle on ``engine`` (an ``LLMEngine``, or a ``VLLMEngine`` with ``side_by_side``), the pool's engine
    ``index``."""

    local = True  # the pool hands it tensors as they are
    same_node = True

    def __init__(self, engine: LLMEngine, index: int = 0, side_by_side: bool = False):
        self.engine, self.index, self.side_by_side = engine, index, side_by_side
        self.tokenizer, self.dense_weights = engine.tokenizer, engine.dense_weights
        self.server = EngineServer(engine)
        self.calls = Dispatcher(self.server, COMMANDS, self.name)
        self.thread = ThreadPoolExecutor(1, f"moerl-engine-{index}") if side_by_side else None
        self.pending: Future | None = None

    @property
    def name(self) -> str:
        return f"rollout engine {self.index} (in process)"

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def _run(self, fn, *args) -> None:
        """``fn(*args)`` now, or on this handle's thread; its result or error is kept for ``reply`` / ``wait``."""
        if self.thread is not None:
            self.pending = self.thread.submit(fn, *args)
            return
        self.pending = Future()
        try:
            self.pending.set_result(fn(*args))
        except Exception as e:  # raised by reply, after every engine of the pool got the command
            self.pending.set_exception(e)

    def send(self, msg: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self._run(self.calls.call, msg["op"], msg, tensors)

    def reply(self, op: str, timeout: float | None = None):
        pending, self.pending = self.pending, None
        return pending.result()

    def generate_async(self, requests: list[Request]) -> None:
        if self.thread is not None:
            self._run(self.engine.generate, requests)
        else:  # one process: the engines of a pool take turns, in order
            self.pending = requests

    def wait(self) -> list[RequestOutput]:
        pending, self.pending = self.pending, None
        return pending.result() if isinstance(pending, Future) else self.engine.generate(pending)

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.engine.read_weights(names).items()}

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True)
        self.server.close()
