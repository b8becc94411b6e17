"""Asynchronous RL: rollouts generated ahead of the trainer, in a background thread, with bounded staleness.

The rollouts of step ``s`` start once the engine holds weight version ``s - max_staleness`` or newer (version ``v``:
the weights after ``v`` training steps), so no sample is more than ``max_staleness`` versions behind the trainer
that learns from it. Weights reach the engine between requests: the trainer's sync waits for the engine call in
flight (one batch of requests) and goes before the next. Each sample is then one policy's throughout, so its
engine logprobs and its routing (R3) are one behaviour policy's, which is what the off-policy corrections (TIS /
MIS / IcePop against the engine's logprobs) assume; partial rollouts would mix versions inside a sequence.
"""

from __future__ import annotations

import threading
import time

from moerl.rollout.generator import Generator, StepRollouts


class RolloutsAhead:
    """Generates the rollouts of steps ``start`` .. ``steps - 1`` in order, at most ``max_staleness`` weight versions
    ahead. ``get(step)`` hands them over; ``advanced(version)`` says the engine now holds ``version``."""

    def __init__(self, gen: Generator, start: int, steps: int, max_staleness: int):
        self.gen, self.max_staleness = gen, max_staleness
        self._cond = threading.Condition()
        self._ready: dict[int, StepRollouts] = {}
        self._version, self._error, self._closed = start, None, False
        self._engine_idle = 0.0  # seconds the generator waited for the staleness bound since the last get
        self._thread = threading.Thread(target=self._run, args=(start, steps), name="moerl-rollouts", daemon=True)
        self._thread.start()

    def _run(self, start: int, steps: int) -> None:
        for step in range(start, steps):
            with self._cond:
                t0 = time.perf_counter()
                self._cond.wait_for(lambda s=step: self._closed or self._version >= s - self.max_staleness)
                self._engine_idle += time.perf_counter() - t0
                if self._closed:
                    return
            try:
                got = self.gen.collect(step)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[step] = got
                self._cond.notify_all()

    def get(self, step: int) -> tuple[StepRollouts, float, float]:
        """The rollouts of ``step`` (waiting for them), the seconds waited, and the seconds the generator waited for
        the staleness bound since the last call. Raises what generation raised."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:
                raise self._error
            idle, self._engine_idle = self._engine_idle, 0.0
            return self._ready.pop(step), time.perf_counter() - t0, idle

    def advanced(self, version: int) -> None:
        """The engine holds weight ``version`` now: rollouts up to step ``version + max_staleness`` may start."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Stop generating: the call in flight finishes (the engine is left between requests), waited for up to
        ``timeout_s`` seconds; False when it is still running then (the thread is left to end with the process: the
        engine's close ends what it waits on). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()
