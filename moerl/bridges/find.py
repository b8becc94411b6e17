"""The bridge of a checkpoint, and models loaded and exported through it: its architecture's bridge file
(``moerl.bridges.registry``), else one derived from its config and proven against transformers first
(``moerl.bridges.prove``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from moerl.bridges.base import Bridge
from moerl.bridges.checkpoint import read_config, read_model, write_model
from moerl.bridges.registry import bridge_file, supported
from moerl.errors import CheckpointError, UnknownArchitectureError
from moerl.model.transformer import MoEModel


def get_bridge(hf_config: dict, source: str = "config.json") -> Bridge:
    """The bridge for a config.json dict, from its ``architectures`` list."""
    archs = hf_config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise UnknownArchitectureError(
            f"{source}: field 'architectures' is missing or not a list; supported: {', '.join(supported())}"
        )
    if (bridge := bridge_file(archs[0])) is not None:
        return bridge
    from moerl.bridges.prove import derived_bridge  # no bridge file: derive one and prove it first

    try:
        return derived_bridge(hf_config)
    except UnknownArchitectureError as e:
        raise UnknownArchitectureError(
            f"{source}: no bridge file for architecture {archs[0]!r} (bridges: {', '.join(supported())}), and {e}"
        ) from None


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    bridge: Bridge | None = None,
    experts: tuple[int, int] | None = None,
    reads: list | None = None,
    keep: Callable[[MoEModel], object] | None = None,
) -> MoEModel:
    """Load a HF checkpoint directory into a MoEModel (``moerl.bridges.checkpoint.read_model``) through its bridge,
    or ``bridge``; ``experts`` = (rank, ranks): only that expert-parallel rank's share of the experts; ``keep``:
    removes from the meta model what this rank does not hold (never read); ``reads`` gets (tensor name, bytes) of
    what was read."""
    bridge = bridge or get_bridge(read_config(path), source=str(Path(path) / "config.json"))
    return read_model(path, bridge, dtype, device, experts, reads, keep)


def export_model(
    model: MoEModel,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` as a HF checkpoint directory through its config's bridge (``checkpoint.write_model``):
    config.json, (sharded) safetensors, tokenizer files. ``state_dict`` replaces the model's own weights (e.g. with
    LoRA merged in); LoRA tensors are never written."""
    if model.hf_config is None:
        raise CheckpointError("the model has no hf_config: load it with load_model or build it with init_model")
    bridge = get_bridge(model.hf_config, source="model.hf_config")
    return write_model(model, bridge, out_dir, tokenizer_dir, max_shard_bytes, state_dict)
