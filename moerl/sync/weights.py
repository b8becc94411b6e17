"""What a policy sends to the engine, by mode, and the in-process transfer in buckets.

- lora: the adapter tensors only (one slot, moerl names), loaded into the engine's adapter ``policy``.
- full: every weight in the trainer's compute dtype, the router (and its correction bias) in fp32, bit for bit.
- mxfp8: the GEMM weights as E4M3 data + E8M0 scales from the same quantizer the trainer uses, the rest as in
  full; the engine dequantizes on apply.

An engine that serves neither adapters nor MX weights (vLLM: ``engine.dense_weights`` names its dtype) gets the
*dense* form, a full-mode update: lora sends the weights the adapters touch merged (W + scale * B @ A summed in
fp32, sent in the engine's dtype; the router untouched, moerl puts no adapter on it), mxfp8 sends
``dequantize(quantize(master))`` in bf16 (which holds every E4M3 x E8M0 value exactly), so the engine multiplies
with exactly the MX-rounded weights the trainer uses (its activations stay unquantized).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from moerl.errors import TrainingStopped
from moerl.finite import first_nonfinite
from moerl.model.lora import merged_weights, slot_tensors
from moerl.model.mx import BLOCK, MX_SCALE, MXExperts, MXLinear, mx_fake_quant, mx_quantize

ADAPTER = "policy"


@dataclass(slots=True)
class SyncStats:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float


def _is_router(name: str) -> bool:
    return ".router." in name


def _mx_weight(name: str, model) -> bool:
    """Weights whose GEMMs the trainer quantizes (and so are sent quantized): MX linear layers and experts."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return isinstance(module, MXLinear | MXExperts) and name.endswith(("weight", "gate_up_proj", "down_proj"))


def policy_tensors(policy, dense: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors the engine needs for ``policy``'s current weights, one at a time (``dense``: the dtype name
    of an engine without adapters or MX weights, which gets the dense form, see the module). A sharded policy
    gathers each one whole as it goes (a collective: every rank runs this iterator to its end), so the whole model
    is never on one rank at once."""
    return policy.layout.stream(_own_tensors(policy, dense))


def _own_tensors(policy, dense: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of ``policy_tensors`` (each tensor whole over the data and expert groups)."""
    layout = policy.layout
    if policy.cfg.mode == "lora":  # small: the adapters, gathered together (the base experts only to merge)
        with layout.gathered_here(base=bool(dense)):
            if dense:  # the touched weights, merged: one module's at a time
                merged = merged_weights(policy.model, 0, getattr(torch, dense))
                yield from ((n, layout.whole(n, t)) for n, t in merged)
            else:
                yield from slot_tensors(policy.model, 0).items()
        return
    masters = policy.master.master
    for name, master in masters.items():
        if name in layout.copies:  # sent by the stage that holds the original
            continue
        t = layout.whole(name, master.detach())
        if _is_router(name):
            yield name, t.float()
        elif policy.cfg.mode == "mxfp8" and _mx_weight(name, policy.model):
            if t.shape[-1] % BLOCK == 0 and not dense:
                scale, data = mx_quantize(t, policy.cfg.mx_scale_mode)
                yield name, data
                yield name + MX_SCALE, scale
            else:  # a ragged last block, or a dense engine: the MX values themselves (bf16 holds them exactly)
                yield name, mx_fake_quant(t, -1, policy.cfg.mx_scale_mode).to(torch.bfloat16)
        else:
            # in the compute dtype; in one process the model holds round(master) already
            own = policy.master.model_params[name]
            # not an FSDP shard, not an expert-parallel slice
            whole = not isinstance(own, DTensor) and own.dtype == policy.dtype and own.shape == t.shape
            yield name, own.detach() if whole else t.to(policy.dtype)
    for name, buf in policy.model.named_buffers():  # e.g. the selection-only router bias
        yield name, buf.detach().clone()


def buckets(tensors, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Groups of named tensors (a dict, or ``(name, tensor)`` pairs in order) of at most ``bucket_bytes`` (a larger
    tensor travels alone); an MX scale, which follows its data, stays in its data's bucket."""
    bucket, size = {}, 0
    for name, t in tensors.items() if isinstance(tensors, dict) else tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes and not name.endswith(MX_SCALE):
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def sync_policy(policy, engine, version: int, bucket_bytes: int = 64 * 2**20) -> SyncStats:
    """Push ``policy``'s weights to ``engine`` and tag them ``version``; applied atomically. Each bucket is checked
    for non-finite values before it is staged; a bad one discards what was staged, so the engine keeps its weights."""
    start = time.perf_counter()
    dense = getattr(engine, "dense_weights", None)
    stream = policy.sync_tensors(dense)
    count = nbytes = n_buckets = 0
    try:
        if policy.cfg.mode == "lora" and not dense:
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
