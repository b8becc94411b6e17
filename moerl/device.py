"""Devices by name: ``device: auto | cpu | cuda | cuda:N`` for the policy and the rollout engines.

``auto`` is CUDA where it is present (a distributed rank takes the GPU of its ``LOCAL_RANK``: one process per GPU),
else the CPU. A name the host cannot serve is refused with what it has."""

from __future__ import annotations

import os

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
