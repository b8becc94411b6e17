"""Sharing the CPU with other processes: torch threads follow the cores other processes leave free.

torch's OpenMP threads wait for each other at the end of every parallel region, spinning; with as many threads as
cores and another CPU-bound process beside them, a region waits for a thread the kernel has descheduled, and a run
of many small operations (a tiny model's) slows down many times over. Between steps the
loop measures how much CPU time processes outside this one's process tree took over the last interval (their
``/proc/<pid>/stat``) and sets torch's thread count to the cores they left: one thread spins against nobody. When
they stop, the threads come back. Linux only (elsewhere it does nothing).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

PROC = Path("/proc")
MIN_INTERVAL_S = 0.5  # a shorter interval measures noise
AGREE = 2  # checks in a row that must find the same count before it changes: a passing spike changes nothing
FIRST_LOOK_S = 0.1  # a new CoreShare's first measurement (10 clock ticks per busy core)
RECENT_S = 60.0  # a new CoreShare starts from a count an earlier one (the warm-up's) decided this recently
_recent: tuple[float, int] | None = None  # (when, thread count) of the last decision in this process


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU clock ticks used: user + system) of every process in /proc."""
    out = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            out[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def tree(table: dict[int, tuple[int, int]], root: int) -> set[int]:
    """``root`` and every process below it (engine processes, the reward worker, the processes vLLM starts):
    moerl's own work, which must not count as someone else's."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


class CoreShare:
    """Sets torch's thread count in this process to the cores that processes outside its tree left over the last
    interval (at most the count it started with, at least 1). ``check()`` between steps; returns a line to show
    when the count changed, else None."""

    def __init__(self, enabled: bool = True) -> None:
        """``enabled``: False keeps the thread count; so does ``MOERL_CORE_SHARE=0`` in the environment (the test
        suite sets it: its runs are compared bit for bit, and another thread count rounds otherwise)."""
        on = enabled and os.environ.get("MOERL_CORE_SHARE", "1") != "0"
        self.enabled = on and sys.platform.startswith("linux") and PROC.is_dir()
        self._pending: str | None = None
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.threads = self.wanted = torch.get_num_threads()
        self.hz = os.sysconf("SC_CLK_TCK") if self.enabled else 100
        self._last = (time.monotonic(), processes()) if self.enabled else None
        self._proposed, self._seen = self.threads, 0
        if not self.enabled:
            return
        if _recent is not None and time.monotonic() - _recent[0] < RECENT_S:
            start = _recent[1]  # the phase before measured it
        else:  # a first look (the steps' checks come only between steps, and a step under contention is slow)
            time.sleep(FIRST_LOOK_S)
            busy = self._busy(time.monotonic(), processes())
            start = self.cores - round(busy)
            if start < self.wanted:
                self._pending = self._reduced(busy, self.wanted, max(1, start))
        self.threads = self._proposed = max(1, min(self.wanted, start))
        torch.set_num_threads(self.threads)

    def _reduced(self, busy: float, before: int, after: int) -> str:
        return (
            f"moerl: other processes keep ~{busy:.1f} of {self.cores} cores busy: torch threads {before} -> {after} "
            "(threads spinning against them would slow every step many times over)"
        )

    def others(self) -> float | None:
        """Cores that processes outside this tree kept busy since the last call; None if the interval is too short."""
        t1, now = time.monotonic(), processes()
        if t1 - self._last[0] < MIN_INTERVAL_S:
            return None
        return self._busy(t1, now)

    def _busy(self, t1: float, now: dict[int, tuple[int, int]]) -> float:
        t0, before = self._last
        self._last = (t1, now)
        mine = tree(now, os.getpid())
        ticks = sum(used - before.get(pid, (0, 0))[1] for pid, (_, used) in now.items() if pid not in mine)
        return max(0, ticks) / self.hz / (t1 - t0)

    def check(self) -> str | None:
        if not self.enabled:
            return None
        if self._pending is not None:  # what the first look decided
            said, self._pending = self._pending, None
            return said
        busy = self.others()
        if busy is None:
            return None
        global _recent
        free = max(1, min(self.wanted, self.cores - round(busy)))
        self._seen = self._seen + 1 if free == self._proposed else 1
        self._proposed = free
        if self._seen >= AGREE:
            _recent = (time.monotonic(), free)
        if free == self.threads or self._seen < AGREE:
            return None
        before, self.threads = self.threads, free
        torch.set_num_threads(free)
        if free < self.wanted:
            return self._reduced(busy, before, free)
        return f"moerl: the other processes stopped: torch threads {before} -> {free}"

    def restore(self) -> None:
        """The thread count this process had before."""
        if self.threads != self.wanted:
            torch.set_num_threads(self.wanted)
            self.threads = self.wanted
