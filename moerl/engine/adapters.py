"""Adapter slots of the engine: load adapters (PEFT directory or moerl-named tensors) by name into LoRA slots."""

from __future__ import annotations

import os

import torch

from moerl.engine.config import EngineConfig
from moerl.errors import CheckpointError, ConfigError, RequestError
from moerl.finite import all_finite
from moerl.model.lora import (
    EXPERT_KEYS,
    LINEAR_KEYS,
    LinearLora,
    LoraConfig,
    attach_lora,
    default_targets,
    lora_modules,
)


class AdapterSlots:
    """``max_loras`` slots of rank ``max_lora_rank`` on the engine's model; adapters of lower rank are zero-padded."""

    def __init__(self, model, cfg: EngineConfig):
        targets = cfg.lora_targets or default_targets(model)
        lcfg = LoraConfig(
            rank=cfg.max_lora_rank, alpha=1.0, targets=targets, layout=cfg.lora_layout, slots=cfg.max_loras
        )
        attach_lora(model, lcfg, dtype=model.dtype)
        if model.backend == "cpu":  # the engine's own CPU model: its adapters decode through the kernels too
            from moerl.cpu import install

            install(model)
        self.model, self.layout, self.rank = model, cfg.lora_layout, cfg.max_lora_rank
        self.modules = lora_modules(model)
        with torch.no_grad():
            for lora in self.modules.values():
                for p in lora.parameters():
                    p.zero_()
                lora.scale.zero_()
        self.names: dict[str, int] = {}

    def slot(self, name: str, who: str) -> int:
        """The slot of adapter ``name``; ``who`` (e.g. "request 3") asked for it and is named if it is unknown."""
        if name not in self.names:
            loaded = ", ".join(sorted(self.names)) or "none"
            raise RequestError(f"{who}: unknown adapter {name!r}; loaded adapters: {loaded}")
        return self.names[name]

    def remove(self, name: str) -> None:
        self.slot(name, "remove_adapter")
        del self.names[name]

    def add(self, name: str, source: str | os.PathLike | dict[str, torch.Tensor]) -> None:
        """Load adapter ``name`` (replacing one of that name); every tensor is checked before any is written."""
        if isinstance(source, dict):
            tensors, who = source, repr(name)
        else:
            from moerl.bridges.peft import read_peft_adapter

            tensors, who = read_peft_adapter(source, self.model), f"{name!r} (from {source})"
        plan = self._plan(who, tensors)
        if name in self.names:
            slot = self.names[name]
        else:
            free = sorted(set(range(len(next(iter(self.modules.values())).scale))) - set(self.names.values()))
            if not free:
                raise ConfigError(
                    f"adapter {who}: all {len(self.names)} adapter slots are in use "
                    f"({', '.join(self.names)}); raise EngineConfig.max_loras or remove one"
                )
            slot = free[0]
        with torch.no_grad():
            for lora in self.modules.values():
                for p in lora.parameters():
                    p[slot].zero_()
                lora.scale[slot] = 0.0
            for path, parts in plan.items():
                lora = self.modules[path]
                for key, t in parts.items():
                    if key == "scale":
                        lora.scale[slot] = float(t)
                        continue
                    dest = getattr(lora, key)[slot]
                    r = t.shape[-1] if key.endswith("B") else t.shape[-2]
                    index = (..., slice(None), slice(0, r)) if key.endswith("B") else (..., slice(0, r), slice(None))
                    dest[index] = t.to(dest.dtype)  # ranks below the slot's rank are zero-padded
        self.names[name] = slot

    def _plan(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Check every tensor against the slots (names, shapes, ranks, layout, finite values) before anything is
        written, so a refused adapter leaves the slot as it was. ``name`` is the adapter as errors show it."""
        plan: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            _check_values(name, key, t)
            path, _, part = key.rpartition(".")
            lora = self.modules.get(path)
            if lora is None:
                raise CheckpointError(
                    f"adapter {name}: tensor {key!r} targets no adapted module of this engine "
                    f"(EngineConfig.lora_targets); adapted modules look like {next(iter(self.modules))!r}"
                )
            allowed = (LINEAR_KEYS if isinstance(lora, LinearLora) else EXPERT_KEYS) + ("scale",)
            if part not in allowed:
                raise CheckpointError(f"adapter {name}: unexpected tensor {key!r} (allowed suffixes: {allowed})")
            if part != "scale":
                t = self._fit(name, key, part, t, getattr(lora, part)[0])
            plan.setdefault(path, {})[part] = t
        for path, parts in plan.items():
            keys = LINEAR_KEYS if isinstance(self.modules[path], LinearLora) else EXPERT_KEYS
            missing = [k for k in keys + ("scale",) if k not in parts]
            if missing:
                raise CheckpointError(f"adapter {name}: module {path!r} lacks tensor(s) {missing}")
            for a, b in zip(keys[::2], keys[1::2], strict=True):  # (A, B) pairs: zero-padding would hide a mismatch
                ra, rb = parts[a].shape[-2], parts[b].shape[-1]
                if ra != rb:
                    raise CheckpointError(
                        f"adapter {name}: module {path!r} has {a} of rank {ra} and {b} of rank {rb}; they must match"
                    )
        return plan

    def _fit(self, name: str, key: str, part: str, t: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        """Bring ``t`` to the slot's layout (broadcast a shared factor over experts) and check its shape."""
        shared_in_slot = dest.ndim == 2 and part in ("gate_up_A", "down_B")
        if part in ("gate_up_A", "down_B"):
            if t.ndim == 2 and not shared_in_slot:  # shared_outer adapter into per_expert slots
                t = t.unsqueeze(0).expand(dest.shape[0], *t.shape)
            elif t.ndim == 3 and shared_in_slot:
                if not bool((t == t[:1]).all()):
                    raise CheckpointError(
                        f"adapter {name}: tensor {key!r} has a factor per expert {tuple(t.shape)}, but this "
                        f"engine's slots are shared_outer (one {tuple(dest.shape)} factor); load it into a "
                        f"per_expert engine (EngineConfig.lora_layout)"
                    )
                t = t[0]
        rank_dim = -1 if part.endswith("B") else -2
        other = [d for i, d in enumerate(t.shape) if i != t.ndim + rank_dim]
        want = [d for i, d in enumerate(dest.shape) if i != dest.ndim + rank_dim]
        if t.ndim != dest.ndim or other != want:
            shape = list(dest.shape)
            shape[rank_dim] = "r"
            raise CheckpointError(
                f"adapter {name}: tensor {key!r} has shape {tuple(t.shape)}, this model needs "
                f"{tuple(shape)} (r <= {self.rank})"
            )
        if t.shape[rank_dim] == 0:
            raise CheckpointError(
                f"adapter {name}: tensor {key!r} has rank 0 (shape {tuple(t.shape)}); an adapter needs rank >= 1"
            )
        if t.shape[rank_dim] > self.rank:
            raise CheckpointError(
                f"adapter {name}: tensor {key!r} has rank {t.shape[rank_dim]} > EngineConfig.max_lora_rank={self.rank}"
            )
        return t


def _check_values(name: str, key: str, t) -> None:
    """A tensor, and every value finite (NaN / inf would poison every request of the adapter); a scale is one."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"adapter {name}: {key!r} is a {type(t).__name__}, not a tensor")
    if key.endswith(".scale") and t.numel() != 1:
        raise CheckpointError(f"adapter {name}: tensor {key!r} has shape {tuple(t.shape)}; a scale is one number")
    if not all_finite(t):
        nan = int(t.isnan().sum())
        inf = int((~t.isfinite()).sum()) - nan
        counts = " and ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "inf")) if n)
        raise CheckpointError(
            f"adapter {name}: tensor {key!r} has {counts} value(s) of {t.numel()}; refusing to load it"
        )
