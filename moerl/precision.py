"""Compute dtypes by name, and what ``auto`` means on this machine.

bf16 halves memory and, where the hardware multiplies it natively (CUDA; CPUs with AVX512-BF16 or AMX), runs
GEMMs faster than fp32. A CPU without it (AVX2 only, most laptops) converts every element: measured here, bf16
GEMMs ran at ~1 GFLOP/s against ~130 in fp32. ``auto`` picks bf16 where it is native and fp32 elsewhere.
"""

from __future__ import annotations

import torch

from moerl.errors import ConfigError

DTYPE_NAMES = ("auto", "bfloat16", "float32")


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 natively (CUDA, or a CPU with AVX512-BF16 / AMX)."""
    if torch.device(device).type == "cuda":
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def dtype_name(name: str, device: str | torch.device = "cpu", key: str = "dtype") -> str:
    """``name`` with ``auto`` resolved for ``device``: bfloat16 where native, else float32 (``key`` names the
    setting in the error)."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"{key}={name!r}: allowed: {', '.join(DTYPE_NAMES)}")
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    return name


def compute_dtype(name: str, device: str | torch.device = "cpu", key: str = "dtype") -> torch.dtype:
    """The torch dtype ``name`` means on ``device`` (see ``dtype_name``)."""
    return getattr(torch, dtype_name(name, device, key))
