"""What the backend's modules bind a decode step into (``moerl.cpu.direct``): the step's inputs and buffers, and the
kernel calls in order. Each module of the backend adds its own calls (``bind``) and says what of its configuration it
cannot bind (``bound_refusal``), so the bound step is assembled from the modules and a module of another class is
its one refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class Binding:
    """One batch size's buffers and its kernel calls (``rows`` rows over block tables ``width`` blocks wide)."""

    rows: int
    width: int
    cache: Any  # the engine's KVCache, whose pools the attention calls read and write
    x: torch.Tensor  # [rows, H] the residual stream
    h: torch.Tensor  # [rows rounded up to 16, H] each norm's output (the kernel reads 16 rows a block)
    pos: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64: the pool row this step's key goes to
    tables: torch.Tensor  # [rows, width] int64
    cos: torch.Tensor  # [rows, D]
    sin: torch.Tensor
    idx: torch.Tensor  # [L, rows, k] int64: each layer's chosen experts
    gate: torch.Tensor  # [L, rows, k] fp32
    adapters: torch.Tensor | None  # [rows] int64 each row's LoRA slot (None: bound without adapters)
    calls: list = field(default_factory=list)  # (callable, arguments) in order
    keep: list = field(default_factory=list)  # what the calls point into
    shared: dict = field(default_factory=dict)  # the buffers the layers share (``buf``)
    why: str | None = None  # why a module could not bind its calls here (its ``bind`` returned False)

    @property
    def padded(self) -> int:
        """The rows rounded up to the 16 a kernel block reads."""
        return -(-self.rows // 16) * 16

    def call(self, fn, args: tuple) -> None:
        """Add a kernel call (``fn(*args)``) to the step, after those added before it."""
        self.calls.append((fn, args))

    def buf(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer of ``shape`` named ``name``: one for every layer, as the layers run one after another."""
        return self.shared.setdefault((name, shape, dtype), torch.empty(shape, dtype=dtype))
