"""Live tensor bytes by what holds them, counted where tensors are made: the same count for a plan's fake tensors and
for a real run's (a dispatch-mode count of storages, not the process's RSS or an allocator's cache).

What a trainer rank holds at rest is named when counting starts (``held``: its weights, fp32 masters and optimizer
state); everything made after that is an activation (activations proper, temporaries, gathered FSDP weights,
exchange buffers) until the caller names it otherwise (``regard``: the gradients once a backward has made them;
``made_as``: e.g. what an optimizer step in host memory makes). The peak is the largest total on the device seen, with
its split by category at that moment; beside it, host memory ("host") at its own peak (a step's gradients reach the
host after the device's peak has passed).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("weights", "masters", "optimizer", "gradients", "activations", "host")
ON_DEVICE = CATEGORIES[:-1]  # "host": what a rank keeps in host memory (``policy.cpu_offload``), off the GPU's count


@dataclass(slots=True)
class Breakdown:
    """Bytes per category (``CATEGORIES``) and their sum."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    @property
    def total(self) -> int:
        """The bytes on the device (host memory left out)."""
        return sum(self.bytes[c] for c in ON_DEVICE)

    def copy(self) -> Breakdown:
        return Breakdown(dict(self.bytes))

    def largest(self) -> str:
        return max(ON_DEVICE, key=self.bytes.get)


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding ``t``'s data on this rank (a DTensor's: its local shard's)."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


class Memory(TorchDispatchMode):
    """Counts live storages while active (see the module docstring). ``held``: category -> tensors alive at the
    start. ``now`` / ``peak``: the current and the largest Breakdown."""

    def __init__(self, held: dict[str, Iterable[torch.Tensor]]):
        super().__init__()
        self._serial = 0
        self._of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> serial
        self._entries: dict[int, list] = {}  # serial -> [weakref to the storage, bytes, category, made at]
        self.now, self.peak = Breakdown(), Breakdown()
        self.made_as = "activations"  # the category of what is made from now on (until ``regard`` says otherwise)
        self._peak_serial = 0
        self.host_peak = 0
        self._resize = None
        for category, tensors in held.items():
            for t in tensors:
                self._add(storage(t), category)
        self._at_peak()

    def __enter__(self) -> Memory:
        original = torch.UntypedStorage.resize_
        memory = self

        def resize_(st, size):  # FSDP frees and re-makes its gathered weights by resizing their storages
            before = st.nbytes()
            out = original(st, size)
            memory._resized(st, before, st.nbytes())
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            if storage(out) not in self._of:
                self._add(storage(out), self.made_as)
            return out
        if not isinstance(out, tuple | list):  # a device, a scalar: no storage
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = storage(t)
                if st not in self._of:
                    self._add(st, self.made_as)
        return out

    def regard(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Count the storages of ``tensors`` (made while counting) as ``category`` from now on and at the peak
        (where they were alive then: made before it)."""
        for t in tensors:
            if t is None:
                continue
            serial = self._of.get(storage(t))
            if serial is None:
                continue
            entry = self._entries[serial]
            nbytes, was = entry[1], entry[2]
            if was == category:
                continue
            entry[2] = category
            self.now.bytes[was] -= nbytes
            self.now.bytes[category] += nbytes
            if entry[3] <= self._peak_serial:  # alive, at this size, at the peak (the host's: its own, below)
                self.peak.bytes[was] -= nbytes * (was != "host")
                self.peak.bytes[category] += nbytes * (category != "host")
            self._host_seen()

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        if st in self._of:
            return
        self._serial += 1
        serial = self._serial
        self._of[st] = serial
        self._entries[serial] = [weakref.ref(st, partial(self._freed, serial)), st.nbytes(), category, serial]
        self.now.bytes[category] += st.nbytes()
        if self.now.total > self.peak.total:
            self._at_peak()
        self._host_seen()

    def _freed(self, serial: int, _ref) -> None:
        entry = self._entries.pop(serial, None)
        if entry is not None:
            self.now.bytes[entry[2]] -= entry[1]

    def _resized(self, st: torch.UntypedStorage, before: int, after: int) -> None:
        serial = self._of.get(st)
        if serial is None:
            if after:
                self._add(st, self.made_as)
            return
        entry = self._entries[serial]
        entry[1] += after - before
        self.now.bytes[entry[2]] += after - before
        if after > before:
            self._serial += 1
            entry[3] = self._serial  # a regrown storage counts as made now (``regard``'s peak test)
            if self.now.total > self.peak.total:
                self._at_peak()
            self._host_seen()

    def _at_peak(self) -> None:
        self.peak = Breakdown(dict(self.now.bytes) | {"host": self.host_peak})
        self._peak_serial = self._serial

    def _host_seen(self) -> None:
        if self.now.bytes["host"] > self.host_peak:
            self.host_peak = self.peak.bytes["host"] = self.now.bytes["host"]
