"""Training checkpoints: weights (adapters or fp32 masters), optimizer state, LR schedule, RNG states, step and
the caller's own state (e.g. the data position). safetensors for tensors, JSON for the rest; never pickle."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from moerl.errors import CheckpointError

TENSORS, META = "checkpoint.safetensors", "checkpoint.json"


def _param_names(policy) -> list[str]:
    """Names in the optimizer's parameter order."""
    return list(policy.master.master if policy.master is not None else policy.trainable)


def save_checkpoint(path: str | os.PathLike, policy, state: dict | None = None) -> Path:
    """Write a resumable checkpoint to ``path`` (written aside, then moved into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {f"weights/{n}": t.contiguous() for n, t in policy.trainable_state().items()}
    opt = policy.optimizer.state_dict()
    names = _param_names(policy)
    for idx, st in opt["state"].items():
        for key, value in st.items():
            tensors[f"optim/{names[idx]}/{key}"] = value.contiguous()
    tensors["rng/torch"] = torch.get_rng_state()
    np_state = np.random.get_state()
    meta = {
        "mode": policy.cfg.mode,
        "step": policy.step,
        "nan_skipped": policy.nan_skipped,
        "nan_streak": policy.nan_streak,
        "param_groups": opt["param_groups"],
        "scheduler": {k: v for k, v in policy.scheduler.state_dict().items() if k != "lr_lambdas"},
        "python_random": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "state": state or {},
    }
    save_file(tensors, tmp / TENSORS)
    (tmp / META).write_text(json.dumps(meta))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, policy) -> dict:
    """Restore ``policy`` (built with the same config) from ``path``; returns the caller's saved state."""
    path = Path(path)
    for f in (TENSORS, META):
        if not (path / f).exists():
            raise CheckpointError(f"{path / f} does not exist: not a moerl training checkpoint")
    meta = json.loads((path / META).read_text())
    if meta["mode"] != policy.cfg.mode:
        raise CheckpointError(f"{path} was saved in mode {meta['mode']!r}, this policy is {policy.cfg.mode!r}")
    tensors = load_file(path / TENSORS)
    own = policy.master.master if policy.master is not None else policy.trainable
    saved = {k.removeprefix("weights/") for k in tensors if k.startswith("weights/")}
    if saved != set(own):
        missing, extra = sorted(set(own) - saved)[:3], sorted(saved - set(own))[:3]
        raise CheckpointError(f"{path}: weights do not match this policy (missing {missing}, unexpected {extra})")
    for name, p in own.items():
        t = tensors[f"weights/{name}"]
        if t.shape != p.shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        p.copy_(t)
    if policy.master is not None:
        policy.master.master_to_model()
    names = _param_names(policy)
    state = {}
    for idx, name in enumerate(names):
        keys = {k.rsplit("/", 1)[1] for k in tensors if k.startswith(f"optim/{name}/")}
        if keys:
            state[idx] = {k: tensors[f"optim/{name}/{k}"] for k in keys}
    policy.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    policy.scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})  # the lambdas come from config
    torch.set_rng_state(tensors["rng/torch"])
    py = meta["python_random"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npr = meta["numpy_random"]
    np.random.set_state((npr[0], np.array(npr[1], dtype=np.uint32), *npr[2:]))
    policy.step, policy.nan_skipped, policy.nan_streak = meta["step"], meta["nan_skipped"], meta["nan_streak"]
    return meta["state"]
