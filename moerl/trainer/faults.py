"""What goes wrong in a training step, named: a rank out of memory (which rank and part of the step, the batch's
size, what to lower), a non-finite loss or gradient (the step skipped; a streak stops), a non-finite weight after
the optimizer step (stop; never saved or synced). ``policy``: a Policy."""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch

from moerl.errors import OutOfMemory, TrainingStopped
from moerl.trainer.batch import Batch


@contextmanager
def memory_named(policy, stage: str, batch: Batch, before_step: bool = False):
    """Out of memory inside: raise ``OutOfMemory`` naming ``policy``'s rank, ``stage`` and ``batch``'s size, and what
    to lower. ``before_step``: the weights are still those before the step; one process saves them (several ranks
    cannot: the others are inside the step's collectives, and the launcher stops them)."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        traceback.clear_frames(e.__traceback__)  # the failed step's tensors, held by its frames' locals
        for p in [*policy.trained.values(), *policy.trainable.values()]:
            p.grad = None
        w = policy.layout.world
        where = f"trainer rank {w.rank} of {w.size}" if w.size > 1 else "the trainer"
        if w.size > 1:
            where += f" (pipeline rank {w.stage}, expert slice {w.ep_rank}, data-parallel rank {w.dp_rank})"
        rows, cols = batch.input_ids.shape
        mb, budget = policy.cfg.micro_batch_size, policy.cfg.token_budget
        cut = " and ".join(
            [f"{mb} rows"] * bool(mb) + [f"{budget} tokens (policy.max_tokens_per_micro_batch)"] * bool(budget)
        )
        saved = ""
        if before_step and w.size == 1:
            saved = policy.save_stop_checkpoint()
        elif policy.stop_checkpoint_dir is not None:  # the others are inside the step: no save; the last is kept
            kept = policy.stop_checkpoint_dir if policy.stop_checkpoint_dir.exists() else "none yet"
            saved = f"; nothing saved (last good checkpoint: {kept})"
        raise OutOfMemory(
            f"{where} ran out of memory in the {stage} of a batch of {rows} rows x {cols} tokens "
            f"({int(batch.attention_mask.bool().sum())} real), micro-batches of at most {cut} ({_first_line(e)}); "
            f"lower {'policy.max_tokens_per_micro_batch' if budget else 'policy.micro_batch_size'} (now "
            f"{budget or mb}) or the lengths (rollout.max_tokens, rollout.max_model_len){saved}"
        ) from None


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says an allocation failed: CUDA's OutOfMemoryError, a CPU allocator's refusal, Python's."""
    text = str(e)
    return (
        isinstance(e, torch.OutOfMemoryError | MemoryError)
        or "can't allocate memory" in text
        or ("out of memory" in text.lower())
    )


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def skip_nonfinite(policy, done: dict[str, float]) -> None:
    """A non-finite loss or gradient: drop the gradients; stop after ``policy.max_nan_steps`` in a row."""
    policy.nan_skipped += 1
    policy.nan_streak += 1
    for p in policy.trained.values():
        p.grad = None
    if policy.nan_streak >= policy.cfg.max_nan_steps:
        raise TrainingStopped(
            f"{policy.nan_streak} consecutive steps had a non-finite loss or gradient (loss {done['loss']}, "
            f"grad norm {done['grad_norm']}) at step {policy.step}{policy.save_stop_checkpoint()}"
        )


def check_weights(policy, done: dict[str, float]) -> None:
    """After the optimizer step: a non-finite weight cannot be undone: stop, and never save or sync it."""
    bad = policy.nonfinite_weight()
    if bad is None:
        return
    where = ""
    if policy.stop_checkpoint_dir is not None:
        kept = policy.stop_checkpoint_dir if policy.stop_checkpoint_dir.exists() else "none yet"
        where = f"; nothing saved (last good checkpoint: {kept})"
    raise TrainingStopped(
        f"optimizer step {policy.step + 1} made weight {bad!r} non-finite (loss {done['loss']}, grad norm "
        f"{done['grad_norm']}, lr {done['lr']}){where}"
    )
