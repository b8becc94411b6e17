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


STAND_IN = 999_999_999  # a pid no process has: the stand-in for someone else's busy process


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="2+ cores, /proc")
def test_threads_follow_the_cores_other_processes_leave(monkeypatch):
    """The machine may be busy with work of its own (another suite, a test worker beside this one, a build): the
    share reads /proc as it does in a run, but sees only this test's own process tree and a stand-in for someone
    else's busy process (its clock ticks advance by one core's worth while it is on), so neither other load on the host
    nor how much CPU a real busy process gets under it changes what the share decides."""
    import moerl.cores

    hz = os.sysconf("SC_CLK_TCK")
    busy_since: list[float] = []  # when the stand-in started being busy (empty: it is not running)
    real = moerl.cores.processes

    def ours() -> dict[int, tuple[int, int]]:
        table = real()
        mine = moerl.cores.tree(table, os.getpid())
        seen = {pid: v for pid, v in table.items() if pid in mine}
        if busy_since:
            seen[STAND_IN] = (1, int((time.monotonic() - busy_since[0]) * hz))
        return seen

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
        busy_since.append(time.monotonic())  # someone else's process keeps a core busy
        said = [x for x in checks(share, 3) if x]
        assert torch.get_num_threads() == 1 and len(said) == 1 and "torch threads 2 -> 1" in said[0], said
        busy_since.clear()  # it ended
        said = [x for x in checks(share, 3) if x]
        assert torch.get_num_threads() == 2 and said == ["moerl: the other processes stopped: torch threads 1 -> 2"]
        share.restore()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_the_table_reads_a_busy_process_outside_the_tree_from_proc():
    """What the share reads: a real busy process outside this one's tree (its parent exits at once: init adopts it)
    appears in ``processes()`` with its parent and clock ticks that grow; it is not in this process's tree."""
    from moerl.cores import processes, tree

    pid = int(subprocess.check_output(["sh", "-c", f"{sys.executable} -c '{BUSY}' >/dev/null 2>&1 & echo $!"]))
    try:
        first = processes()[pid][1]
        deadline = time.monotonic() + 30  # however busy the host: some ticks within 30 s
        while processes()[pid][1] <= first and time.monotonic() < deadline:
            time.sleep(0.1)
        table = processes()
        assert table[pid][1] > first
        assert pid not in tree(table, os.getpid()) and os.getpid() in tree(table, os.getpid())
    finally:
        os.kill(pid, 9)
