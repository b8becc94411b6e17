"""Sequence packing for the trainer's forwards: the right-padded rows of a micro-batch laid end to end in fewer,
fuller rows, so the GEMMs (nearly all of a step's work) run on few padding tokens.

A packed row holds several sequences; the model sees each token's own position and a segment number per token (the
sequence's number in its row, 0 = padding) as ``attention_mask``, so a token attends only within its sequence.
Results come back in the batch's [B, T] layout: losses and metrics never see the packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# packed rows are at most this long unless a sequence is longer: attention costs grow with the row length
MAX_ROW = 1024


@dataclass(slots=True)
class Packing:
    """Where each token of a [B, T] micro-batch sits in the packed [R, L] rows.

    ``src`` [R, L]: the flat index (b * T + t) of the token at each packed place, B * T at padding places.
    ``dst`` [B * T]: the flat packed place (r * L + l) of each token, R * L for the batch's own padding.
    ``segment`` [R, L]: 1, 2, ... per sequence within its row, 0 at padding. ``positions`` [R, L]: the token's
    position within its sequence.
    """

    src: torch.Tensor
    dst: torch.Tensor
    segment: torch.Tensor
    positions: torch.Tensor

    def pack(self, x: torch.Tensor, fill) -> torch.Tensor:
        """x [B, T, ...] -> [R, L, ...], ``fill`` at padding places."""
        flat = x.flatten(0, 1)
        flat = torch.cat([flat, flat.new_full((1, *flat.shape[1:]), fill)])
        return flat[self.src]

    def unpack(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """x [R, L] -> [B, T] = ``shape``: each token's value, 0 at the batch's padding (differentiable)."""
        return F.pad(x.flatten(), (0, 1))[self.dst].view(shape)


def _first_fit(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices per row: longest first, each into the first row with room (first-fit decreasing)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def plan_packing(attention_mask: torch.Tensor) -> Packing | None:
    """The packing of right-padded rows ``attention_mask`` [B, T] with the fewest padded tokens (row length T, 2T or
    4T, up to ``MAX_ROW``); None when it saves nothing or the rows are not right-padded."""
    device, attention_mask = attention_mask.device, attention_mask.cpu()  # planned on the host: one copy
    b, t = attention_mask.shape
    lengths = attention_mask.sum(1)
    if not bool((attention_mask.bool() == (torch.arange(t) < lengths[:, None])).all()):
        return None  # a mask with holes or left padding: not ours to rearrange
    lens = lengths.tolist()
    best = None
    for width in (t, 2 * t, 4 * t):
        if width > max(t, MAX_ROW):
            break
        rows = _first_fit(lens, width)
        if best is None or len(rows) * width < len(best[0]) * best[1]:
            best = rows, width
    rows, width = best
    if len(rows) * width >= b * t:
        return None
    # the places as flat lists, then one tensor each (not four slice writes a sequence)
    src, segment, positions = [b * t] * (len(rows) * width), [0] * (len(rows) * width), [0] * (len(rows) * width)
    dst = [len(rows) * width] * (b * t)
    for r, seqs in enumerate(rows):
        at = r * width
        for s, i in enumerate(seqs, start=1):
            n = lens[i]
            src[at : at + n] = range(i * t, i * t + n)
            dst[i * t : i * t + n] = range(at, at + n)
            segment[at : at + n] = [s] * n
            positions[at : at + n] = range(n)
            at += n
    src, segment, positions = (torch.tensor(x).view(len(rows), width) for x in (src, segment, positions))
    dst = torch.tensor(dst)
    return Packing(src.to(device), dst.to(device), segment.to(device), positions.to(device))
