"""N rollout engines behind one InferenceEngine: in this process or each in its own process.

The requests of one call are split into N contiguous slices (balanced by samples) and the outputs gathered back in
request order; the split does not depend on where the engines run, so a seeded run gives the same rollouts in
process and in engine processes. Weight updates go to every engine; each applies them atomically between
generations and tags its outputs with the version.
"""

from __future__ import annotations

import atexit
import os
import weakref

import torch

from moerl.engine import LLMEngine, Request, RequestOutput
from moerl.errors import ConfigError
from moerl.rollout.process import EngineProcess, EngineSpec, _Writer, build_native

PLACEMENTS = ("inprocess", "process")

_live: weakref.WeakSet[EnginePool] = weakref.WeakSet()


def split(requests: list[Request], n: int) -> list[slice]:
    """``n`` contiguous slices of ``requests`` with about equal numbers of samples (some may be empty)."""
    weights = [r.params.n for r in requests]
    total, bounds, acc, k = sum(weights), [0], 0, 1
    for i, w in enumerate(weights):
        acc += w
        while k < n and acc >= total * k / n:
            bounds.append(i + 1)
            k += 1
    bounds += [len(requests)] * (n + 1 - len(bounds))
    return [slice(bounds[j], bounds[j + 1]) for j in range(n)]


def _gather(calls: list) -> list:
    """Every call's result, in order; the first exception is raised once all have answered, so no engine is left
    with an unread reply."""
    results, first = [], None
    for call in calls:
        try:
            results.append(call())
        except Exception as e:  # noqa: BLE001 - re-raised below
            first = first or e
    if first is not None:
        raise first
    return results


class EnginePool:
    """``num_engines`` native engines built from ``spec``, ``placement`` ``inprocess`` or ``process``."""

    def __init__(self, spec: EngineSpec, placement: str = "inprocess", num_engines: int = 1):
        if placement not in PLACEMENTS:
            raise ConfigError(f"rollout.placement={placement!r}: allowed: {', '.join(PLACEMENTS)}")
        if num_engines < 1:
            raise ConfigError(f"rollout.num_engines={num_engines}: must be >= 1")
        self.placement = placement
        self.engines: list[LLMEngine | EngineProcess] = []
        self.weights = _Writer("moerl-weights")  # process placement: one buffer the engines read each bucket from
        _live.add(self)
        try:
            for i in range(num_engines):
                self.engines.append(build_native(spec) if placement == "inprocess" else EngineProcess(spec, i))
        except BaseException:
            self.close()
            raise
        first = self.engines[0]
        if placement == "inprocess":
            self.tokenizer = first.tokenizer
        else:
            from moerl.bridges.checkpoint import load_tokenizer

            has_tok = any(os.path.exists(os.path.join(spec.model, f)) for f in ("tokenizer.json",))
            self.tokenizer = load_tokenizer(spec.model) if has_tok else None

    @property
    def weight_version(self) -> int:
        return min(e.weight_version for e in self.engines)

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        parts = split(requests, len(self.engines))
        if self.placement == "inprocess":
            return [o for e, s in zip(self.engines, parts, strict=True) if requests[s] for o in e.generate(requests[s])]
        busy = [(e, s) for e, s in zip(self.engines, parts, strict=True) if requests[s]]
        for e, s in busy:  # all engines generate side by side
            e.generate_async(requests[s])
        return [o for outs in _gather([e.wait for e, _ in busy]) for o in outs]

    # -- weights ---------------------------------------------------------------------------------------------------
    def _broadcast(self, op: str, tensors: dict[str, torch.Tensor] | None = None, **fields) -> None:
        """Send one command to every engine and wait for all; ``tensors`` go through the shared buffer, written once
        for all engines (a ``stage`` appends to the update's earlier buckets)."""
        msg = {"op": op, **fields}
        if tensors is not None:
            msg |= self.weights.put(tensors, append=op == "stage")
        for e in self.engines:
            e.send(msg)
        _gather([lambda e=e: e.reply(op) for e in self.engines])
        if tensors is not None:
            self.weights.buf.unlink()  # every engine has mapped it: nothing is left in /dev/shm if we crash

    def discard_staged(self) -> None:
        if self.placement == "inprocess":
            for e in self.engines:
                e.discard_staged()
        else:
            self.weights.reset()
            self._broadcast("discard")

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold one bucket of named tensors in every engine until ``commit_weights``."""
        if self.placement == "inprocess":
            for e in self.engines:
                e.stage_weights(tensors)
        else:
            self._broadcast("stage", tensors)

    def commit_weights(self, version: int) -> None:
        if self.placement == "inprocess":
            for e in self.engines:
                e.commit_weights(version)
        else:
            self._broadcast("commit", version=version)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.discard_staged()
        self.stage_weights(tensors)
        self.commit_weights(version)

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load (or replace) adapter ``name`` from tensors in every engine, in memory, tagged ``version``."""
        if self.placement == "inprocess":
            for e in self.engines:
                e.set_adapter(name, tensors, version)
        else:
            self._broadcast("set_adapter", tensors, name=name, version=version)

    def add_adapter(self, name: str, source) -> None:
        """Load adapter ``name`` from a PEFT directory (every engine reads it) or from tensors."""
        if self.placement == "inprocess":
            for e in self.engines:
                e.add_adapter(name, source)
        elif isinstance(source, dict):
            self._broadcast("add_adapter", source, name=name)
        else:
            self._broadcast("add_adapter", name=name, path=str(source))

    def read_weights(self, names: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each engine's own copy of the named tensors (from its process when it has one)."""
        if self.placement == "process":
            return [e.read_weights(names) for e in self.engines]
        out = []
        for e in self.engines:
            params = dict(e.model.named_parameters()) | dict(e.model.named_buffers())
            out.append({n: params[n].detach().clone() for n in names})
        return out

    def close(self) -> None:
        """Stop the engine processes (nothing to do in process); idempotent."""
        for e in self.engines:
            if isinstance(e, EngineProcess):
                e.close()
        self.weights.close()
        _live.discard(self)


@atexit.register
def _close_all() -> None:  # engines never outlive the program, however the loop ended
    for pool in list(_live):
        pool.close()
