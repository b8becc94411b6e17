"""What the loop does around its steps: held-out evaluations, checkpoints (on a cadence, at a scheduler's signal, at
Ctrl-C), compiling where the first steps' timings say it pays, and the run's results at its end."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from moerl.console import exported_line, resume_command, say
from moerl.engine.compiled import STEP, decode_price
from moerl.engine.compiled import pays as pays_decode
from moerl.errors import Preempted
from moerl.metrics import plot_run, read_metrics
from moerl.preempt import Preemption
from moerl.run_config import RunConfig
from moerl.rundir import CHECKPOINT
from moerl.trainer import Policy
from moerl.trainer.checkpoint import recover_checkpoint, save_checkpoint
from moerl.trainer.compile import AutoCompile


class Evaluations:
    """Held-out accuracy: greedy and sampled before training and after the last step, greedy every
    ``train.eval_every`` steps (``gen``: the run's Generator)."""

    def __init__(self, gen, every: int, total: int):
        self.gen, self.every, self.total = gen, every, total

    def first(self) -> dict:
        return self.gen.evaluate().metrics() | self.gen.evaluate(sampled=True).metrics("eval_accuracy_sampled")

    def after(self, step: int) -> dict:
        """The evaluations due after step ``step`` (none: {})."""
        last = step + 1 == self.total
        row = {}
        if last or (self.every and (step + 1) % self.every == 0):
            row |= self.gen.evaluate().metrics()
        if last:
            row |= self.gen.evaluate(sampled=True).metrics("eval_accuracy_sampled")
        return row


class Saves:
    """The run's checkpoint in ``directory``: after the last step, every ``train.checkpoint_every`` steps, and at a
    scheduler's signal (then the run stops: Preempted); at Ctrl-C, the last complete step (one process; the loop's
    ``CtrlC`` lets no step stop half-trained)."""

    def __init__(self, policy: Policy, directory: Path, every: int, total: int, preempt: Preemption):
        self.policy, self.directory, self.every, self.total, self.preempt = policy, directory, every, total, preempt

    def after(self, step: int) -> None:
        last, signal_name = step + 1 == self.total, self.preempt.signal_name
        if last or (self.every and (step + 1) % self.every == 0) or signal_name:
            save_checkpoint(self.directory, self.policy, state={"step": step + 1})
        if signal_name and not last:  # a scheduler's signal: saved, stop (the last step just ends)
            self.preempt.saved()
            raise Preempted(
                f"{signal_name} after step {step + 1} of {self.total}; its state is saved in {self.directory}. "
                f"Continue with: {resume_command()}"
            )

    def interrupted(self, cut: int | None = None) -> None:
        """Ctrl-C: save the last complete step (a second Ctrl-C stops the save and keeps the last checkpoint). Not
        where a second Ctrl-C ``cut`` step ``cut`` (1-based) after its training began (the state is no complete
        step's), nor in a run on several ranks (each rank would need the others)."""
        if self.policy.layout.ranks > 1:
            return
        if cut is not None:
            print(f"moerl: stopped by a second Ctrl-C before step {cut} was complete: nothing of it is saved; "
                  f"{self._kept()}", file=sys.stderr, flush=True)  # fmt: skip
            return
        print(f"moerl: interrupted after step {self.policy.stop_state['step']}; saving it (Ctrl-C again: stop the "
              "save, keep the last checkpoint)", file=sys.stderr, flush=True)  # fmt: skip
        try:
            saved = self.policy.save_stop_checkpoint().removeprefix("; ")
        except KeyboardInterrupt:  # the save writes aside and renames: the last complete one is intact
            print(f"moerl: save stopped by a second Ctrl-C; {self._kept()}", file=sys.stderr, flush=True)
            raise
        print(f"moerl: {saved}; continue with --resume", file=sys.stderr, flush=True)

    def _kept(self) -> str:
        """What a stop without a save leaves (an interrupted save's complete checkpoint put back in place)."""
        found, _ = recover_checkpoint(self.directory)
        return f"the last checkpoint ({self.directory}) is kept" if found else "there is no earlier checkpoint"


class AutoTune:
    """``policy.compile`` and ``rollout.compile_decode`` set to auto: compile where the first steps' timings say it
    pays, and keep it only where the compiled steps then run faster. Not where reruns must be bit for bit
    (``train.deterministic``); the decode only in synchronous runs of the native engine (asynchronous ones generate
    while the loop decides).

    The decode: the engines' decode seconds and tokens are read after the first three steps of the run (or of its
    resumption); the second and third steps' decoding (warm, their evaluations included) prices the compilation
    (``moerl.engine.compiled.pays``); the fourth step compiles in its first decode, and the fifth and sixth are
    timed: the compiled step stays only if its best tokens per second beats the eager steps' best (the padded
    batch and the graph's own call can cost more than they save, e.g. an fp32 CPU engine decoding through its packed
    kernels), else the engines go back to eager."""

    def __init__(self, cfg: RunConfig, engine, start: int, asynchronous: bool):
        r, exact = cfg.rollout, cfg.train.deterministic
        self.engine, self.start, self.total = engine, start, cfg.train.steps
        self.training = None if exact else AutoCompile(cfg.train.steps)
        auto = r.compile_decode == "auto" and r.engine == "native" and not asynchronous and not exact
        self.decoding: list[tuple[float, int]] | None = [] if auto else None  # (seconds, tokens) after each step
        self.trying = False  # compiled, not decided yet

    def after(self, policy: Policy, step: int, row: dict) -> list[str | None]:
        """Act on step ``step``'s ``row``; returns what to tell the user."""
        said = [self.training.after(policy, step, row) if self.training is not None else None]
        k = step - self.start
        if self.decoding is None or k not in (1, 2, 3, 4, 5, 6) or (k > 3 and not self.trying):
            return said
        self.decoding.append((self.engine.decode_seconds(), self.engine.decode_tokens()))
        if k == 3:
            eager = [self._delta(1), self._delta(2)]
            said.append(self._decode(self.total - step - 1, sum(s for s, _ in eager) / 2))
        if k == 6:
            said.append(self._decided())
        return said

    def _delta(self, i: int) -> tuple[float, int]:
        """Seconds and tokens decoded between reading ``i - 1`` and reading ``i``."""
        (s0, n0), (s1, n1) = self.decoding[i - 1], self.decoding[i]
        return s1 - s0, n1 - n0

    def _rate(self, *readings: int) -> float:
        """The best tokens per second of the steps ending at ``readings``."""
        return max((n / s if s > 0 else 0.0) for s, n in map(self._delta, readings))

    def _decode(self, steps_left: int, decode_seconds: float) -> str | None:
        cost, priced = decode_price(self.engine.decode_compile_seconds())
        if not (pays_decode(steps_left, decode_seconds, cost) and self.engine.compile_decode()):
            return None
        self.trying = True
        return (
            f"moerl: compiling {STEP} (rollout.compile_decode: auto; {steps_left} steps left at "
            f"{decode_seconds:.2f} s of decoding each repay {priced})"
        )

    def _decided(self) -> str:
        """Keep the compiled step or go back to eager, by the trial's tokens per second (readings 4 and 5: the steps
        after the one that compiled)."""
        self.trying = False
        ratio = self._rate(4, 5) / max(self._rate(1, 2), 1e-9)
        if ratio > 1.0:
            return f"moerl: {STEP}, compiled, decodes {ratio:.2f}x as fast as eager: kept"
        self.engine.compile_decode(False)
        return f"moerl: {STEP}, compiled, decoded {ratio:.2f}x as fast as eager: back to eager"


def results(cfg: RunConfig, run_dir: Path, policy: Policy, plot: bool = True) -> dict:
    """The run's summary (held-out accuracy before / after, with intervals) and what it made: the mode's export
    (``train.export_adapter``) and, with ``plot``, the picture of its curves."""
    rows = read_metrics(run_dir)
    summary = {"eval_problems": rows[-1].get("eval_problems", 0)}  # distinct held-out problems, never trained on
    for when, row in (("before", rows[0]), ("after", rows[-1])):
        for key in ("", "_low", "_high"):  # the greedy accuracy and its 95% interval
            summary[f"accuracy_{when}{key}"] = row.get(f"eval_accuracy{key}", math.nan)
        summary[f"accuracy_sampled_{when}"] = row.get("eval_accuracy_sampled", math.nan)
    exported = policy.mode.export(policy, run_dir) if cfg.train.export_adapter else {}
    say(exported_line(exported, run_dir / CHECKPOINT, cfg.train.export_adapter))
    return summary | exported | ({"plot": str(plot_run(run_dir))} if plot else {})
