"""What a weight sync sends per training mode, and what a native rollout engine holds, from the model's shapes on the
meta device (nothing allocated): the sizes the sync and the engine compute when they run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moerl.model.config import ModelConfig
from moerl.modes import mode_of
from moerl.run_config import RunConfig


def _meta_model(cfg: ModelConfig, dtype: torch.dtype):
    from moerl.model.transformer import MoEModel

    with torch.device("meta"):
        return MoEModel(cfg, dtype)


def _nbytes(shape, itemsize: int) -> int:
    return math.prod(shape) * itemsize


def _weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> tuple[dict[str, int], int]:
    """Each parameter's bytes in ``dtype`` (the routers in fp32, as every engine keeps them), and the buffers'."""
    params = {n: _nbytes(t.shape, 4 if ".router." in n else dtype.itemsize) for n, t in model.named_parameters()}
    return params, sum(_nbytes(t.shape, t.element_size()) for t in model.buffers())


def sync_bytes(cfg: ModelConfig, run: RunConfig) -> dict[str, int | None]:
    """Bytes one weight sync sends, per mode: full the weights in the compute dtype with the routers in fp32; lora one
    adapter slot (fp32); mxfp8 the MX weights as E4M3 data and E8M0 scales (one per 32), the rest as full does
    (None where this host cannot build the mode's modules: mxfp8 without torchao)."""
    from moerl.model.lora import attach_lora, slot_tensors
    from moerl.precision import dtype_name

    dtype = getattr(torch, dtype_name(run.policy.dtype)) if run.policy.dtype != "auto" else torch.bfloat16
    out: dict[str, int | None] = {}
    model = _meta_model(cfg, dtype)
    dense, buffers = _weight_bytes(model, dtype)
    out["full"] = sum(dense.values()) + buffers
    attach_lora(model, run.policy.lora, dtype=torch.float32)
    out["lora"] = sum(_nbytes(t.shape, t.element_size()) for t in slot_tensors(model, 0).values())
    out["mxfp8"] = _mx_bytes(cfg, dtype, dense, buffers)
    return out


def _mx_bytes(cfg: ModelConfig, dtype: torch.dtype, dense: dict[str, int], buffers: int) -> int | None:
    try:
        from moerl.model.mx import BLOCK, apply_mxfp8, quantized_weight

        model = _meta_model(cfg, dtype)
        apply_mxfp8(model)
    except Exception:  # noqa: BLE001 - torchao missing or unusable here: the figure is left out, not guessed
        return None
    total = buffers
    for name, t in model.named_parameters():
        if quantized_weight(name, model) and t.shape[-1] % BLOCK == 0:
            total += t.numel() + t.numel() // BLOCK  # one E4M3 byte per value, one E8M0 scale per block
        else:
            total += dense[name]
    return total


@dataclass(slots=True)
class EngineBytes:
    """A native engine's GPU memory: its weights, its KV cache (and linear-attention states) while it generates, and
    the weights a sync stages until it commits them."""

    weights: int
    kv: int
    staging: int


def engine_bytes(cfg: ModelConfig, run: RunConfig, sent: dict[str, int | None]) -> EngineBytes:
    """What a native engine of ``run`` holds (``sent``: ``sync_bytes``): the whole model in its dtype (routers fp32)
    and one adapter slot in lora mode; ``rollout.max_num_seqs`` sequences of ``rollout.max_model_len`` tokens of KV
    cache; a sync's staged tensors (mxfp8: dequantized to fp32 for the engine's bf16 weights)."""
    mode, r = mode_of(run.policy.mode), run.rollout
    dtype = torch.bfloat16 if r.dtype == "auto" else getattr(torch, r.dtype)
    model = _meta_model(cfg, dtype)
    dense, buffers = _weight_bytes(model, dtype)
    weights = sum(dense.values()) + buffers
    kv = _kv_bytes(cfg, r.max_num_seqs, r.max_model_len, dtype)
    if mode.adapter_slot is not None:  # the base, and one adapter slot
        weights += sent[mode.name]
        staging = sent[mode.name]
    elif mode.engine_mx(run.policy) is not None:
        staging = sum(_nbytes(t.shape, 4) for t in model.parameters())  # dequantized in fp32 as the buckets arrive
    else:
        staging = sent[mode.name]
    return EngineBytes(weights, kv, staging)


def _kv_bytes(cfg: ModelConfig, seqs: int, length: int, dtype: torch.dtype, block: int = 16) -> int:
    """The KV cache (and linear-attention state slots) the engine allocates for ``seqs`` sequences of ``length``
    tokens: its own classes, on the meta device."""
    from moerl.engine.kv_cache import KVCache, LinearStates
    from moerl.model.mixers import recurrent_layers

    cache = KVCache(cfg, seqs * math.ceil(length / block), block, dtype, device="meta")
    states = LinearStates(cfg, seqs, dtype, "meta").nbytes if recurrent_layers(cfg) else 0
    return cache.nbytes + states
