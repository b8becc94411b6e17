"""What a run says on the console (stderr): a bar on a terminal with lines above it, one line per step on a file or
pipe; evaluations in words; why steps learn nothing; the command that resumes a stopped run."""

from __future__ import annotations

import math
import shlex
import sys
import time
from functools import partial
from pathlib import Path

from tqdm import tqdm


class Console:
    """The console of steps ``start`` .. ``total - 1``: ``steps()`` iterates them (under a bar on a terminal)."""

    def __init__(self, start: int, total: int):
        self.start, self.total, self.t0 = start, total, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(range(start, total), desc="rl", unit="step", disable=not self.tty)

    def steps(self):
        return iter(self.bar)

    def say(self, *lines: str | None) -> None:
        """Each line that is not None."""
        for line in lines:
            if line is not None:
                say(line, self.bar if self.tty else None)

    def final_evaluation(self) -> None:
        """What the last step's extra seconds are."""
        self.bar.set_description("rl (final evaluation)")
        if not self.tty:
            say("moerl: final evaluation on the held-out problems")

    def step_done(self, step: int, row: dict) -> None:
        """Step ``step``'s results: the bar's figures (and an evaluation it ran), or a line of its own."""
        if self.tty and "eval_accuracy" in row:  # a file or pipe has it in the step's line
            say_evaluation(step + 1, row, self.bar)
        if "reward_mean" in row:
            self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", mismatch=f"{row['mismatch_k3_r3']:.1e}")
        if not self.tty:
            per_step = (time.perf_counter() - self.t0) / (step + 1 - self.start)
            say(progress_line(step + 1, self.total, row, per_step))


class FlatRewards:
    """Steps in a row without a group whose rewards differ; at ``FLAT_STEPS`` the run is told why it learns
    nothing (``after`` returns the warning)."""

    def __init__(self):
        self.streak = 0

    def after(self, step: int, row: dict) -> str | None:
        self.streak = self.streak + 1 if row["informative_groups"] == 0 else 0
        return flat_warning(step + 1, row["reward_generated"]) if self.streak == FLAT_STEPS else None


def resume_command() -> str:
    """This process's ``moerl`` command line with ``--resume`` (and without ``--overwrite``)."""
    args = [a for a in sys.argv[1:] if a not in ("--overwrite", "--resume")]
    return shlex.join(["moerl", *args, "--resume"])


def progress_line(step: int, total: int, row: dict, seconds_per_step: float) -> str:
    """One line for a step when the output is not a terminal: step / total, reward, held-out accuracy when it was
    evaluated, s/step and the time left (names a newcomer reads; the metrics file keeps the jargon ones)."""
    parts = [f"step {step}/{total}"]
    if "reward_mean" in row:
        parts.append(f"reward {row['reward_mean']:.3f}")
    elif row.get("skipped"):
        parts.append("skipped (every group had equal rewards: nothing to learn from)")
    if "eval_accuracy" in row:
        parts.append(f"held-out accuracy {held_out_text(row)}")
    if "mismatch_k3_r3" in row:
        parts.append(f"engine/trainer mismatch {row['mismatch_k3_r3']:.1e}")
    left = (total - step) * seconds_per_step
    parts.append(f"{seconds_per_step:.2f} s/step, {int(left // 60)}m{int(left % 60):02d}s left")
    return "moerl: " + " | ".join(parts)


def held_out_text(row: dict, prefix: str = "eval_accuracy") -> str:
    """``47.0% (95% CI 40.2-53.9%, 200 problems)``: an evaluation's accuracy with its interval and size."""
    acc, low, high = row.get(prefix), row.get(f"{prefix}_low"), row.get(f"{prefix}_high")
    if acc is None or (isinstance(acc, float) and math.isnan(acc)):
        return "n/a (env.eval_problems: 0)"
    if low is None or high is None:
        return f"{acc:.1%}"
    return f"{acc:.1%} (95% CI {low:.1%}-{high:.1%}, {row.get('eval_problems')} problems)"


def say(line: str, bar=None) -> None:
    """A line on the console (stderr; above the bar on a terminal)."""
    (bar.write if bar is not None else partial(print, flush=True))(line, file=sys.stderr)


def exported_line(exported: dict[str, str], checkpoint: Path, asked: bool) -> str:
    """What the run wrote for the user, in words: a PEFT adapter, or merged weights and why, or where the trained
    weights are when nothing else was written."""
    if "adapter" in exported:
        return f"moerl: wrote the trained LoRA adapter (PEFT: peft loads it onto the base) to {exported['adapter']}"
    if "merged" in exported:
        return (
            f"moerl: wrote merged weights (the base with the adapters added in: a whole checkpoint, not a PEFT "
            f"adapter) to {exported['merged']}; PEFT cannot hold these adapters: {exported['adapter_note']}"
        )
    why = "train.export_adapter is false" if not asked else "this mode writes no separate export"
    return f"moerl: the trained weights are in the run's checkpoint {checkpoint} ({why})"


def say_evaluation(step: int, row: dict, bar=None) -> None:
    """An evaluation on the console in words."""
    when = "before training" if step == 0 else f"after step {step}"
    say(f"moerl: held-out accuracy {when}: {held_out_text(row)}", bar)


FLAT_STEPS = 3  # this many steps in a row without a group whose rewards differ: the run is told why it learns nothing


def flat_warning(step: int, reward: float) -> str:
    """Why steps ``step - FLAT_STEPS + 1 .. step`` (1-based) learned nothing, and what to change."""
    if reward >= 1.0:
        why, fix = "every sample was right (the task is too easy for the model)", "make the task harder"
    elif reward <= 0.0:
        why = "every sample was wrong (the model solves none of these problems)"
        fix = "start from a model that solves some (model.sft_steps warms the random preset up, or model.path=DIR)"
    else:
        why, fix = f"each group's samples scored alike (mean reward {reward:.3f})", "raise rollout.temperature"
    return (
        f"moerl: warning: steps {step - FLAT_STEPS + 1}-{step} learned nothing: within every group of "
        f"samples the rewards were equal, so no sample was better than its group's baseline; {why}. To fix: {fix}, "
        "or raise rollout.group_size."
    )
