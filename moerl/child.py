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
