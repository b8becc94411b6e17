"""Row-range parts of a tensor in a weight sync. A sharded trainer sends a weight it splits over ranks along the first
dim (FSDP's shards, an MoE layer's expert slices) as parts of at most a bucket's bytes, one rank's rows after
another's, instead of gathering the whole tensor on one rank first: a part is ``name@first_row``. An engine stages
the parts and, at commit, checks that they cover the tensor's rows once each before it applies anything.
"""

from __future__ import annotations

import torch

from moerl.errors import CheckpointError

SEP = "@"


def part_name(name: str, start: int) -> str:
    """The sync's key for the rows of tensor ``name`` from row ``start`` on."""
    return f"{name}{SEP}{start}"


def split_part(key: str) -> tuple[str, int | None]:
    """``(name, first row)`` of a part's key; ``(key, None)`` for a whole tensor."""
    name, sep, start = key.rpartition(SEP)
    if not sep or not start.isdigit():
        return key, None
    return name, int(start)


class StagedParts:
    """The parts an engine has staged of each tensor, checked against the tensor's shape as they arrive and for
    whole, single coverage of its rows before a commit applies any of them."""

    def __init__(self):
        self.parts: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def add(self, name: str, start: int, t: torch.Tensor, whole: torch.Size) -> None:
        """Hold rows ``start ..`` of tensor ``name`` (``whole``: its shape in the engine)."""
        if t.ndim != len(whole) or tuple(t.shape[1:]) != tuple(whole[1:]) or start + t.shape[0] > whole[0]:
            raise CheckpointError(
                f"update_weights: part {part_name(name, start)!r} has shape {tuple(t.shape)}: rows {start}.."
                f"{start + (t.shape[0] if t.ndim else 0)} of a tensor the model holds as {tuple(whole)}"
            )
        self.parts.setdefault(name, []).append((start, t))

    def check(self, shapes: dict[str, torch.Size]) -> None:
        """Raise, naming the tensor and the rows, unless every staged tensor's parts cover its rows exactly once."""
        for name, parts in self.parts.items():
            row = 0
            for start, t in sorted(parts, key=lambda p: p[0]):
                if start != row:
                    what = f"rows {row}..{start} missing" if start > row else f"rows {start}..{row} sent twice"
                    raise CheckpointError(f"update_weights: tensor {name!r}: {what}; nothing applied")
                row = start + t.shape[0]
            if row != shapes[name][0]:
                raise CheckpointError(
                    f"update_weights: tensor {name!r}: rows {row}..{shapes[name][0]} missing; nothing applied"
                )

    def apply(self, params: dict[str, torch.Tensor]) -> None:
        """Copy every part into its rows of ``params`` (after ``check``)."""
        for name, parts in self.parts.items():
            for start, t in parts:
                params[name][start : start + t.shape[0]].copy_(t)

    def clear(self) -> None:
        self.parts = {}
