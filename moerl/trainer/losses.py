"""Losses that ``Policy.train_step`` takes. (The RL losses of the loop live with the algorithms.)"""

from __future__ import annotations

import torch

from moerl.trainer.batch import Batch


def sft_loss(logprobs: torch.Tensor, mb: Batch, entropy: torch.Tensor | None = None):
    """Negative log-likelihood of the ``loss_mask`` tokens, averaged over every such token of the whole batch."""
    nll = -(logprobs * mb.loss_mask).sum() / mb.total_tokens
    return nll, {"nll": float(nll.detach()) * mb.total_tokens / max(1, int(mb.loss_mask.sum()))}
