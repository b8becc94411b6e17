"""``spawn``: a moerl function in a plain ``python -c`` child process, talking over a socket pair.

A plain subprocess rather than a multiprocessing one: no fork of a parent holding torch / OpenMP threads, and no
re-import of the parent's ``__main__`` as spawn does (which breaks under stdin or notebooks and re-runs unguarded
scripts). Used by the reward worker and the engine processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path


def spawn(module: str, function: str, *args: int) -> tuple[subprocess.Popen, Connection]:
    """Start ``module.function(fd, *args)`` in a child (``fd``: its end of the socket pair); returns the process and
    this side's connection. ``args`` are ints (they are written into the child's command line)."""
    mine, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    call = ", ".join(str(int(a)) for a in (theirs.fileno(), *args))
    code = f"from {module} import {function}; {function}({call})"
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    return proc, Connection(mine.detach())


# -- the process table (Linux /proc), for watching processes moerl did not start itself -----------------------------
def proc_stat(pid: int) -> list[str]:
    """Process ``pid``'s /proc stat fields after its name (``[0]`` the state letter, ``[1]`` the parent pid); [] when
    it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return []


def proc_cpu_ticks(pid: int) -> int:
    """The CPU time process ``pid`` has used (user + system, in clock ticks); 0 when it is gone."""
    fields = proc_stat(pid)
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def proc_state(pid: int) -> str:
    """Process ``pid``'s state letter (R, S, T stopped, Z exited, ...); "" when it is gone."""
    return (proc_stat(pid) or [""])[0]


def proc_alive(pid: int) -> bool:
    return proc_state(pid) not in ("", "Z")


def proc_stopped(pid: int) -> bool:
    """Stopped by SIGSTOP or a debugger."""
    return proc_state(pid) in ("T", "t")


def proc_children(parent: int) -> list[int]:
    """The pids whose parent is ``parent``."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and proc_stat(int(d))[1:2] == [str(parent)]]


def proc_title(pid: int) -> str | None:
    """The first word of process ``pid``'s command line (its title, where it set one); None when it is gone."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return None
