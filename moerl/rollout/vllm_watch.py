"""Watching one vLLM engine's processes, so that one that dies is a named EngineError, never a hang.

vLLM's synchronous client waits on its output queue with no timeout, and when its EngineCore dies it shuts its
reader down without waking that wait (a ``generate`` then hangs for ever); utility calls (``collective_rpc``) wait on
futures nobody resolves. The watch polls the EngineCore processes vLLM started and the workers those started; once
one is gone it wakes every waiter with the error that names it. ``release_shm`` removes the shared memory segments
(``psm_*``) of a vLLM engine whose processes died without unlinking them, and no other engine's.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from moerl.child import proc_alive, proc_children, proc_stopped, proc_title
from moerl.errors import EngineError

POLL_S = 0.5
SHM = Path("/dev/shm")


class VLLMWatch:
    """Watches vLLM engine ``index``'s processes (from ``llm``) until ``stop``; ``dead`` says which one died."""

    def __init__(self, llm, index: int, timeout_s: float = 300.0):
        """``timeout_s``: how long one of the processes may stay stopped (SIGSTOP, a debugger) before it counts as
        gone: nothing it owes arrives while it is stopped."""
        self.core, self.index, self.timeout_s = llm.llm_engine.engine_core, index, timeout_s
        self.stopped_since: dict[int, float] = {}
        manager = getattr(getattr(self.core, "resources", None), "engine_manager", None)
        self.cores = list(getattr(manager, "processes", []))  # multiprocessing processes: exit codes known
        self.workers = [(w, proc_title(w) or "?") for p in self.cores for w in proc_children(p.pid)]
        self.dead: str | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=f"moerl-vllm-watch-{index}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.cores] + [pid for pid, _ in self.workers]

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.dead = self.check()
            if self.dead is not None:
                self._wake(EngineError(self.dead))
                return

    def check(self) -> str | None:
        """Which of the engine's processes is gone, in words; None while all live."""
        who = f"vLLM engine {self.index}'s"
        for pid, title in self.workers:  # a dead worker takes its EngineCore down: name the cause
            if not proc_alive(pid):
                return f"{who} worker {title} (pid {pid}) died"
        for p in self.cores:
            code = p.exitcode
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"{who} EngineCore (pid {p.pid}) {how}"
        now = time.monotonic()
        for pid, title in [(p.pid, "EngineCore") for p in self.cores] + [(w, f"worker {t}") for w, t in self.workers]:
            if not proc_stopped(pid):
                self.stopped_since.pop(pid, None)
            elif now - self.stopped_since.setdefault(pid, now) > self.timeout_s:
                return (
                    f"{who} {title} (pid {pid}) has been stopped (SIGSTOP?) for {self.timeout_s:.0f} s "
                    "(rollout.engine_timeout_s)"
                )
        return None

    def _wake(self, error: EngineError) -> None:
        """Hand ``error`` to whatever waits on the engine: a generate's output queue, utility calls' futures."""
        queue = getattr(self.core, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(error)
        for future in list(getattr(self.core, "utility_results", {}).values()):
            try:
                future.set_exception(error)
            except Exception:  # noqa: BLE001 - answered or cancelled meanwhile
                pass

    def stop(self) -> None:
        """Stop watching; a worker left behind by an EngineCore that died is ended (vLLM would leave it running)."""
        self._stop.set()
        for pid, title in self.workers:
            if proc_alive(pid) and proc_title(pid) == title:  # still that worker, not a process under a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def shm_segments() -> set[str]:
    return {p.name for p in SHM.glob("psm_*")} if SHM.is_dir() else set()


def mapped_elsewhere() -> set[str]:
    """The ``psm_*`` segments that live processes outside this process's tree map (read from their
    ``/proc/<pid>/maps``): another engine's, started beside this one by another run or test."""
    from moerl.cores import processes, tree

    ours, out = tree(processes(), os.getpid()), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            maps = (entry / "maps").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        out |= {line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/psm_" in line}
    return out


def release_shm(names: set[str]) -> None:
    """Unlink the segments ``names`` (those that appeared while a vLLM engine started) that are still there, but for
    those a process outside this one's tree maps: a segment that appeared in the same seconds may be another engine's
    (two runs, or two test workers, starting vLLM at once), and unlinking it would take that engine down."""
    if not names:
        return
    for name in names - mapped_elsewhere():
        (SHM / name).unlink(missing_ok=True)
