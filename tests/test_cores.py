"""Torch threads follow the cores other processes leave (``moerl.cores``): a busy process outside moerl's process
tree takes a thread away; its end gives it back; moerl's own busy children take nothing."""

import os
import subprocess
import sys
import time

import pytest
import torch

from moerl.cores import CoreShare

BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end:\n    pass\n"


def checks(share: CoreShare, n: int) -> list[str | None]:
    out = []
    for _ in range(n):
        time.sleep(0.55)
        out.append(share.check())
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="2+ cores, /proc")
def test_threads_follow_the_cores_other_processes_leave(monkeypatch):
    """The machine may be busy with work of its own (another suite, a build): the share reads /proc as it does in
    a run, but sees only this test's processes (its own tree and the busy process it starts outside it), so other
    load on the host neither takes a thread nor hides one."""
    import moerl.cores

    watched: set[int] = set()  # the processes outside this tree that the test starts
    real = moerl.cores.processes

    def ours() -> dict[int, tuple[int, int]]:
        table = real()
        mine = moerl.cores.tree(table, os.getpid())
        return {pid: v for pid, v in table.items() if pid in mine or pid in watched}

    monkeypatch.setattr(moerl.cores, "processes", ours)
    monkeypatch.setattr(moerl.cores, "_recent", None)
    monkeypatch.setenv("MOERL_CORE_SHARE", "1")  # the suite keeps it off for its bit-for-bit comparisons
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        share = CoreShare(enabled=True)
        share.cores = 2  # the host may have more: a 2-core machine is what is shown here
        # control: a busy child of this process is moerl's own work (an engine process), not someone else's
        child = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            assert checks(share, 3) == [None] * 3 and torch.get_num_threads() == 2
        finally:
            child.kill()
            child.wait()
        # a busy process outside the tree (its parent exits at once: init adopts it)
        pid = int(subprocess.check_output(["sh", "-c", f"{sys.executable} -c '{BUSY}' >/dev/null 2>&1 & echo $!"]))
        watched.add(pid)
        try:
            said = [x for x in checks(share, 3) if x]
            assert torch.get_num_threads() == 1 and len(said) == 1 and "torch threads 2 -> 1" in said[0], said
        finally:
            os.kill(pid, 9)
        said = [x for x in checks(share, 3) if x]
        assert torch.get_num_threads() == 2 and said == ["moerl: the other processes stopped: torch threads 1 -> 2"]
        share.restore()
    finally:
        torch.set_num_threads(before)
