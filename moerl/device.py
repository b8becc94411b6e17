"""Devices by name: ``device: auto | cpu | cuda | cuda:N`` for the policy and the rollout engines.

``auto`` is CUDA where it is present (a distributed rank takes the GPU of its ``LOCAL_RANK``: one process per GPU),
else the CPU. A name the host cannot serve is refused with what it has."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import torch

from moerl.errors import ConfigError

DEVICE_NAMES = "auto, cpu, cuda, cuda:N"


def device_name(name: str, key: str = "device") -> str:
    """``name`` if it names a device moerl runs on (``auto``, ``cpu``, ``cuda``, ``cuda:N``), whatever this host has
    (the process that uses it may run elsewhere); else a ConfigError naming ``key``."""
    try:
        device = torch.device(name) if isinstance(name, str) and name != "auto" else None
    except RuntimeError:
        device = None
    ours = device is not None and (device.type == "cuda" or (device.type == "cpu" and not device.index))
    if name != "auto" and not ours:
        raise ConfigError(f"{key}={name!r}: allowed: {DEVICE_NAMES}")
    return name


def resolve_device(name: str | torch.device, key: str = "device") -> torch.device:
    """The ``torch.device`` config key ``key`` names, on this host."""
    if isinstance(name, torch.device):
        return name
    if device_name(name, key) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{key}={name!r}: this host has no CUDA device (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda}); use {key}=cpu or auto"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{key}={name!r}: this host has {count} CUDA device(s): cuda:0 .. cuda:{count - 1}")
    return device


# a GPU's compute capability while ``gpu_paths`` holds: moerl's code takes the paths it takes on such a GPU
_PLANNED_GPU: tuple[int, int] | None = None


@contextmanager
def gpu_paths(capability: tuple[int, int] = (9, 0)):
    """Inside the block moerl's code takes the paths it takes on a CUDA GPU of ``capability`` (an H100 / H200 by
    default) whatever device its tensors are on: a plan of a GPU run traces them on the CPU (``moerl.plan``). Where
    the paths differ: the grouped GEMM's (``moerl.model.grouped``), the dtype of the expert adapters' GEMMs, reading
    adapter slots on the host (``moerl.model.lora``)."""
    global _PLANNED_GPU
    before, _PLANNED_GPU = _PLANNED_GPU, capability
    try:
        yield
    finally:
        _PLANNED_GPU = before


def gpu_planned() -> bool:
    """Whether a plan traces moerl's CUDA paths on the CPU (inside ``gpu_paths``)."""
    return _PLANNED_GPU is not None


def on_gpu(t: torch.Tensor) -> bool:
    """Whether work on ``t`` takes moerl's CUDA paths: ``t`` is on CUDA, or a plan traces them (``gpu_paths``)."""
    return t.is_cuda or gpu_planned()


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of CUDA ``device`` (or of the GPU a plan traces for, ``gpu_paths``); None off CUDA."""
    if _PLANNED_GPU is not None:
        return _PLANNED_GPU
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def gpu_id(device: str | torch.device) -> str | None:
    """The physical GPU behind a CUDA device: its UUID, the same in every process whatever ``CUDA_VISIBLE_DEVICES``
    shows it as (Ray gives each actor its own numbering); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def host_tensor(values: list, dtype: type = np.int64) -> torch.Tensor:
    """A host tensor of ``values`` (numpy ``dtype``) through numpy: ``torch.tensor`` reads a Python list several
    times slower (~0.13 us an element: 59 us for a 64-row step's block tables, 10 against 2 us for its temperatures)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on ``device`` in one copy: on CUDA packed into one pinned buffer and sent non-blocking (a copy
    from pageable memory, one per tensor, would wait for the stream each time); on the CPU as they are. On CUDA the
    results are views of one buffer (``packed_copy``): a compiled graph taking them sees inputs that alias."""
    if device.type != "cuda":
        return tensors
    return packed_copy(tensors, device)


def packed_copy(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (on one device) on ``device`` as views of one buffer, made by one copy: each at an offset aligned
    for its element size. From the host the buffer is pinned and the copy non-blocking; a CPU ``device`` gets the
    same views (what a CUDA step's inputs look like, on any host)."""
    spans, end = [], 0
    for t in tensors:
        end = -(-end // 8) * 8
        spans.append((end, t.numel() * t.element_size()))
        end += spans[-1][1]
    source = tensors[0].device if tensors else torch.device("cpu")
    pinned = source.type == "cpu" and device.type == "cuda"
    buf = torch.empty(end, dtype=torch.uint8, device=source, pin_memory=pinned)
    for t, (at, size) in zip(tensors, spans, strict=True):
        buf[at : at + size].copy_(t.contiguous().flatten().view(torch.uint8))
    buf = buf.to(device, non_blocking=pinned)
    return [buf[at : at + size].view(t.dtype).view(t.shape) for t, (at, size) in zip(tensors, spans, strict=True)]


def from_device(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Device tensors on the host in one copy, the host waiting for it once (a read per tensor would wait each
    time): on CUDA packed into one buffer on the device, copied, and cut into host tensors of the same dtypes and
    shapes; CPU tensors as they are. None stays None."""
    present = [t for t in tensors if t is not None]
    if not any(t.device.type == "cuda" for t in present):
        return tensors
    back = iter(packed_copy(present, torch.device("cpu")))
    return [None if t is None else next(back) for t in tensors]
