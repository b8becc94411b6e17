"""Freed CPU memory is kept for reuse: a repeated allocate / free cycle stops faulting pages in (glibc). Negative
control: the same cycle in a process that asks glibc to give freed memory back faults on every round. (glibc's
default depends on its dynamic thresholds and on what else sits on the heap: on one CI host it kept the blocks, on
this one it gave them back, so the default is no control.)"""

import subprocess
import sys

import pytest

CYCLE = """
import resource, sys, torch
import ctypes
from moerl.allocator import reuse_freed_memory
if sys.argv[1] == "on":
    applied = reuse_freed_memory()
else:  # give back: mmap every block above 128 KiB (a fixed threshold, so not raised on free) and trim at once
    libc = ctypes.CDLL("libc.so.6")
    applied = bool(libc.mallopt(-3, 128 * 1024) and libc.mallopt(-1, 0))
def cycle():
    held = [torch.ones(4 * 2**20) for _ in range(8)]  # 8 x 16 MiB at once, then all freed
    del held
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    applied, faults = _faults("on")
    if applied == "False":
        pytest.skip("not glibc: nothing to set")
    # measured: 0 to 4096 pages (one 16 MiB block once); giving back faults 5 x 128 MiB in again (~164k pages)
    assert applied == "True" and faults < 8192, faults
    applied, control = _faults("off")
    assert applied == "True" and control > 20000, control
