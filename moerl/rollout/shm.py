"""File-backed shared memory for tensors that cross a process boundary on one host.

A writer packs named tensors into a byte buffer that both processes map (``torch.from_file(shared=True)`` on a file
in ``/dev/shm``) and sends only their layout (name, dtype, shape, byte offset) as JSON; the reader views them in
place and copies out what it keeps. One memcpy on each side, no pickle, no Python objects per element. The file is
unlinked as soon as every reader has mapped it, so a crash leaves nothing behind in ``/dev/shm``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from moerl.errors import SharedMemoryFull

ALIGN = 64  # byte alignment of every tensor in a buffer (any dtype can view it; cache-line aligned)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a shared-memory layout")
    return dtype


def layout(tensors: dict[str, torch.Tensor], start: int = 0) -> tuple[list[dict], int]:
    """Where each tensor goes in a buffer from byte ``start`` on: ``[{name, dtype, shape, offset}]`` and the end."""
    specs, offset = [], start
    for name, t in tensors.items():
        offset = -(-offset // ALIGN) * ALIGN
        specs.append(
            {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
        )
        offset += t.numel() * t.element_size()
    return specs, offset


def placement(tensors: dict[str, torch.Tensor], used: int, append: bool, capacity: int | None) -> tuple:
    """Where a bucket goes in a staging buffer that grows (``capacity`` None: no buffer yet, or none usable):
    ``(start, end, size)``, ``size`` that of a new buffer to make first (the bucket then starts it) or None. With
    ``append`` it goes after the ``used`` bytes of the update's earlier buckets, which readers still view."""
    start = used if append else 0
    _, end = layout(tensors, start)
    if capacity is not None and end <= capacity:
        return start, end, None
    _, end = layout(tensors)
    return 0, end, max(end, 2 * (capacity or 0), 1 << 20)


class SharedBuffer:
    """A byte buffer in a shared file. The creator writes (``pack``), readers ``open`` it by path and ``view``."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path, self.nbytes = path, nbytes
        if create:
            _allocate(path, max(nbytes, 1))
        self.data = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)

    @classmethod
    def over(cls, data: torch.Tensor) -> SharedBuffer:
        """A buffer over bytes already in memory (``data``, uint8): the same layout, no file."""
        buf = cls.__new__(cls)
        buf.path, buf.nbytes, buf.data = "<inline bytes>", data.numel(), data
        return buf

    @classmethod
    def create(cls, nbytes: int, tag: str = "moerl") -> SharedBuffer:
        path = os.path.join(_shm_dir(), f"{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(path, nbytes, create=True)

    @classmethod
    def open(cls, path: str, nbytes: int) -> SharedBuffer:
        return cls(path, nbytes, create=False)

    def pack(self, tensors: dict[str, torch.Tensor], start: int = 0) -> list[dict]:
        """Copy ``tensors`` into the buffer from byte ``start`` on; returns their layout (it must fit ``nbytes``)."""
        specs, need = layout(tensors, start)
        if need > self.nbytes:
            raise ValueError(f"{need} bytes of tensors do not fit the {self.nbytes}-byte shared buffer {self.path}")
        for spec, t in zip(specs, tensors.values(), strict=True):
            self._view(spec).copy_(t)
        return specs

    def _view(self, spec: dict) -> torch.Tensor:
        dtype, shape = _dtype(spec["dtype"]), spec["shape"]
        n = dtype.itemsize
        for d in shape:
            n *= d
        if spec["offset"] + n > self.nbytes or spec["offset"] % ALIGN:
            raise ValueError(f"tensor {spec['name']!r} lies outside the shared buffer {self.path}")
        return self.data[spec["offset"] : spec["offset"] + n].view(dtype).view(shape)

    def read(self, specs: list[dict], copy: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of ``specs``: copies (safe after the writer reuses the buffer) or views (``copy=False``)."""
        return {s["name"]: (self._view(s).clone() if copy else self._view(s)) for s in specs}

    def unlink(self) -> None:
        """Remove the file (mappings stay valid): call once every process that needs it has mapped it."""
        Path(self.path).unlink(missing_ok=True)


def _allocate(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` of real pages: a tmpfs without room fails here, by name, instead of killing
    the process with SIGBUS at the first write to a page it cannot back (a sparse file's pages come on write)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        Path(path).unlink(missing_ok=True)
        where = os.path.dirname(path)
        free = shutil.disk_usage(where).free
        raise SharedMemoryFull(
            f"shared memory for engine processes: {where} has {free / 2**20:.1f} MiB free, a buffer of "
            f"{nbytes / 2**20:.1f} MiB does not fit ({e.strerror}); a weight update is staged there whole: give it "
            "room (docker run --shm-size=...; a container's default is 64 MiB) or run the engines in this process "
            "(rollout.placement=inprocess)"
        ) from None
    finally:
        os.close(fd)


class BufferCache:
    """The reader's side: buffers mapped by path (a writer that outgrows its buffer sends a new path)."""

    def __init__(self, unlink_on_open: bool = False):
        self.unlink_on_open = unlink_on_open  # the only reader: remove the file once mapped
        self.buffers: dict[str, SharedBuffer] = {}

    def get(self, path: str, nbytes: int) -> SharedBuffer:
        buf = self.buffers.get(path)
        if buf is None or buf.nbytes != nbytes:
            self.buffers = {path: SharedBuffer.open(path, nbytes)}  # a new buffer replaces the old one
            buf = self.buffers[path]
            if self.unlink_on_open:
                buf.unlink()
        return buf


class ShmWriter:
    """A shared buffer that grows as needed; ``put`` packs tensors and returns the message fields that locate them.

    ``append``: after what earlier ``put`` s of the same update wrote (the readers keep views of those until the
    update is committed: the buffer is the update's staging area); ``reset`` starts the next update at byte 0.
    """

    def __init__(self, tag: str):
        self.tag, self.buf, self.used = tag, None, 0

    def reset(self) -> None:
        self.used = 0

    def put(self, tensors: dict[str, torch.Tensor], append: bool = False) -> dict:
        start, end, size = placement(tensors, self.used, append, self.buf.nbytes if self.buf is not None else None)
        if size is not None:  # a new file; readers keep their views of the old one
            if self.buf is not None:
                self.buf.unlink()
            self.buf = SharedBuffer.create(size, self.tag)
        specs = self.buf.pack(tensors, start)
        self.used = end
        return {"buffer": self.buf.path, "nbytes": self.buf.nbytes, "tensors": specs}

    def close(self) -> None:
        if self.buf is not None:
            self.buf.unlink()
