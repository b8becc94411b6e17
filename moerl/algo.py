"""The algorithm's part of an RL step, on the rollouts it is given: old / reference logprobs (R3 replay), rewards
(KL-shaped where asked), advantages per group, PPO epochs over mini-batches, and the step's metrics."""

from __future__ import annotations

import time

import torch

from moerl.errors import TrainingStopped
from moerl.rollout.episode import Episode, to_batch
from moerl.run_config import RunConfig
from moerl.trainer import Batch, Policy
from moerl.trainer.advantages import compute_advantages
from moerl.trainer.losses import kl_penalty
from moerl.trainer.mismatch import mismatch_metrics


def learn(cfg: RunConfig, policy: Policy, loss_fn, episodes: list[Episode], step: int) -> dict:
    """Old / reference logprobs (R3 replay), advantages per group, PPO epochs over mini-batches: the trainer's part
    of step ``step``; returns its metrics.

    On-policy steps (one epoch, one mini-batch, no KL shaping the rewards) run no separate old-logprob forward: the
    old logprobs are the training forward's own, detached (the loss's default), and the rollout-vs-trainer mismatch
    comes from that forward. The R3-off mismatch metric costs a forward of its own: every
    ``algo.mismatch_metric_every`` steps. Logprobs are at the rollout temperature (temperature 0 as 1, as the
    engine reports them)."""
    temperature = cfg.rollout.temperature or 1.0
    # 1. a training batch with the engine's routing and logprobs
    batch = to_batch(episodes, cfg.algo.r3, cfg.algo.overlong_filter)
    t1 = time.perf_counter()
    mm_on, mm_off = _trainer_logprobs(cfg, policy, batch, step, temperature)
    rewards = _rewards(cfg, episodes, batch)
    # 2. advantages per group
    batch.extras["advantages"] = _advantages(cfg, rewards)
    # 3. PPO epochs over mini-batches
    t2 = time.perf_counter()
    train_metrics = _ppo_epochs(cfg, policy, loss_fn, batch, step, temperature)
    t3 = time.perf_counter()
    trained_tokens = int(batch.loss_mask.sum()) * cfg.algo.ppo_epochs
    row = _episode_metrics(episodes, batch, rewards) | {
        "train_tokens_per_s": trained_tokens / max(t3 - t2, 1e-9),
        "seconds_logprobs": t2 - t1,
        "seconds_train": t3 - t2,
    }
    row |= {key: sum(m[key] for m in train_metrics) / len(train_metrics) for key in train_metrics[0]}
    return row | _mismatch_row(row, mm_on, mm_off)


def _on_policy(cfg: RunConfig) -> bool:
    """One epoch, one mini-batch, no KL shaping the rewards: the training forward's own logprobs are the old ones."""
    a, loss_cfg = cfg.algo, cfg.algo.loss
    return a.ppo_epochs == 1 and a.mini_batches == 1 and not (loss_cfg.kl_coef > 0 and loss_cfg.kl_in_reward)


def _old_and_reference(
    cfg: RunConfig, policy: Policy, batch: Batch, temperature: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The old and reference logprobs a step needs before training (None where it needs none): one forward for
    both where the policy can (LoRA: the reference is adapters off)."""
    a, kl = cfg.algo, cfg.algo.loss.kl_coef > 0
    if _on_policy(cfg):
        ref = policy.forward_logprobs(batch, reference=True, temperature=temperature)[0] if kl else None
        return None, ref
    if kl:
        return policy.logprobs_with_reference(batch, a.r3, temperature)
    return policy.forward_logprobs(batch, replay=a.r3, temperature=temperature)[0], None


def _trainer_logprobs(
    cfg: RunConfig, policy: Policy, batch: Batch, step: int, temperature: float
) -> tuple[dict | None, dict | None]:
    """Old / reference logprobs into ``batch.extras`` (a non-finite one stops the run, the state saved); returns the
    rollout-vs-trainer mismatch with R3 (None on-policy: the training forward gives it) and, every
    ``algo.mismatch_metric_every`` steps, without it (else None)."""
    a = cfg.algo
    mm_on = mm_off = None
    old, ref = _old_and_reference(cfg, policy, batch, temperature)
    if old is not None:
        if not bool(torch.isfinite(old[batch.loss_mask.bool()]).all()):
            raise TrainingStopped(
                f"step {step + 1}: the trainer's logprobs of the rollouts are non-finite{policy.save_stop_checkpoint()}"
            )
        mm_on = mismatch_metrics(old, batch.extras["rollout_logprobs"], batch.loss_mask)
        batch.extras["old_logprobs"] = old
    if ref is not None:
        batch.extras["ref_logprobs"] = ref
    if a.r3 and a.mismatch_metric_every and step % a.mismatch_metric_every == 0:  # the mismatch without replay
        no_r3 = policy.forward_logprobs(batch, replay=False, temperature=temperature)[0]
        mm_off = mismatch_metrics(no_r3, batch.extras["rollout_logprobs"], batch.loss_mask)
    return mm_on, mm_off


def _rewards(cfg: RunConfig, episodes: list[Episode], batch: Batch) -> torch.Tensor:
    """The episodes' rewards, less ``kl_coef`` times each sequence's KL to the reference with ``kl_in_reward``."""
    loss_cfg = cfg.algo.loss
    rewards = torch.tensor([e.reward for e in episodes])
    if loss_cfg.kl_coef > 0 and loss_cfg.kl_in_reward:
        old, ref = batch.extras.get("old_logprobs"), batch.extras.get("ref_logprobs")
        rewards = rewards - loss_cfg.kl_coef * (kl_penalty(old, ref, loss_cfg.kl_estimator) * batch.loss_mask).sum(1)
    return rewards


def _advantages(cfg: RunConfig, rewards: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages of ``algo.advantage``, each group of ``rollout.group_size`` samples against itself."""
    grouped = rewards.view(-1, cfg.rollout.group_size)
    kwargs = {"std_normalize": cfg.algo.std_normalize} if cfg.algo.advantage == "grpo" else {}
    return compute_advantages(grouped, cfg.algo.advantage, **kwargs).reshape(-1)


def _ppo_epochs(cfg: RunConfig, policy: Policy, loss_fn, batch: Batch, step: int, temperature: float) -> list[dict]:
    """``algo.ppo_epochs`` passes over ``batch``, each shuffled (a function of the run's seed and ``step``) into
    ``algo.mini_batches`` optimizer steps; returns each step's metrics."""
    a = cfg.algo
    train_metrics: list[dict] = []
    gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
    for _ in range(a.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen)
        for idx in order.chunk(a.mini_batches):
            mb = _mini_batch(batch, idx)
            step = policy.train_step(mb, loss_fn, replay=a.r3, entropy=a.loss.entropy, temperature=temperature)
            train_metrics.append(step)
    return train_metrics


def _mini_batch(batch: Batch, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` of ``batch`` as a batch of their own: its totals are the mini-batch's (one optimizer step)."""
    return Batch(
        batch.input_ids[idx],
        batch.attention_mask[idx],
        batch.loss_mask[idx],
        None if batch.replay is None else batch.replay[idx],
        {k: v[idx] for k, v in batch.extras.items()},
    )


def _episode_metrics(episodes: list[Episode], batch: Batch, rewards: torch.Tensor) -> dict:
    """What the step's episodes scored: rewards (KL-shaped ones included), accuracy, lengths, reward failures."""
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": sum(e.reward >= 1.0 for e in episodes) / len(episodes),
        "response_length": float(batch.loss_mask.sum(1).float().mean()),
        "reward_errors": float(sum(e.reward_error == "error" for e in episodes)),
        "reward_timeouts": float(sum(e.reward_error == "timeout" for e in episodes)),
    }


def _mismatch_row(row: dict, mm_on: dict | None, mm_off: dict | None) -> dict:
    """The rollout-vs-trainer mismatch with R3 (on-policy: the training forward's own, in ``row``; exact with one
    micro-batch, else the rows-weighted mean of the micro-batches' token means) and without it, when measured."""
    if mm_on is None:
        mm_on = {"k3": row["mismatch_k3"], "frac_large_diff": row["mismatch_frac_large_diff"]}
    out = {"mismatch_k3_r3": mm_on["k3"], "mismatch_frac_r3": mm_on["frac_large_diff"]}
    if mm_off is not None:
        out |= {"mismatch_k3_no_r3": mm_off["k3"], "mismatch_frac_no_r3": mm_off["frac_large_diff"]}
    return out
