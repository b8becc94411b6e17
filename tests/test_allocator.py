"""Freed CPU memory is kept for reuse: a repeated allocate / free cycle stops faulting pages in (glibc). Negative
control: the same cycle in a process that did not ask faults on every round."""

import subprocess
import sys

import pytest

CYCLE = """
import resource, sys, torch
from moerl.allocator import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "on" else None
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
    # measured: 0 to 4096 pages kept (one 16 MiB block once), ~32k pages over the 5 rounds without
    assert applied == "True" and faults < 8192, faults
    _, control = _faults("off")
    assert control > 20000, control
