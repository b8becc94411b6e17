"""Preemption: a scheduler ends a job with SIGTERM to its whole process group (Slurm, Kubernetes), then SIGKILL after
a grace period; Slurm can send SIGUSR1 ahead of time (``--signal=USR1@120``). Either asks the run to save the state
after its last complete step and exit 143, which ``--resume`` continues from.

The signal is only noted; the loop saves at the end of the step in progress (a step stopped in its middle would
leave the ranks mid-collective). Copies of one event (the process group's and the launcher's forward, within
``SAME_EVENT_S``) count once. A later signal, or ``train.preempt_grace_s`` passing before the save is done, ends
the process at once: a save writes aside and renames, so the last complete checkpoint stays intact.

Ctrl-C (SIGINT, one process: ``CtrlC``) stops at once while the step in progress has changed nothing a checkpoint
holds, and the last complete step is saved; once the step's optimizer steps have begun it is held until the step
is complete, which is then saved: the weights, moments and schedule half-way through a step's mini-batches are no
step's, and a resume from them would not go on as the run would have.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 143  # 128 + SIGTERM, what a scheduler expects of a job its signal ended
SAME_EVENT_S = 1.0


class Preemption:
    """While entered (main thread), SIGTERM / SIGUSR1 are noted in ``signal_name`` instead of ending the process."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal_name: str | None = None
        self._at = 0.0
        self._saved = threading.Event()
        self._before: dict = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._before = {s: signal.signal(s, self._noted) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._saved.set()
        for s, handler in self._before.items():
            signal.signal(s, handler)

    def saved(self) -> None:
        """The save asked for is on disk: the grace timer has nothing left to guard."""
        self._saved.set()

    def _noted(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signal_name is None:
            self.signal_name, self._at = signal.Signals(signum).name, now
            print(
                f"moerl: {self.signal_name}: saving after the step in progress (train.preempt_grace_s={self.grace_s:g} "
                "s; a second signal stops at once, keeping the last checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            threading.Thread(target=self._deadline, name="moerl-preempt-grace", daemon=True).start()
        elif now - self._at > SAME_EVENT_S:
            _stop_now(f"a second {signal.Signals(signum).name}")

    def _deadline(self) -> None:
        if not self._saved.wait(self.grace_s):
            _stop_now(f"train.preempt_grace_s={self.grace_s:g} s passed before the save was done")


def _stop_now(why: str) -> None:
    print(f"moerl: {why}: stopping now; the last complete checkpoint is kept", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


class Quiet:
    """A rank other than 0, or an engine process: rank 0's loop answers the scheduler's signal for the run (these
    processes go on until it tells them to stop), so here it is ignored."""

    def __enter__(self) -> Quiet:
        if threading.current_thread() is threading.main_thread():
            self._before = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}
        else:
            self._before = {}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)


class CtrlC:
    """While entered (main thread, SIGINT at Python's default): Ctrl-C raises KeyboardInterrupt at once, except
    between ``hold`` (the step's weights begin to change, or its training is over but its row not yet written) and
    ``step_done`` (the step is complete), where it is noted and ``step_done`` raises it. A second Ctrl-C while held
    raises at once, with ``mid_step`` set: the state is no complete step's, nothing of it may be saved. Where SIGINT
    has another handler (a rank of moerl's launch ends at once, a background job ignores it) it is left alone."""

    def __init__(self) -> None:
        self.step = 0  # the step in progress (0-based), for the message
        self.holding = self.noted = self.mid_step = False
        self._before = None

    def __enter__(self) -> CtrlC:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._before = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            signal.signal(signal.SIGINT, self._before)
            self._before = None

    def begin(self, step: int) -> None:
        """Step ``step`` starts: nothing of it is in the state yet."""
        self.step, self.holding, self.noted = step, False, False

    def hold(self) -> None:
        """The step's state is about to be neither the last complete step's nor its own complete one: a Ctrl-C from
        here waits for ``step_done``."""
        self.holding = True

    def step_done(self) -> None:
        """The step is complete (its row logged, its checkpoint cadence kept): a Ctrl-C noted meanwhile stops now."""
        self.holding = False  # first: a Ctrl-C from here raises at once
        if self.noted:
            self.noted = False
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame) -> None:
        if not self.holding:
            raise KeyboardInterrupt
        if self.noted:
            self.mid_step = True
            raise KeyboardInterrupt
        self.noted = True
        print(
            f"moerl: Ctrl-C: step {self.step + 1} has begun training; the run saves it and stops once it is complete "
            "(Ctrl-C again: stop now, keeping the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )
