"""A native engine in its own process, behind the InferenceEngine protocol.

The child is a plain ``python -c`` process (``moerl.child.spawn``) talking over a socket pair and running the
engine's command server (``moerl.rollout.server``). Commands and results are JSON (``moerl.rollout.wire``); tensors
(weights one way, logprobs and routed experts the other) travel through file-backed shared memory
(``moerl.rollout.shm``). The child dies with its parent (``PR_SET_PDEATHSIG``), ignores Ctrl-C (the parent stops
it), and a child that dies is reported by name.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from multiprocessing.connection import Connection

import torch

from moerl.child import proc_stopped, spawn
from moerl.engine import Request, RequestOutput
from moerl.errors import EngineError
from moerl.rollout.server import EngineServer
from moerl.rollout.shm import BufferCache
from moerl.rollout.spec import EngineSpec
from moerl.rollout.wire import outputs_from_json, recv_msg, request_to_json, send_msg, tensors_of
from moerl.rpc import check_reply

# -- the child ----------------------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    try:  # Linux: the kernel sends SIGKILL when the parent exits, however it exits
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the call above took effect
        os._exit(0)


HEARTBEAT_S = 1.0  # while it runs a command, an engine process says this often that it lives, and how far it got


def serve(fd: int, parent: int) -> None:
    """The engine process: build the engine from the first message, then answer commands until told to stop; while
    a command runs, a thread sends heartbeats carrying the engine's progress (``EngineServer.progress``)."""
    _die_with_parent(parent)
    # Ctrl-C and a scheduler's SIGTERM / SIGUSR1 reach the whole process group: the parent stops us
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    server = EngineServer()
    lock, busy = threading.Lock(), threading.Event()  # a reply is sent after the command's last heartbeat
    threading.Thread(target=_beat, args=(conn, lock, busy, server), name="moerl-heartbeat", daemon=True).start()
    while True:
        try:
            msg = recv_msg(conn)
        except (EOFError, OSError):
            break
        if msg["op"] == "shutdown":
            break
        busy.set()
        reply = server.handle(msg)
        with lock:
            busy.clear()
            send_msg(conn, reply)
    server.close()


def _beat(conn: Connection, lock: threading.Lock, busy: threading.Event, server: EngineServer) -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        with lock:
            if busy.is_set():
                try:
                    send_msg(conn, {"op": "beat", "progress": server.progress()})
                except OSError:
                    return


# -- the parent's handle --------------------------------------------------------------------------------------------


class EngineProcess:
    """One engine process. Calls are synchronous except ``generate_async`` / ``wait`` (engines run side by side)."""

    local = False  # tensors reach it by a transport (moerl.rollout.transport)
    side_by_side = True  # it works in its own process while the others work
    same_node = True

    START_TIMEOUT_S = 600.0

    def __init__(self, spec: EngineSpec, index: int = 0, timeout_s: float = 300.0):
        """``timeout_s``: how long a command may go without progress (a reply, or a generation step in a
        heartbeat) before the engine is named as hung."""
        self.index, self.timeout_s, self.hung = index, timeout_s, False
        self.proc, self.conn = spawn("moerl.rollout.process", "serve", os.getpid())
        self.outputs = BufferCache(unlink_on_open=True)
        self.weight_version = 0
        self.tokenizer = None
        reply = self._call({"op": "init", "spec": spec.to_json()}, timeout=self.START_TIMEOUT_S)
        self.pid, self.kv_cache_bytes, self.device = reply["pid"], reply["kv_cache_bytes"], reply["device"]
        self.gpu, self.dense_weights = reply["gpu"], reply["dense_weights"]

    @property
    def name(self) -> str:
        return f"rollout engine {self.index} (pid {self.proc.pid})"

    def _dead(self, doing: str) -> EngineError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (
            "is not answering"
            if code is None
            else (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        )
        return EngineError(f"{self.name} {how} while {doing}; see its stderr above")

    def _hung(self, op: str, limit: float, beating: bool) -> EngineError:
        if self.proc.poll() is not None:
            return self._dead(op)
        self.hung = True  # close() ends it without asking
        if beating:
            why = "its heartbeats go on, but it made no progress"
        else:
            why = "it is stopped (SIGSTOP?)" if proc_stopped(self.proc.pid) else "its process is alive"
        return EngineError(
            f"{self.name} has not answered for {limit:.0f} s while {op} ({why}); rollout.engine_timeout_s sets how "
            "long an engine may go without progress"
        )

    def send(self, msg: dict, tensors=None) -> None:
        """Send command ``msg``; its tensors (``tensors`` as they are, in this process) travel as ``msg`` locates
        them."""
        try:
            send_msg(self.conn, msg)
        except OSError:
            raise self._dead(msg["op"]) from None

    def reply(self, op: str, timeout: float | None = None) -> dict:
        """The reply to command ``op``; EngineError naming the engine when it dies, or goes ``timeout`` seconds
        (default ``timeout_s``) without progress: no heartbeat (stopped, or frozen) or no generation step."""
        limit = timeout or self.timeout_s
        last, progress = time.monotonic(), None
        try:
            while True:
                if not self.conn.poll(max(0.0, last + limit - time.monotonic())):
                    raise self._hung(op, limit, progress is not None)
                reply = recv_msg(self.conn)
                if reply.get("op") != "beat":
                    break
                if reply["progress"] != progress:
                    last, progress = time.monotonic(), reply["progress"]
        except (EOFError, OSError):
            raise self._dead(op) from None
        check_reply(self.name, reply)
        self.weight_version = reply["version"]
        return reply

    def _call(self, msg: dict, timeout: float | None = None) -> dict:
        self.send(msg)
        return self.reply(msg["op"], timeout)

    def generate_async(self, requests: list[Request]) -> None:
        self.send({"op": "generate", "requests": [request_to_json(r) for r in requests]})

    def wait(self) -> list[RequestOutput]:
        reply = self.reply("generate")
        return outputs_from_json(reply["outputs"], tensors_of(reply, self.outputs))

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        self.generate_async(requests)
        return self.wait()

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the engine's own tensors (parameters or buffers) by moerl name, read from its process."""
        reply = self._call({"op": "read_weights", "names": list(names)})
        return tensors_of(reply, self.outputs)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process (asked first, killed after ``timeout`` seconds); idempotent."""
        if self.proc.poll() is None and self.hung:
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            try:
                send_msg(self.conn, {"op": "shutdown"})
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.conn.close()
