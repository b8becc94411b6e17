"""Advantage estimators over groups of samples of one prompt, and DAPO's batch filters.

Rewards come as a float tensor [num_groups, group_size] (row g: the samples of prompt g); every estimator returns
advantages of the same shape, one per sequence. Standard deviations are population ones (``correction=0``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moerl.errors import ConfigError


def _check(rewards: torch.Tensor, what: str) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ConfigError(f"{what}: rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    return rewards if rewards.is_floating_point() else rewards.float()


def grpo(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``A = r - mean_group(r)``, divided by ``std_group(r) + eps`` when ``std_normalize`` (population std
    of the group; Dr. GRPO is ``std_normalize=False``). A group whose rewards are all equal gets 0."""
    rewards = _check(rewards, "grpo")
    adv = rewards - rewards.mean(1, keepdim=True)
    if std_normalize:
        adv = adv / (rewards.std(1, keepdim=True, correction=0) + eps)
    return adv


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j`` (the baseline of each sample is the mean of the other samples of its
    group), which equals ``n / (n - 1) * (r_i - mean_group(r))``. Needs ``group_size >= 2``."""
    rewards = _check(rewards, "rloo")
    n = rewards.shape[1]
    if n < 2:
        raise ConfigError(f"rloo: group_size={n}: the leave-one-out baseline needs at least 2 samples per prompt")
    return rewards - (rewards.sum(1, keepdim=True) - rewards) / (n - 1)


def reinforce_pp(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++: ``A = (r - mean_batch(r)) / (std_batch(r) + eps)``, mean and population std over the WHOLE
    batch (every group together), not per group; groups only fix the shape."""
    rewards = _check(rewards, "reinforce_pp")
    return (rewards - rewards.mean()) / (rewards.std(correction=0) + eps)


ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {"grpo": grpo, "rloo": rloo, "reinforce_pp": reinforce_pp}


def compute_advantages(rewards: torch.Tensor, method: str = "grpo", **kwargs) -> torch.Tensor:
    """Advantages [num_groups, group_size] by estimator name (grpo | rloo | reinforce_pp); ``kwargs`` go to it."""
    if method not in ESTIMATORS:
        raise ConfigError(f"advantage method={method!r}: allowed: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[method](rewards, **kwargs)


def dynamic_sampling_keep(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: bool [num_groups], True for groups whose rewards are not all equal (an all-equal group
    has zero advantage under group baselines and adds no gradient)."""
    rewards = _check(rewards, "dynamic_sampling_keep")
    return (rewards != rewards[:, :1]).any(1)


CUT = ("length", "context")  # the finish reasons of a completion the engine cut: at max_tokens, at the context window


def overlong_mask(finish_reasons: Sequence[str]) -> torch.Tensor:
    """DAPO overlong filtering: float32 [N], 0 for sequences the engine cut (``finish_reason`` "length": at
    max_tokens, or "context": at the context window), 1 otherwise. Multiply it into the loss mask (or the
    advantages)."""
    return torch.tensor([0.0 if r in CUT else 1.0 for r in finish_reasons], dtype=torch.float32)
