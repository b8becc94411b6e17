"""Weight sync: a policy's tensors to an engine in buckets, checked, staged and committed atomically (or one adapter
slot). What the tensors are is the training mode's (``moerl.modes``: ``Mode.own_tensors``); an engine that serves
neither adapters nor MX weights (vLLM: ``engine.dense_weights`` names its dtype) gets the mode's *dense* form.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moerl.errors import TrainingStopped
from moerl.finite import first_nonfinite
from moerl.model.mx import MX_SCALE
from moerl.sync.parts import split_part

ADAPTER = "policy"


@dataclass(slots=True)
class SyncStats:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float


def buckets(tensors, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Groups of named tensors (a dict, or ``(name, tensor)`` pairs in order) of at most ``bucket_bytes`` (a larger
    tensor travels alone); an MX scale (or a part of one), which follows its data, stays in its data's bucket."""
    bucket, size = {}, 0
    for name, t in tensors.items() if isinstance(tensors, dict) else tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes and not split_part(name)[0].endswith(MX_SCALE):
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def sync_policy(policy, engine, version: int, bucket_bytes: int = 256 * 2**20) -> SyncStats:
    """Push ``policy``'s weights to ``engine`` and tag them ``version``; applied atomically. Each bucket is checked
    for non-finite values before it is staged; a bad one discards what was staged, so the engine keeps its weights.
    A sharded policy sends the weights it splits by rows in parts of at most ``bucket_bytes`` (``moerl.sync.parts``)."""
    start = time.perf_counter()
    dense = engine.dense_weights
    stream = policy.sync_tensors(dense, part_bytes=bucket_bytes)
    count = nbytes = n_buckets = 0
    try:
        if policy.mode.sends_adapter(dense):
            tensors = dict(stream)
            _check_finite(tensors, version, engine)
            engine.set_adapter(ADAPTER, tensors, version)
            count, nbytes, n_buckets = len(tensors), _nbytes(tensors), 1
        else:
            engine.discard_staged()
            for bucket in buckets(stream, bucket_bytes):
                try:
                    _check_finite(bucket, version, engine)
                except TrainingStopped:
                    engine.discard_staged()
                    raise
                engine.stage_weights(bucket)
                count, nbytes, n_buckets = count + len(bucket), nbytes + _nbytes(bucket), n_buckets + 1
            engine.commit_weights(version)
    finally:
        for _ in stream:  # a sharded policy's other ranks gather to the end: so does this one
            pass
    return SyncStats(version, count, nbytes, n_buckets, time.perf_counter() - start)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _check_finite(tensors: dict[str, torch.Tensor], version: int, engine) -> None:
    bad = first_nonfinite(list(tensors.values()))  # one read of the device for the whole bucket
    if bad is not None:
        name = list(tensors)[bad]
        raise TrainingStopped(
            f"weight sync of version {version}: tensor {name!r} holds non-finite values; not pushed to the engine "
            f"(it keeps version {engine.weight_version})"
        )
