"""What moerl's ``torch.compile`` graphs share (the trainer's blocks, the engine's decode step)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from torch.fx.experimental import _config as fx_config


def unducked(compiled):
    """``compiled`` traced without duck sizing: by default dynamo gives equal sizes one symbol, so a size that
    happens to equal another (a packed length equal to the hidden size; a decode bucket of 16 rows beside the KV
    cache's 16-token blocks) is pinned to it, and the next size compiles again."""

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args)

    return call


@contextmanager
def first_compile(what: str, key: str, value, on: bool = True):
    """A line on stderr before and after the first call of ``what``'s compiled graph, which compiles it (tens of
    seconds on a CPU): a long first step is said, not taken for a hang. ``key`` / ``value``: the setting that
    compiles it; ``on``: whether this call is that first one (else nothing is said)."""
    if not on:
        yield
        return
    print(f"moerl: compiling {what} now, in the first call ({key}: {str(value).lower()})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    print(f"moerl: compiled {what}: the first call took {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
