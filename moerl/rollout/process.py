"""A native engine in its own process, behind the InferenceEngine protocol.

The child is a plain ``python -c`` process (``moerl.child.spawn``) talking over a socket pair. Commands and results
are JSON; tensors (weights one way, logprobs and routed experts the other) travel through file-backed shared memory
(``moerl.rollout.shm``). The child dies with its parent (``PR_SET_PDEATHSIG``), ignores Ctrl-C (the parent stops
it), and a child that dies is reported by name.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from moerl import errors
from moerl.child import spawn
from moerl.engine import EngineConfig, LLMEngine, Request, RequestOutput, SamplingParams
from moerl.engine.sequence import Completion
from moerl.errors import ConfigError, EngineError, MoerlError
from moerl.precision import compute_dtype
from moerl.rollout.shm import BufferCache, SharedBuffer, layout


@dataclass(slots=True)
class EngineSpec:
    """What builds one native engine, in this process or another: JSON-serialisable."""

    model: str
    config: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "auto"  # auto | bfloat16 | float32 (moerl.precision), resolved where the engine runs
    mx_scale_mode: str | None = None  # mxfp8 policies: quantize the engine's GEMMs the trainer's way
    threads: int = 0  # torch threads of an engine process (0: leave torch's default)
    vllm_args: dict = field(default_factory=dict)  # engine=vllm: more vllm.LLM arguments

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EngineSpec:
        return cls(**{**data, "config": EngineConfig(**data["config"])})


def build_native(spec: EngineSpec) -> LLMEngine:
    """The native engine ``spec`` describes (the same function builds it in process and in an engine process)."""
    if spec.mx_scale_mode is not None and spec.config.compile_decode:
        raise ConfigError("rollout.compile_decode with an mxfp8 policy: not built (MXFP8 engines decode eager)")
    engine = LLMEngine(spec.model, spec.config, dtype=compute_dtype(spec.dtype, key="rollout.dtype"))
    if spec.mx_scale_mode is not None:
        from moerl.model.mx import apply_mxfp8

        apply_mxfp8(engine.model, spec.mx_scale_mode)
    return engine


# -- wire format: requests and outputs as JSON, their tensors in shared memory ----------------------------------


def request_to_json(r: Request) -> dict:
    prompt = r.prompt if isinstance(r.prompt, str) else [int(t) for t in r.prompt]
    return {"prompt": prompt, "params": dataclasses.asdict(r.params), "adapter": r.adapter, "id": r.request_id}


def request_from_json(d: dict) -> Request:
    return Request(d["prompt"], SamplingParams(**d["params"]), d["adapter"], d["id"])


def outputs_to_json(outs: list[RequestOutput]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The outputs as JSON, their logprobs / routed experts as named tensors (``"i.j.logprobs"`` ...)."""
    tensors, rows = {}, []
    for i, o in enumerate(outs):
        comps = []
        for c in o.outputs:
            for what, t in (("logprobs", c.logprobs), ("routed", c.routed_experts)):
                if t is not None:
                    tensors[f"{i}.{c.index}.{what}"] = t
            comps.append({"index": c.index, "tokens": c.token_ids, "text": c.text, "finish": c.finish_reason})
        rows.append(
            {
                "id": o.request_id,
                "prompt": o.prompt_token_ids,
                "outputs": comps,
                "version": o.weight_version,
                "error": o.error,
                "error_kind": o.error_kind,
            }
        )
    return rows, tensors


def outputs_from_json(rows: list[dict], tensors: dict[str, torch.Tensor]) -> list[RequestOutput]:
    outs = []
    for i, r in enumerate(rows):
        comps = [
            Completion(
                c["index"],
                c["tokens"],
                c["text"],
                tensors.get(f"{i}.{c['index']}.logprobs"),
                c["finish"],
                tensors.get(f"{i}.{c['index']}.routed"),
            )
            for c in r["outputs"]
        ]
        outs.append(RequestOutput(r["id"], r["prompt"], comps, r["version"], r["error"], r["error_kind"]))
    return outs


def check_reply(name: str, reply: dict) -> None:
    """Raise what engine ``name`` replied it raised: moerl's own errors keep their type across the boundary."""
    if not reply["ok"]:
        cls = getattr(errors, reply["type"], None)
        if isinstance(cls, type) and issubclass(cls, MoerlError):
            raise cls(reply["message"])
        raise EngineError(f"{name}: {reply['type']}: {reply['message']}")


def _send(conn: Connection, msg: dict) -> None:
    conn.send_bytes(json.dumps(msg).encode())


def _recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes())


class _Writer:
    """A shared buffer that grows as needed; ``put`` packs tensors and returns the message fields that locate them.

    ``append``: after what earlier ``put`` s of the same update wrote (the readers keep views of those until the
    update is committed: the buffer is the update's staging area); ``reset`` starts the next update at byte 0.
    """

    def __init__(self, tag: str):
        self.tag, self.buf, self.used = tag, None, 0

    def reset(self) -> None:
        self.used = 0

    def put(self, tensors: dict[str, torch.Tensor], append: bool = False) -> dict:
        start = self.used if append else 0
        _, end = layout(tensors, start)
        if self.buf is None or end > self.buf.nbytes:  # a new file; readers keep their views of the old one
            old = self.buf.nbytes if self.buf is not None else 0
            if self.buf is not None:
                self.buf.unlink()
            _, end = layout(tensors)
            start, self.buf = 0, SharedBuffer.create(max(end, 2 * old, 1 << 20), self.tag)
        specs = self.buf.pack(tensors, start)
        self.used = end
        return {"buffer": self.buf.path, "nbytes": self.buf.nbytes, "tensors": specs}

    def close(self) -> None:
        if self.buf is not None:
            self.buf.unlink()


# -- the child ----------------------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    try:  # Linux: the kernel sends SIGKILL when the parent exits, however it exits
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the call above took effect
        os._exit(0)


class EngineServer:
    """The engine's side of the command protocol (JSON commands, tensors in shared memory or inline bytes): what an
    engine process and a Ray engine actor both run. ``handle`` answers one command; errors become replies."""

    def __init__(self):
        self.reader, self.writer = BufferCache(), _Writer("moerl-out")
        self.engine: LLMEngine | None = None

    def _tensors_out(self, tensors: dict[str, torch.Tensor], inline: bool) -> dict:
        return pack_inline(tensors) if inline else self.writer.put(tensors)

    def handle(self, msg: dict) -> dict:
        op, engine = msg["op"], self.engine
        try:
            reply = {}
            if op == "init":
                spec = EngineSpec.from_json(msg["spec"])
                if spec.threads:
                    torch.set_num_threads(spec.threads)
                engine = self.engine = build_native(spec)
                reply = {"pid": os.getpid(), "kv_cache_bytes": engine.kv_cache_bytes}
            elif op == "generate":
                outs = engine.generate([request_from_json(r) for r in msg["requests"]])
                rows, tensors = outputs_to_json(outs)
                reply = {"outputs": rows, **self._tensors_out(tensors, msg.get("inline_out", False))}
            elif op in ("stage", "set_adapter") or (op == "add_adapter" and "tensors" in msg):
                # views, no copy: the parent writes each bucket of an update to its own place in the buffer, so the
                # staged views stay valid until the commit copies them into the weights
                tensors = tensors_of(msg, self.reader, copy=False)
                if op == "stage":
                    engine.stage_weights(tensors)
                elif op == "set_adapter":
                    engine.set_adapter(msg["name"], tensors, msg["version"])
                else:
                    engine.add_adapter(msg["name"], tensors)
            elif op == "commit":
                engine.commit_weights(msg["version"])
            elif op == "discard":
                engine.discard_staged()
            elif op == "add_adapter":
                engine.add_adapter(msg["name"], msg["path"])
            elif op == "read_weights":
                params = dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())
                tensors = {n: params[n].detach() for n in msg["names"]}
                reply = self._tensors_out(tensors, msg.get("inline_out", False))
            else:
                raise ValueError(f"unknown engine command {op!r}")
            return {"ok": True, "version": engine.weight_version if engine else 0, **reply}
        except Exception as e:  # the parent raises it; the engine stays up
            return {"ok": False, "type": type(e).__name__, "message": str(e)}

    def close(self) -> None:
        self.writer.close()


def pack_inline(tensors: dict[str, torch.Tensor]) -> dict:
    """Message fields carrying ``tensors`` as bytes (when no shared memory reaches the reader)."""
    data = torch.empty(layout(tensors)[1], dtype=torch.uint8)
    specs = SharedBuffer.over(data).pack(tensors)
    return {"inline": data.numpy().tobytes(), "tensors": specs}


def tensors_of(fields: dict, buffers: BufferCache, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors a message carries: inline bytes (``pack_inline``; viewed in a private copy of them) or a shared
    buffer's, mapped through ``buffers`` (copies, or views with ``copy=False``)."""
    if "inline" in fields:
        data = torch.frombuffer(bytearray(fields["inline"]), dtype=torch.uint8)
        return SharedBuffer.over(data).read(fields["tensors"], copy=False)
    return buffers.get(fields["buffer"], fields["nbytes"]).read(fields["tensors"], copy=copy)


def serve(fd: int, parent: int) -> None:
    """The engine process: build the engine from the first message, then answer commands until told to stop."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    conn = Connection(fd)
    server = EngineServer()
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            break
        if msg["op"] == "shutdown":
            break
        _send(conn, server.handle(msg))
    server.close()


# -- the parent's handle --------------------------------------------------------------------------------------------


class EngineProcess:
    """One engine process. Calls are synchronous except ``generate_async`` / ``wait`` (engines run side by side)."""

    START_TIMEOUT_S = 600.0

    def __init__(self, spec: EngineSpec, index: int = 0):
        self.index = index
        self.proc, self.conn = spawn("moerl.rollout.process", "serve", os.getpid())
        self.outputs = BufferCache(unlink_on_open=True)
        self.weight_version = 0
        self.tokenizer = None
        reply = self._call({"op": "init", "spec": spec.to_json()}, timeout=self.START_TIMEOUT_S)
        self.pid, self.kv_cache_bytes = reply["pid"], reply["kv_cache_bytes"]

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

    def send(self, msg: dict) -> None:
        try:
            _send(self.conn, msg)
        except OSError:
            raise self._dead(msg["op"]) from None

    def reply(self, op: str, timeout: float | None = None) -> dict:
        try:
            if timeout is not None and not self.conn.poll(timeout):
                raise self._dead(op)
            reply = _recv(self.conn)
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
        if self.proc.poll() is None:
            try:
                _send(self.conn, {"op": "shutdown"})
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.conn.close()
