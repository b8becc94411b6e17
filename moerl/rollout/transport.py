"""How a weight update's tensors reach an engine in another process, chosen per engine by where both run.

- ``shm``: a file in ``/dev/shm`` both processes map (``moerl.rollout.shm``): engines on the trainer's host.
- ``inline``: the bytes inside the message (Ray's object store carries them between nodes).
- ``cuda_ipc``: the pool packs the update into one CUDA buffer and sends its IPC handle; an engine on a GPU of the
  same node maps that memory and copies from it at commit: no host copy, no second buffer.
- ``broadcast``: a process group of the pool (rank 0) and its engines, NCCL when every end is on a GPU (across GPUs
  and nodes), gloo otherwise; each bucket is one broadcast into a buffer on the engine's device.

``auto``: ``cuda_ipc`` where the bucket and the engine are both on CUDA on one node, ``shm`` elsewhere on the node,
``inline`` on another node. Every transport carries the same layout (``shm.layout``: name, dtype, shape, offset)
over a byte buffer.
"""

from __future__ import annotations

import base64
import datetime

import torch
import torch.distributed as dist

from moerl.errors import ConfigError, EngineError
from moerl.rollout.shm import SharedBuffer, layout, placement

SYNC_TIMEOUT_S = 600.0  # a broadcast that waits longer names the group (an engine stopped or died mid-update)


def choose(requested: str, engine, tensors_device: torch.device) -> str:
    """The transport for one bucket on ``tensors_device`` to ``engine`` (a handle with ``name``, ``device``,
    ``same_node``); a requested one the two ends cannot use is refused by name."""
    on_cuda = tensors_device.type == "cuda" and engine.device.startswith("cuda")
    if requested == "auto":
        return ("cuda_ipc" if on_cuda else "shm") if engine.same_node else "inline"
    if requested == "cuda_ipc" and not (on_cuda and engine.same_node):
        raise ConfigError(
            f"rollout.weight_transport=cuda_ipc for {engine.name}: needs the trainer's weights and the engine on CUDA "
            f"on one node (weights on {tensors_device}, engine on {engine.device}"
            f"{'' if engine.same_node else ', another node'}); use auto"
        )
    if requested == "shm" and not engine.same_node:
        raise ConfigError(f"rollout.weight_transport=shm for {engine.name}: it runs on another node; use auto")
    return requested


# -- CUDA IPC -------------------------------------------------------------------------------------------------------
def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def share(buf: torch.Tensor) -> dict:
    """Message fields that let another process on this node map ``buf`` (a CUDA uint8 tensor over a whole storage).
    Each call takes a fresh reference the reader gives back (torch's IPC reference counting)."""
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = buf.untyped_storage()._share_cuda_()
    return {
        "device": device,
        "handle": _b64(handle),
        "size": size,
        "offset": offset,
        "rc_handle": _b64(rc_handle),
        "rc_offset": rc_offset,
        "event": _b64(ev_handle) if ev_handle else "",
        "event_sync": bool(ev_sync),
    }


class IpcWriter:
    """The pool's CUDA buffer for ``cuda_ipc`` engines; like ``ShmWriter``: it grows as needed and ``append`` puts a
    bucket after the update's earlier ones (the engines hold views of them until the commit)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.used, self.kept = 0, []  # buffers outgrown in this update: engines still view them

    def reset(self) -> None:
        self.used, self.kept = 0, []
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees outgrown buffers the engines have let go of

    def put(self, tensors: dict[str, torch.Tensor], append: bool = False) -> dict:
        device = next(iter(tensors.values())).device
        usable = self.buf is not None and self.buf.device == device
        start, end, size = placement(tensors, self.used, append, self.buf.numel() if usable else None)
        if size is not None:
            if self.buf is not None:
                self.kept.append(self.buf)
            self.buf = torch.empty(size, dtype=torch.uint8, device=device)
        specs = SharedBuffer.over(self.buf).pack(tensors, start)
        self.used = end
        torch.cuda.current_stream(device).synchronize()  # the engine reads what these copies wrote
        return {"ipc": share(self.buf), "nbytes": self.buf.numel(), "tensors": specs}


class IpcReader:
    """The engine's side: the pool's buffers mapped by handle (one mapping per allocation, as torch keeps it)."""

    def __init__(self):
        self.storages: dict[tuple[str, int], torch.UntypedStorage] = {}

    def get(self, fields: dict) -> SharedBuffer:
        ipc = fields["ipc"]
        rc = base64.b64decode(ipc["rc_handle"])
        key = (ipc["handle"], ipc["offset"])
        storage = self.storages.get(key)
        if storage is None:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                ipc["device"],
                base64.b64decode(ipc["handle"]),
                ipc["size"],
                ipc["offset"],
                rc,
                ipc["rc_offset"],
                base64.b64decode(ipc["event"]) if ipc["event"] else None,
                ipc["event_sync"],
            )
            self.storages = {key: storage}  # the latest buffer; staged views keep older ones until the commit
        else:  # mapped already: give back the reference this message took
            torch.UntypedStorage._release_ipc_counter_cuda(rc, ipc["rc_offset"])
        data = torch.empty(0, dtype=torch.uint8, device=storage.device)
        data.set_(storage, 0, (fields["nbytes"],), (1,))
        return SharedBuffer.over(data)


# -- broadcast ------------------------------------------------------------------------------------------------------
def _backend_group(store, rank: int, size: int, backend: str, timeout_s: float):
    store = dist.PrefixStore("moerl-sync", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class SyncGroup:
    """A process group of the pool (rank 0) and its ``broadcast`` engines, beside (not inside) any torch.distributed
    world of the trainer. The pool ``listen`` s, sends each engine ``join_fields(rank)``, then ``connect`` s."""

    def __init__(self, size: int, backend: str, device: torch.device, host: str = "127.0.0.1"):
        self.size, self.backend, self.device, self.host = size, backend, device, host
        self.store = dist.TCPStore(
            host, 0, size, is_master=True, timeout=datetime.timedelta(seconds=SYNC_TIMEOUT_S), wait_for_workers=False
        )
        self.pg = None
        self.buf: torch.Tensor | None = None  # the bucket being sent (broadcast after the engines got its message)

    def join_fields(self, rank: int) -> dict:
        return {"host": self.host, "port": self.store.port, "rank": rank, "size": self.size, "backend": self.backend}

    def connect(self) -> None:
        self.pg = _backend_group(self.store, 0, self.size, self.backend, SYNC_TIMEOUT_S)

    def put(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Pack one bucket for the next ``send``; the message fields that tell the engines what it holds."""
        specs, end = layout(tensors)
        self.buf = torch.empty(end, dtype=torch.uint8, device=self.device)
        SharedBuffer.over(self.buf).pack(tensors)
        return {"broadcast": end, "tensors": specs}

    def send(self) -> None:
        broadcast(self.pg, self.buf, "the pool")
        self.buf = None

    def close(self) -> None:
        self.pg = self.store = None  # the group before its store: the other order can abort the process at exit


def broadcast(pg, buf: torch.Tensor, who: str) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        pg.broadcast([buf], opts).wait()
    except RuntimeError as e:  # a peer died or stopped answering
        raise EngineError(f"weight broadcast ({who}): {(str(e).strip().splitlines() or [''])[0]}") from None


class SyncMember:
    """An engine's end of the pool's ``SyncGroup``: receives each bucket into a buffer on ``device``."""

    def __init__(self, fields: dict, device: torch.device):
        timeout = datetime.timedelta(seconds=SYNC_TIMEOUT_S)
        self.store = dist.TCPStore(fields["host"], fields["port"], fields["size"], is_master=False, timeout=timeout)
        self.rank, self.backend = fields["rank"], fields["backend"]
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.pg = _backend_group(self.store, self.rank, fields["size"], self.backend, SYNC_TIMEOUT_S)

    def receive(self, fields: dict) -> SharedBuffer:
        buf = torch.empty(fields["broadcast"], dtype=torch.uint8, device=self.device)
        broadcast(self.pg, buf, f"engine rank {self.rank}")
        return SharedBuffer.over(buf)

    def close(self) -> None:
        self.pg = self.store = None
