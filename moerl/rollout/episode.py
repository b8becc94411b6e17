"""One scored trajectory (an Episode), the group-level filters a step applies to them, and the training batch they
become."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.errors import TrainingStopped
from moerl.trainer import Batch
from moerl.trainer.advantages import CUT, dynamic_sampling_keep


@dataclass(slots=True)
class Episode:
    """One sampled sequence, scored: single-turn (prompt + completion) or multi-turn (prompt + the model's turns with
    the environment's answers between them, which are not trained on)."""

    group: int  # the samples of one problem share a group (the advantage baseline)
    tokens: list[int]  # prompt + everything after it
    num_prompt: int
    loss_mask: list[int]  # over tokens: 1 on the model's own tokens
    rollout_logprobs: list[float]  # over tokens: the engine's sampled-token logprobs (0 off the mask)
    routed: torch.Tensor | None  # [len(tokens) - 1, L_moe, k]: the engine's experts per token (R3), None: route
    reward: float
    finish_reason: str  # stop | length | context (the context window) | error
    reward_error: str | None  # error | timeout: the reward (or an environment step) failed and scored 0
    version: int = 0  # the oldest weight version any of its tokens was generated under

    @classmethod
    def failed(cls, group: int, error: str | None) -> Episode:
        """A sample the engine failed while running (its group is dropped from training; evaluation counts it 0)."""
        return cls(group, [], 0, [], [], None, 0.0, "error", error)


def groups(episodes: list[Episode]) -> dict[int, list[Episode]]:
    """The episodes by group, in order of first appearance."""
    out: dict[int, list[Episode]] = {}
    for e in episodes:
        out.setdefault(e.group, []).append(e)
    return out


def drop_failed_groups(episodes: list[Episode], step: int) -> tuple[list[Episode], int]:
    """The episodes without the groups the engine failed (finish reason ``error``) and how many groups those were;
    TrainingStopped when it failed them all (the engine cannot serve this policy)."""
    failed = {e.group for e in episodes if e.finish_reason == "error"}
    if failed and len(failed) == len({e.group for e in episodes}):
        first = next(e.reward_error for e in episodes if e.finish_reason == "error")
        raise TrainingStopped(f"step {step + 1}: the engine failed every request ({len(failed)}); first: {first}")
    return [e for e in episodes if e.group not in failed], len(failed)


def keep_informative(episodes: list[Episode]) -> tuple[list[Episode], int]:
    """DAPO dynamic sampling: drop groups whose rewards are all equal; returns the rest and how many groups went."""
    by_group = groups(episodes)
    if not by_group:
        return [], 0
    keep = dynamic_sampling_keep(torch.tensor([[e.reward for e in g] for g in by_group.values()]))
    kept = [e for k, g in zip(keep.tolist(), by_group.values(), strict=True) if k for e in g]
    return kept, int((~keep).sum())


def drop_stale(episodes: list[Episode], version: int, max_staleness: int) -> tuple[list[Episode], int]:
    """Asynchronous RL's bound: the groups none of whose samples is more than ``max_staleness`` weight versions
    behind ``version`` (the trainer's), and how many samples were dropped (a group goes whole: its baseline needs
    every sample)."""
    old = {e.group for e in episodes if version - e.version > max_staleness}
    kept = [e for e in episodes if e.group not in old]
    return kept, len(episodes) - len(kept)


def to_batch(episodes: list[Episode], r3: bool, overlong_filter: bool) -> Batch:
    """Right-padded rows with the loss mask, the engine's logprobs and (``r3``) its routing per token; with
    ``overlong_filter`` a sequence cut by max_tokens does not enter the loss."""
    t = max(len(e.tokens) for e in episodes)
    b = len(episodes)
    lengths = [len(e.tokens) for e in episodes]
    pads = [t - n for n in lengths]
    # each field as one tensor from padded lists (a copy a field, not a handful of ops a sequence)
    ids = torch.tensor([e.tokens + [0] * p for e, p in zip(episodes, pads, strict=True)])
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()
    kept = [not (overlong_filter and e.finish_reason in CUT) for e in episodes]
    loss_mask = torch.tensor(
        [e.loss_mask + [0] * p if k else [0] * t for e, p, k in zip(episodes, pads, kept, strict=True)]
    )
    rollout_lp = torch.tensor([e.rollout_logprobs + [0.0] * p for e, p in zip(episodes, pads, strict=True)])
    replay = None
    shape = next((e.routed.shape[1:] for e in episodes if e.routed is not None), None)
    if r3 and shape is not None:
        # int16 as the engines record it (expert indices < 2**15): a quarter of int64's bytes in every rank's batch;
        # -1: route yourself (padding)
        replay = torch.full((b, t - 1, *shape), -1, dtype=torch.int16)
        for i, e in enumerate(episodes):
            if e.routed is None:
                continue
            if e.routed.shape[0] != lengths[i] - 1:
                raise ValueError(f"episode {i}: routing for {e.routed.shape[0]} tokens, {lengths[i] - 1} expected")
            replay[i, : lengths[i] - 1] = e.routed  # one copy a sequence, cast in place
    return Batch(
        ids,
        mask,
        loss_mask,
        replay,
        {"rollout_logprobs": rollout_lp},
        total_tokens=max(1, int(loss_mask.sum())),
        total_seqs=max(1, int((loss_mask.sum(1) > 0).sum())),
    )
