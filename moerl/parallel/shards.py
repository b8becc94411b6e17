"""Sharded checkpoints with ``torch.distributed.checkpoint``: every rank writes its own part of the trained weights
and optimizer state (FSDP shards, expert slices, pipeline stages) as safetensors files whose header records each
part's offset in the whole tensor (DCP's Hugging Face storage; no pickled metadata), and any layout — one process
included — reads back the parts it needs (DCP plans the reads from the files' headers).

Names: ``weights/{name}`` and ``optim/{name}/{state key}``, as in a whole-tensor checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor

SHARDS = "shards"


def shard_state(layout, trained: dict[str, torch.Tensor], opt_state: dict) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpointed tensors, by checkpoint name: the ``trained`` tensors (by name, in the
    optimizer's order) and their optimizer ``opt_state`` (by index), each as DCP must see it."""
    out = {}
    for i, (name, p) in enumerate(trained.items()):
        if name in layout.copies:  # written by the stage that holds the original
            continue
        out[f"weights/{name}"] = layout.global_view(name, p.detach())
        for key, value in opt_state.get(i, {}).items():
            out[f"optim/{name}/{key}"] = layout.global_view(name, value)
    return out


def save_shards(layout, trained: dict[str, torch.Tensor], opt_state: dict, directory: Path) -> None:
    """Every rank writes its part of the trained tensors and their optimizer state under ``directory`` (a
    collective). Rank 0 makes the directory (after clearing the save's place); the others open it once it is
    there."""
    if layout.world.driver:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
    dcp.save(shard_state(layout, trained, opt_state), storage_writer=writer)


def saved_sizes(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Whole shape and dtype of every tensor of a sharded checkpoint, from its files' headers."""
    meta = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    return {k: (m.size, m.properties.dtype) for k, m in meta.items()}


def load_whole(directory: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``keys`` of a sharded checkpoint, whole (what one process loads)."""
    sizes = saved_sizes(directory)
    dest = {k: torch.full(sizes[k][0], math.nan, dtype=sizes[k][1]) for k in keys}
    dcp.load(dest, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=True)
    return dest


def load_parts(layout, trained: dict[str, torch.Tensor], directory: Path, keys: dict[str, str]):
    """This rank's parts of tensors ``keys`` ({checkpoint key: weight name}) laid out as this rank holds the weight
    in ``trained`` (a collective): FSDP shards as DTensors, expert slices and the rest as plain tensors."""
    sizes = saved_sizes(directory)
    dest = {}
    for key, name in keys.items():
        shape, dtype = sizes[key]
        # NaN until read: a part the read missed is refused as non-finite, never loaded as stale memory
        if not shape:  # e.g. AdamW's step count
            dest[key] = torch.full((), math.nan, dtype=dtype)
        elif isinstance(trained[name], DTensor):
            dest[key] = torch.full_like(trained[name], math.nan, dtype=dtype)
        else:
            dest[key] = layout.global_view(name, torch.full_like(trained[name], math.nan, dtype=dtype))
    dcp.load(dest, storage_reader=HuggingFaceStorageReader(str(directory)))
    return {k: layout.own_part(keys[k], v) for k, v in dest.items()}
