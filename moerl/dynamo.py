"""What moerl's ``torch.compile`` graphs share (the trainer's blocks, the engine's decode step): the first call said
on the console, and what that call cost remembered beside inductor's cache, so the next run's ``auto`` prices a
compilation at what it took here last time (the cache makes a second compilation of the same graph cheaper) rather
than at a cold compilation's cost."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.fx.experimental import _config as fx_config

LEDGER = "moerl_compile_seconds.json"  # in inductor's cache directory: cleared with the cache it prices
LEDGER_GRAPHS = 1000  # graphs remembered; past it the oldest records go


def unducked(compiled):
    """``compiled`` traced without duck sizing: by default dynamo gives equal sizes one symbol, so a size that
    happens to equal another (a packed length equal to the hidden size; a decode bucket of 16 rows beside the KV
    cache's 16-token blocks) is pinned to it, and the next size compiles again."""

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args)

    return call


def graph_key(what: str, model: torch.nn.Module, *settings) -> str:
    """The identity of ``what``'s graph over ``model`` across runs: torch's version, the model's modules (their
    classes and sizes: LoRA slots, MX modules), every parameter's and buffer's name, shape, dtype and device kind,
    and ``settings`` (what else the graph is traced with)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    parts = [
        what,
        torch.__version__,
        str(model),
        *(f"{n} {tuple(t.shape)} {t.dtype} {t.device.type}" for n, t in tensors),
    ]
    parts += [repr(s) for s in settings]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def ledger_path() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / LEDGER


def remembered_seconds(key: str | None) -> float | None:
    """What the first call of graph ``key`` took when it last compiled (with inductor's cache as it was then), or
    None: never compiled here, or the cache (and this record with it) since removed."""
    if key is None:
        return None
    try:
        seconds = json.loads(ledger_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: priced as a first compilation
        return None
    ok = isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0
    return float(seconds) if ok else None


def _remember(key: str, seconds: float) -> None:
    """Record ``seconds`` for graph ``key`` (written aside and renamed: a reader never sees half a file)."""
    path = ledger_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            known = json.loads(path.read_text())
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known.pop(key, None)  # re-inserted last: the oldest records are the first dropped
        known[key] = round(seconds, 2)
        known = dict(list(known.items())[-LEDGER_GRAPHS:])
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".moerl_compile_seconds")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except OSError:  # a read-only cache directory: the next run prices the compilation as a first one
        pass


@contextmanager
def first_compile(what: str, key: str, value, on: bool = True, graph: str | None = None):
    """A line on stderr before and after the first call of ``what``'s compiled graph, which compiles it (tens of
    seconds on a CPU): a long first step is said, not taken for a hang. ``key`` / ``value``: the setting that
    compiles it; ``on``: whether this call is that first one (else nothing is said); ``graph``: the graph's
    ``graph_key``, under which the call's seconds are remembered for the next run's ``auto``."""
    if not on:
        yield
        return
    print(f"moerl: compiling {what} now, in the first call ({key}: {str(value).lower()})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    if graph is not None:
        _remember(graph, seconds)
    print(f"moerl: compiled {what}: the first call took {seconds:.1f} s", file=sys.stderr, flush=True)


def price(remembered: float | None, default: float) -> tuple[float, str]:
    """(seconds, how known) of a compilation: ``remembered`` (``remembered_seconds``) where known, else
    ``default``."""
    if remembered is None:
        return default, f"the ~{default:.0f} s a first compilation takes"
    return remembered, f"the {remembered:.1f} s it took when it last compiled here"
