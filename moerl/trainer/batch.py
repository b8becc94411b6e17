"""A training batch: right-padded token rows, which tokens count, recorded routing, per-token RL fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from moerl.device import to_device


@dataclass(slots=True)
class Batch:
    """``input_ids`` / ``attention_mask`` [B, T] (1 = real token). ``loss_mask`` [B, T]: 1 where the token's
    logprob enters the loss (the response tokens). ``replay`` [B, T or T-1, L_moe, k]: the experts the engine
    routed each token to (R3). ``extras``: per-token [B, T] or per-sequence [B] tensors the loss reads
    (advantages, old / reference / rollout logprobs, ...). ``total_tokens`` / ``total_seqs``: counts over the whole
    batch, kept by ``split`` so micro-batch losses can be normalised globally."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    replay: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    total_tokens: int = 0
    total_seqs: int = 0
    # each row's tokens, read where the rows are made (on the host): a micro-batch's token budget is cut from them
    # without reading the device (None: read from attention_mask when asked)
    lengths: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.total_tokens:
            self.total_tokens = int(self.loss_mask.sum())
        if not self.total_seqs:
            self.total_seqs = int((self.loss_mask.sum(1) > 0).sum())
        if self.lengths is None and self.attention_mask.device.type == "cpu":
            self.lengths = self.attention_mask.sum(1).tolist()

    def row_lengths(self) -> list[int]:
        """Each row's tokens (from the host where known)."""
        return self.lengths if self.lengths is not None else self.attention_mask.sum(1).tolist()

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx: slice | torch.Tensor) -> Batch:
        """A sub-batch of rows; totals stay those of the whole batch."""
        pick = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("extras", "total_tokens", "total_seqs", "lengths")
        }
        pick = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in pick.items()}
        lengths = self.lengths[idx] if isinstance(idx, slice) and self.lengths is not None else None
        return replace(self, **pick, extras={k: v[idx] for k, v in self.extras.items()}, lengths=lengths)

    def to(self, device: torch.device) -> Batch:
        """This batch with every tensor on ``device`` (the batch itself when they are there already)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        names = ["input_ids", "attention_mask", "loss_mask"] + ["replay"] * (self.replay is not None)
        tensors = [getattr(self, n) for n in names] + list(self.extras.values())
        if device.type == "cuda" and all(t.device.type == "cpu" for t in tensors):  # one pinned copy, not five
            moved = to_device(tensors, device)
        else:
            moved = [t.to(device) for t in tensors]
        named = dict(zip(names, moved, strict=False))
        return replace(self, **named, extras=dict(zip(self.extras, moved[len(names) :], strict=True)))

    def split(self, micro_batch_size: int) -> list[Batch]:
        return [self.rows(slice(i, i + micro_batch_size)) for i in range(0, len(self), micro_batch_size)]
