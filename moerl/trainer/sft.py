"""Supervised warm-up: (prompt, target) text pairs -> batches whose loss covers the target and EOS."""

from __future__ import annotations

import random

import torch

from moerl.trainer.batch import Batch
from moerl.trainer.losses import sft_loss


def sft_batch(tokenizer, examples: list[tuple[str, str]]) -> Batch:
    """Right-padded rows ``prompt + target + EOS``; the loss covers the target and the EOS token."""
    rows, masks = [], []
    for prompt, target in examples:
        p = tokenizer(prompt)["input_ids"]
        t = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + t)
        masks.append([0] * len(p) + [1] * len(t))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return Batch(ids, attn, loss)


def run_sft(
    policy,
    tokenizer,
    examples: list[tuple[str, str]],
    steps: int,
    batch_size: int,
    seed: int = 0,
    log=None,
    each_step=None,
) -> list[float]:
    """``steps`` optimizer steps on random batches of ``examples``; returns the losses. ``each_step()`` runs before
    every step (the warm-up's thread check)."""
    rng = random.Random(seed)
    losses = []
    for step in range(steps):
        if each_step is not None:
            each_step()
        batch = sft_batch(tokenizer, rng.sample(examples, min(batch_size, len(examples))))
        losses.append(policy.train_step(batch, sft_loss, replay=False)["loss"])
        if log is not None and (step + 1) % max(1, steps // 10) == 0:
            log(f"[sft] step {step + 1}/{steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    return losses
