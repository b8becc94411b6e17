"""What a policy sends to the engine, by mode, and the in-process transfer in buckets.

- lora: the adapter tensors only (one slot, moerl names), loaded into the engine's adapter ``policy``.
- full: every weight in bf16, the router (and its correction bias) in fp32, bit for bit.
- mxfp8: the GEMM weights as E4M3 data + E8M0 scales from the same quantizer the trainer uses, the rest as in
  full; the engine dequantizes on apply.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moerl.errors import TrainingStopped
from moerl.finite import all_finite
from moerl.model.lora import slot_tensors
from moerl.model.mx import BLOCK, MX_SCALE, mx_fake_quant, mx_quantize

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
    return getattr(module, "mx", None) is not None and name.endswith(("weight", "gate_up_proj", "down_proj"))


def policy_tensors(policy) -> dict[str, torch.Tensor]:
    """The named tensors the engine needs for ``policy``'s current weights."""
    if policy.cfg.mode == "lora":
        return slot_tensors(policy.model, 0)
    out = {}
    masters = policy.master.master
    for name, master in masters.items():
        t = master.detach()
        if _is_router(name):
            out[name] = t.float()
        elif policy.cfg.mode == "mxfp8" and _mx_weight(name, policy.model):
            if t.shape[-1] % BLOCK == 0:
                scale, data = mx_quantize(t, policy.cfg.mx_scale_mode)
                out[name], out[name + MX_SCALE] = data, scale
            else:  # a ragged last block: send the MX values themselves (bf16 holds them exactly)
                out[name] = mx_fake_quant(t, -1, policy.cfg.mx_scale_mode).to(torch.bfloat16)
        else:
            own = policy.master.model_params[name]  # bf16 compute: the model already holds round(master)
            out[name] = own.detach() if own.dtype == torch.bfloat16 else t.to(torch.bfloat16)
    for name, buf in policy.model.named_buffers():  # e.g. the selection-only router bias
        out[name] = buf.detach().clone()
    return out


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Groups of tensors of at most ``bucket_bytes`` (a larger tensor travels alone); MX scales stay with data."""
    bucket, size = {}, 0
    for name, t in tensors.items():
        if name.endswith(MX_SCALE):
            continue
        group = {name: t} | ({name + MX_SCALE: tensors[name + MX_SCALE]} if name + MX_SCALE in tensors else {})
        nbytes = sum(x.numel() * x.element_size() for x in group.values())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket |= group
        size += nbytes
    if bucket:
        yield bucket


def sync_policy(policy, engine, version: int, bucket_bytes: int = 64 * 2**20) -> SyncStats:
    """Push ``policy``'s weights to ``engine`` (in process) and tag them ``version``; applied atomically."""
    start = time.perf_counter()
    tensors = policy_tensors(policy)
    for name, t in tensors.items():  # checked before the first bucket leaves: the engine keeps its weights
        if not all_finite(t):
            raise TrainingStopped(
                f"weight sync of version {version}: tensor {name!r} holds non-finite values; not pushed to the engine "
                f"(it keeps version {engine.weight_version})"
            )
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if policy.cfg.mode == "lora":
        engine.set_adapter(ADAPTER, tensors, version)
        n_buckets = 1
    else:
        n_buckets = 0
        engine.discard_staged()
        for bucket in buckets(tensors, bucket_bytes):
            engine.stage_weights(bucket)
            n_buckets += 1
        engine.commit_weights(version)
    return SyncStats(version, len(tensors), nbytes, n_buckets, time.perf_counter() - start)
