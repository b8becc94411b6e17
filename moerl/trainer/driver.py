"""Rank 0 drives, every rank trains: ``DistributedPolicy`` (rank 0) announces each collective call of the policy
to the other ranks, which ``serve`` it with the same call on their shard.

An announcement is one broadcast of a JSON header (the call and its arguments) and, for calls that take a batch,
one broadcast of the batch's tensors as bytes; nothing is pickled. Calls made inside an announced call are not
announced again (the other ranks make them too, inside theirs). When rank 0 stops (done, or an error), it
announces ``stop``; a rank that fails exits, and the launcher stops the others.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.errors import OutOfMemory, TrainingStopped
from moerl.parallel.world import broadcast_bytes
from moerl.rpc import Dispatcher
from moerl.trainer.batch import Batch
from moerl.trainer.policy import Policy


def _batch_tensors(batch: Batch) -> dict[str, torch.Tensor]:
    out = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "loss_mask": batch.loss_mask}
    if batch.replay is not None:
        out["replay"] = batch.replay
    return out | {f"extras/{k}": v for k, v in batch.extras.items()}


def _send(op: str, args: dict, batch: Batch | None = None) -> None:
    tensors = _batch_tensors(batch) if batch is not None else {}
    layout = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()]
    if batch is not None:
        args = args | {"total_tokens": batch.total_tokens, "total_seqs": batch.total_seqs}
    broadcast_bytes(json.dumps({"op": op, "args": args, "tensors": layout}).encode())
    if tensors:
        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])
        dist.broadcast(flat, 0)


def _recv() -> tuple[str, dict, Batch | None]:
    msg = json.loads(broadcast_bytes(None))
    args, layout = msg["args"], msg["tensors"]
    if not layout:
        return msg["op"], args, None
    dtypes = [getattr(torch, d) for _, d, _ in layout]
    sizes = [torch.Size(shape).numel() * d.itemsize for (_, _, shape), d in zip(layout, dtypes, strict=True)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.broadcast(flat, 0)
    tensors, at = {}, 0
    for (name, _, shape), dtype, size in zip(layout, dtypes, sizes, strict=True):
        tensors[name] = flat[at : at + size].view(dtype).view(shape).clone()
        at += size
    extras = {k.removeprefix("extras/"): v for k, v in tensors.items() if k.startswith("extras/")}
    batch = Batch(
        tensors["input_ids"],
        tensors["attention_mask"],
        tensors["loss_mask"],
        tensors.get("replay"),
        extras,
        total_tokens=args.pop("total_tokens"),
        total_seqs=args.pop("total_seqs"),
    )
    return msg["op"], args, batch


class DistributedPolicy(Policy):
    """Rank 0's policy: each collective call is announced to the other ranks before rank 0 makes it."""

    def __init__(self, *args, **kwargs):
        self._busy = False
        self._left_inside = False  # a call failed here alone: the other ranks are still inside it
        super().__init__(*args, **kwargs)

    @contextmanager
    def _announced(self, op: str, args: dict | None = None, batch: Batch | None = None):
        if self._busy:  # inside an announced call: the other ranks make this call inside theirs
            yield
            return
        _send(op, args or {}, batch)
        self._busy = True
        try:
            yield
        except OutOfMemory:  # this rank's own failure (a TrainingStopped the ranks raise alike, and return)
            self._left_inside = True
            raise
        finally:
            self._busy = False

    def forward_logprobs(self, batch, replay=True, reference=False, temperature=1.0, entropy=False):
        if isinstance(replay, torch.Tensor):
            from dataclasses import replace

            batch, replay = replace(batch, replay=replay), True
        kw = {"replay": replay, "reference": reference, "temperature": temperature, "entropy": entropy}
        with self._announced("forward_logprobs", kw, batch):
            return super().forward_logprobs(batch, **kw)

    def train_step(self, batch, loss_fn, replay=True, temperature=1.0, entropy=False):
        kw = {"replay": replay, "temperature": temperature, "entropy": entropy}
        stop = str(self.stop_checkpoint_dir) if self.stop_checkpoint_dir is not None else None
        with self._announced("train_step", kw | {"stop_checkpoint_dir": stop}, batch):
            return super().train_step(batch, loss_fn, **kw)

    def full_state(self):
        with self._announced("full_state"):
            return super().full_state()

    def nonfinite_weight(self):
        with self._announced("nonfinite_weight"):
            return super().nonfinite_weight()

    def save_stop_checkpoint(self) -> str:
        path = str(self.stop_checkpoint_dir) if self.stop_checkpoint_dir is not None else None
        with self._announced("save_stop_checkpoint", {"path": path}):
            return super().save_stop_checkpoint()

    def save_shards(self, directory) -> None:
        with self._announced("save_shards", {"path": str(directory)}):
            return super().save_shards(directory)

    def sync_tensors(self, dense: str | None = None):
        """The engine's tensors, gathered one at a time; the caller must exhaust the iterator (the other ranks
        gather with it)."""
        with self._announced("sync_tensors", {"dense": dense}):
            yield from super().sync_tensors(dense)

    def load(self, path) -> dict:
        with self._announced("load", {"path": str(path)}):
            return super().load(path)

    @contextmanager
    def gathered(self):
        announce = not self._busy
        with self._announced("unshard"), super().gathered() as model:
            yield model
        if announce:
            _send("reshard", {})

    def close(self) -> None:
        """Let the other ranks go (they return from ``serve``); not when they are inside a call this rank left (a
        broadcast would wait for them forever): this rank exits and the launcher stops them."""
        if not self._left_inside:
            _send("stop", {})


class RankServer:
    """What a rank other than 0 does for each call rank 0 announces: the same call on this rank's shard."""

    CALLS = (
        "forward_logprobs",
        "train_step",
        "full_state",
        "nonfinite_weight",
        "save_stop_checkpoint",
        "save_shards",
        "sync_tensors",
        "load",
        "unshard",
        "reshard",
    )

    def __init__(self, policy: Policy, loss_fn):
        self.policy, self.loss_fn, self.gathered = policy, loss_fn, None

    def forward_logprobs(self, batch, **args) -> None:
        self.policy.forward_logprobs(batch, **args)

    def train_step(self, batch, stop_checkpoint_dir, **args) -> None:
        self._stop_dir(stop_checkpoint_dir)  # a step that stops saves there: this rank writes its part
        self.policy.train_step(batch, self.loss_fn, **args)

    def full_state(self, batch) -> None:
        self.policy.full_state()

    def nonfinite_weight(self, batch) -> None:
        self.policy.nonfinite_weight()

    def save_stop_checkpoint(self, batch, path) -> None:
        self._stop_dir(path)
        self.policy.save_stop_checkpoint()

    def save_shards(self, batch, path) -> None:
        self.policy.save_shards(path)

    def sync_tensors(self, batch, dense: str | None = None) -> None:
        for _ in self.policy.sync_tensors(dense):  # every rank gathers each tensor with rank 0
            pass

    def load(self, batch, path) -> None:
        self.policy.load(path)

    def unshard(self, batch) -> None:
        self.gathered = self.policy.gathered()
        self.gathered.__enter__()

    def reshard(self, batch) -> None:
        self.gathered.__exit__(None, None, None)
        self.gathered = None

    def _stop_dir(self, path: str | None) -> None:
        self.policy.stop_checkpoint_dir = Path(path) if path is not None else None


def serve(policy: Policy, loss_fn) -> None:
    """Every rank but 0: make the calls rank 0 announces, on this rank's shard, until it says stop. A call that
    fails raises here: this rank exits and the launcher stops the others."""
    calls = Dispatcher(RankServer(policy, loss_fn), RankServer.CALLS, f"trainer rank {dist.get_rank()}")
    while True:
        op, args, batch = _recv()
        if op == "stop":
            return
        try:
            calls.call(op, batch, **args)
        except TrainingStopped:
            pass  # rank 0 stops the same way and says what next
