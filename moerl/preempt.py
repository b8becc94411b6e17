"""Preemption: a scheduler ends a job with SIGTERM to its whole process group (Slurm, Kubernetes), then SIGKILL after
a grace period; Slurm can send SIGUSR1 ahead of time (``--signal=USR1@120``). Either asks the run to save the state
after its last complete step and exit 143, which ``--resume`` continues from.

The signal is only noted; the loop saves at the end of the step in progress (a step stopped in its middle would
leave the ranks mid-collective). Copies of one event (the process group's and the launcher's forward, within
``SAME_EVENT_S``) count once. A later signal, or ``train.preempt_grace_s`` passing before the save is done, ends
the process at once: a save writes aside and renames, so the last complete checkpoint stays intact.
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
