"""Compute dtypes by name, what ``auto`` means on this machine, and what decides its CPU kernels.

bf16 halves memory and, where the hardware multiplies it natively (CUDA; CPUs with AVX512-BF16 or AMX), runs
GEMMs faster than fp32. A CPU without it (AVX2 only, most laptops) converts every element: measured here, bf16
GEMMs ran at ~1 GFLOP/s against ~130 in fp32. ``auto`` picks bf16 where it is native and fp32 elsewhere.

Two environment variables change that answer: ``MOERL_AUTO_DTYPE`` (bfloat16 | float32) says what ``auto`` means
whatever the host (``make test`` runs the suite under either); ``ONEDNN_MAX_CPU_ISA`` held below AVX512-BF16 (as
one does to see on an AVX-512 / AMX host what an AVX2 host computes) makes the CPU's bf16 non-native.

``python -m moerl.precision`` prints the host line ``make test`` starts with.
"""

from __future__ import annotations

import os

import torch

from moerl.errors import ConfigError

DTYPE_NAMES = ("auto", "bfloat16", "float32")
AUTO_ENV = "MOERL_AUTO_DTYPE"
# oneDNN's ISA caps below avx512_core_bf16 (the first that multiplies bf16 natively)
_ONEDNN_ISAS = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni")


def cpu_features() -> dict[str, bool]:
    """Which of the CPU features that decide torch's kernels this host has (from /proc/cpuinfo where present)."""
    try:
        flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        flags = set()
    return {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}


def _isa_capped_below_bf16() -> bool:
    """Whether ONEDNN_MAX_CPU_ISA holds oneDNN below the ISAs that multiply bf16 natively."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().lower()
    return cap in _ONEDNN_ISAS


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 natively (CUDA, or a CPU with AVX512-BF16 / AMX that oneDNN may use)."""
    if torch.device(device).type == "cuda":
        return True
    if _isa_capped_below_bf16():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def auto_dtype(device: str | torch.device = "cpu") -> str:
    """What ``auto`` means on ``device``: ``MOERL_AUTO_DTYPE`` when set, else bfloat16 where native, else float32."""
    forced = os.environ.get(AUTO_ENV, "")
    if forced:
        if forced not in DTYPE_NAMES[1:]:
            raise ConfigError(f"{AUTO_ENV}={forced!r}: allowed: {', '.join(DTYPE_NAMES[1:])}")
        return forced
    return "bfloat16" if native_bf16(device) else "float32"


def dtype_name(name: str, device: str | torch.device = "cpu", key: str = "dtype") -> str:
    """``name`` with ``auto`` resolved for ``device`` (see ``auto_dtype``; ``key`` names the setting in the
    error)."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"{key}={name!r}: allowed: {', '.join(DTYPE_NAMES)}")
    return auto_dtype(device) if name == "auto" else name


def compute_dtype(name: str, device: str | torch.device = "cpu", key: str = "dtype") -> torch.dtype:
    """The torch dtype ``name`` means on ``device`` (see ``dtype_name``)."""
    return getattr(torch, dtype_name(name, device, key))


def host_summary() -> str:
    """One line: the CPU features and caps that decide the kernels, the thread count, and what ``auto`` picks."""
    have = [f for f, on in cpu_features().items() if on]
    named = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", AUTO_ENV)
    caps = [f"{v}={os.environ[v]}" for v in named if v in os.environ]
    return (
        f"host: CPU {' '.join(have) or 'features unknown'}; torch {torch.__version__} kernels "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
        f"{', '.join(caps) + '; ' if caps else ''}dtype auto = {auto_dtype()}"
    )


if __name__ == "__main__":
    print(host_summary())
