"""The engine command protocol's wire format: requests and outputs as JSON, their tensors in shared memory
(``moerl.rollout.shm``) or inline bytes where no shared memory reaches the reader; framed JSON messages on a
connection."""

from __future__ import annotations

import base64
import dataclasses
import json
from multiprocessing.connection import Connection

import torch

from moerl.engine import Request, RequestOutput, SamplingParams
from moerl.engine.sequence import Completion
from moerl.rollout.shm import BufferCache, SharedBuffer, layout


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


def send_msg(conn: Connection, msg: dict) -> None:
    if isinstance(msg.get("inline"), bytes):  # JSON carries the inline tensors' bytes as base64
        msg = msg | {"inline": base64.b64encode(msg["inline"]).decode()}
    conn.send_bytes(json.dumps(msg).encode())


def recv_msg(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes())


def pack_inline(tensors: dict[str, torch.Tensor]) -> dict:
    """Message fields carrying ``tensors`` as bytes (when no shared memory reaches the reader)."""
    data = torch.empty(layout(tensors)[1], dtype=torch.uint8)
    specs = SharedBuffer.over(data).pack(tensors)
    return {"inline": data.numpy().tobytes(), "tensors": specs}


def tensors_of(fields: dict, buffers: BufferCache, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors a message carries: inline bytes (``pack_inline``; viewed in a private copy of them) or a shared
    buffer's, mapped through ``buffers`` (copies, or views with ``copy=False``)."""
    if "inline" in fields:
        raw = fields["inline"]
        data = torch.frombuffer(bytearray(base64.b64decode(raw) if isinstance(raw, str) else raw), dtype=torch.uint8)
        return SharedBuffer.over(data).read(fields["tensors"], copy=False)
    return buffers.get(fields["buffer"], fields["nbytes"]).read(fields["tensors"], copy=copy)
