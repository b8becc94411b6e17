"""The deadline of a run's last moments: once one trainer rank has ended, the others have ``END_S`` seconds to end.

Every rank returns only after the run's final barrier (``World.close``), so they end within moments of each other; a
rank still running long after another has ended is stuck past its work (an interpreter exit that never finishes, a
library thread that holds the process), and without a deadline it holds the job's slot until the scheduler kills it.
torchrun's launcher waits for every rank that has not failed; :class:`EndWatch` stops such a straggler from the
launcher's side, and ``moerl.cluster`` gives Ray actors the same deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from moerl.child import proc_alive, proc_children

END_S = 120.0  # past the final barrier a rank only exits; a failed rank is torchrun's to stop (30 s, then SIGKILL)


def rank_of(pid: int) -> int | None:
    """The trainer rank of process ``pid`` (its ``RANK`` as torchrun set it); None for another process or one gone."""
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e[5:] for e in env if e.startswith(b"RANK=")]
    return int(found[0]) if found and found[0].isdigit() else None


class EndWatch:
    """Watches this process's ``nprocs`` rank processes (its children) from a thread while the block runs; once one
    has ended, those still running ``end_s`` seconds later are killed (SIGKILL: they are past the final barrier) and
    listed in ``stopped`` by rank."""

    def __init__(self, nprocs: int, end_s: float = END_S, poll_s: float = 0.5):
        self.nprocs, self.end_s, self.poll_s = nprocs, end_s, poll_s
        self.stopped: list[int] = []
        self.first_end: int | None = None  # the rank that ended first
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="moerl-end-watch", daemon=True)

    def __enter__(self) -> EndWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5 * self.poll_s)

    def _watch(self) -> None:
        ranks: dict[int, int] = {}  # pid -> rank, of every rank process seen
        ended_at = None
        while not self._done.wait(self.poll_s):
            for pid in proc_children(os.getpid()):
                if pid not in ranks and (rank := rank_of(pid)) is not None:
                    ranks[pid] = rank
            if len(ranks) < self.nprocs:  # still starting (or restarted by torchrun: never with moerl's launch)
                continue
            live = {pid: rank for pid, rank in ranks.items() if proc_alive(pid)}
            if ended_at is None and len(live) < len(ranks):
                ended_at, self.first_end = time.monotonic(), min(set(ranks.values()) - set(live.values()))
            if ended_at is None or not live or time.monotonic() - ended_at < self.end_s:
                continue
            self.stopped = sorted(live.values())
            print(
                f"moerl: trainer rank(s) {', '.join(map(str, self.stopped))} still running {self.end_s:g} s after "
                f"rank {self.first_end} ended; stopping them",
                file=sys.stderr,
                flush=True,
            )
            for pid in live:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
