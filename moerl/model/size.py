"""Whether a model can be built here, judged before anything is allocated: its depth (one module per layer) and its
weights' bytes against the memory the device has available."""

from __future__ import annotations

import torch

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig

MAX_LAYERS = 4096  # the deepest released MoE has 94 layers; building 10^6 modules takes longer than a run


def check_buildable(cfg: ModelConfig) -> None:
    if cfg.num_layers > MAX_LAYERS:
        raise ConfigError(
            f"ModelConfig.num_layers={cfg.num_layers}: moerl builds a module per layer and takes at most {MAX_LAYERS}"
        )


def available_bytes(device: str | torch.device) -> int:
    """What ``device`` has free: CUDA's free memory, or the host's MemAvailable (else its physical memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gb(n: int) -> str:
    return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"


def check_fits(model: torch.nn.Module, device: str | torch.device, what: str) -> None:
    """ConfigError when ``model``'s tensors (meta tensors are enough) need more bytes than ``device`` has free."""
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    have = available_bytes(device)
    if need > have:
        count = sum(p.numel() for p in model.parameters())
        raise ConfigError(
            f"{what}: this config needs {_gb(need)} for its weights alone ({count / 1e9:.1f} B parameters); "
            f"{torch.device(device)} has {_gb(have)} available"
        )
