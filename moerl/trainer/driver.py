"""Rank 0 drives, every rank trains: ``DistributedPolicy`` (rank 0) announces each collective call of the policy
to the other ranks, which ``serve`` it with the same call on their shard.

The calls are declared once, as ``DistributedPolicy``'s ``announced`` attributes; a rank serves them by name
(``ANNOUNCED``). An announcement is one broadcast of a JSON header (the call, its JSON arguments, the policy's
``stop_checkpoint_dir``) and, for calls that take a batch or a tensor, one broadcast of their tensors as bytes;
nothing is pickled. Each rank passes its own loss function. A call that yields is run to its end on every rank; a
context (``gathered``) is entered with rank 0's and left when rank 0 leaves it. Calls made inside an announced call
are not announced again (the other ranks make them too, inside theirs). When rank 0 stops (done, or an error), it
announces ``stop``; a rank that fails exits, and the launcher stops the others.
"""

from __future__ import annotations

import inspect
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

BATCH = ("input_ids", "attention_mask", "loss_mask", "replay")


def _send(op: str, args: dict, batch: Batch | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Announce call ``op``: ``args`` (JSON), ``batch`` and other ``tensors`` (by argument name)."""
    sent = {f"arg/{k}": t for k, t in (tensors or {}).items()}
    if batch is not None:
        sent |= {k: getattr(batch, k) for k in BATCH if getattr(batch, k) is not None}
        sent |= {f"extras/{k}": v for k, v in batch.extras.items()}
        args = args | {"total_tokens": batch.total_tokens, "total_seqs": batch.total_seqs}
    layout = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in sent.items()]
    broadcast_bytes(json.dumps({"op": op, "args": args, "tensors": layout}).encode())
    if sent:
        dist.broadcast(torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in sent.values()]), 0)


def _recv() -> tuple[str, dict]:
    """The next announced call: its name and its arguments (the batch and tensors among them)."""
    msg = json.loads(broadcast_bytes(None))
    args, layout = msg["args"], msg["tensors"]
    if not layout:
        return msg["op"], args
    dtypes = [getattr(torch, d) for _, d, _ in layout]
    sizes = [torch.Size(shape).numel() * d.itemsize for (_, _, shape), d in zip(layout, dtypes, strict=True)]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.broadcast(flat, 0)
    got, at = {}, 0
    for (name, _, shape), dtype, size in zip(layout, dtypes, sizes, strict=True):
        got[name] = flat[at : at + size].view(dtype).view(shape).clone()
        at += size
    args |= {k.removeprefix("arg/"): v for k, v in got.items() if k.startswith("arg/")}
    if "input_ids" in got:
        extras = {k.removeprefix("extras/"): v for k, v in got.items() if k.startswith("extras/")}
        fields = [got.get(k) for k in BATCH]
        args["batch"] = Batch(*fields, extras, total_tokens=args.pop("total_tokens"), total_seqs=args.pop("total_seqs"))
    return msg["op"], args


def announced(name: str, context: bool = False):
    """``Policy.<name>`` for rank 0: announced, then made (``context``: it returns a context manager; a generator
    function yields inside the announcement)."""
    plain = getattr(Policy, name)
    signature = inspect.signature(plain)

    def message(self, args, kwargs) -> tuple[dict, Batch | None, dict]:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        json_args, batch, tensors = {}, None, {}
        for key, value in list(bound.arguments.items())[1:]:
            if isinstance(value, Batch):
                batch = value
            elif isinstance(value, torch.Tensor):
                tensors[key] = value
            elif key != "loss_fn":  # each rank passes its own
                json_args[key] = str(value) if isinstance(value, Path) else value
        stop = self.stop_checkpoint_dir
        return json_args | {"stop_checkpoint_dir": str(stop) if stop is not None else None}, batch, tensors

    if context:

        @contextmanager
        def call(self, *args, **kwargs):
            first = not self._busy
            with self._announced(name, *message(self, args, kwargs)), plain(self, *args, **kwargs) as value:
                yield value
            if first:
                _send("leave", {})

    elif inspect.isgeneratorfunction(plain):

        def call(self, *args, **kwargs):
            with self._announced(name, *message(self, args, kwargs)):
                yield from plain(self, *args, **kwargs)

    else:

        def call(self, *args, **kwargs):
            with self._announced(name, *message(self, args, kwargs)):
                return plain(self, *args, **kwargs)

    call.__name__, call.__doc__ = name, plain.__doc__
    call.announced = True
    return call


class DistributedPolicy(Policy):
    """Rank 0's policy: each collective call is announced to the other ranks before rank 0 makes it."""

    forward_logprobs = announced("forward_logprobs")
    train_step = announced("train_step")
    full_state = announced("full_state")
    nonfinite_weight = announced("nonfinite_weight")
    save_stop_checkpoint = announced("save_stop_checkpoint")
    save_shards = announced("save_shards")
    sync_tensors = announced("sync_tensors")  # the caller must exhaust it: the other ranks gather with it
    load = announced("load")
    gathered = announced("gathered", context=True)

    def __init__(self, *args, **kwargs):
        self._busy = False
        self._left_inside = False  # a call failed here alone: the other ranks are still inside it
        super().__init__(*args, **kwargs)

    @contextmanager
    def _announced(self, op: str, args: dict, batch: Batch | None, tensors: dict):
        if self._busy:  # inside an announced call: the other ranks make this call inside theirs
            yield
            return
        _send(op, args, batch, tensors)
        self._busy = True
        try:
            yield
        except OutOfMemory:  # this rank's own failure (a TrainingStopped the ranks raise alike, and return)
            self._left_inside = True
            raise
        finally:
            self._busy = False

    def close(self) -> None:
        """Let the other ranks go (they return from ``serve``); not when they are inside a call this rank left (a
        broadcast would wait for them forever): this rank exits and the launcher stops them."""
        if not self._left_inside:
            _send("stop", {})


ANNOUNCED = tuple(n for n, v in vars(DistributedPolicy).items() if getattr(v, "announced", False))
WITH_LOSS = frozenset(n for n in ANNOUNCED if "loss_fn" in inspect.signature(getattr(Policy, n)).parameters)


def serve(policy: Policy, loss_fn) -> None:
    """Every rank but 0: make the calls rank 0 announces, on this rank's shard, until it says stop. A call that
    fails raises here: this rank exits and the launcher stops the others."""
    calls = Dispatcher(policy, ANNOUNCED, f"trainer rank {dist.get_rank()}")
    entered = []  # the contexts rank 0 is inside
    while True:
        op, args = _recv()
        if op == "stop":
            return
        if op == "leave":
            entered.pop().__exit__(None, None, None)
            continue
        stop = args.pop("stop_checkpoint_dir")  # a call that stops saves there: this rank writes its part
        policy.stop_checkpoint_dir = Path(stop) if stop is not None else None
        if op in WITH_LOSS:
            args["loss_fn"] = loss_fn
        try:
            made = calls.call(op, **args)
            if inspect.isgenerator(made):
                for _ in made:  # every rank gathers each tensor with rank 0
                    pass
            elif hasattr(made, "__enter__"):
                made.__enter__()
                entered.append(made)
        except TrainingStopped:
            pass  # rank 0 stops the same way and says what next
