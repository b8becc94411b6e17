"""Training checkpoints: weights (adapters or fp32 masters), optimizer state, LR schedule, RNG states, step and
the caller's own state (e.g. the data position). safetensors for tensors, JSON for the rest; never pickle.

A save never passes through a moment with no complete checkpoint on disk: the new one is written beside the old
(``<dir>.tmp``) and fsynced, the old one is renamed aside (``<dir>.old``), the new one renamed into place, then the
old one removed. A crash at any point leaves a complete checkpoint under one of the three names;
:func:`recover_checkpoint` finds it (and puts it back in place). The JSON records the size and SHA-256 of the
tensor file, so a truncated or corrupt checkpoint is refused on load with the file and the fault named.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moerl.errors import CheckpointError
from moerl.finite import all_finite
from moerl.parallel.shards import SHARDS, load_parts, load_whole, saved_sizes
from moerl.parallel.world import local

TENSORS, META = "checkpoint.safetensors", "checkpoint.json"
META_KEYS = ("mode", "step", "nan_skipped", "nan_streak", "param_groups", "scheduler", "python_random", "numpy_random")


def _crash_point(name: str) -> None:
    """A named point of a save where tests kill the process (replaced in a child process by the crash tests)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: renames, new files) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _aside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def shards_of_save(path: str | os.PathLike) -> Path:
    """Where the ranks of a sharded policy write their parts while checkpoint ``path`` is being saved."""
    return _aside(Path(path), ".tmp") / SHARDS


def rng_state() -> dict:
    """The RNG streams a checkpoint holds, as they are now: torch's, each CUDA device's (where CUDA is in use),
    numpy's and Python's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(), "python": random.getstate()}


def save_checkpoint(path: str | os.PathLike, policy, state: dict | None = None, rng: dict | None = None) -> Path:
    """Write a resumable checkpoint to ``path``, replacing the one there atomically (see the module docstring). A
    disk that is full or read-only is a CheckpointError naming it; the last complete checkpoint stays. ``rng``: the
    RNG streams to save (``rng_state``, taken where ``state`` was reached), else those of now."""
    path = Path(path)
    try:
        return _save(path, policy, state, rng or rng_state())
    except (OSError, SafetensorError) as e:  # safetensors reports the OS's error as its own
        shutil.rmtree(_aside(path, ".tmp"), ignore_errors=True)  # the partial save; the complete one is untouched
        where = path.parent if path.parent.exists() else Path(".")
        free = shutil.disk_usage(where).free
        kept = f"the last complete checkpoint {path} is kept" if path.exists() else "no earlier checkpoint to keep"
        raise CheckpointError(
            f"saving checkpoint {path} failed: {getattr(e, 'strerror', None) or e} ({where} has "
            f"{free / 2**20:.1f} MiB free); {kept}"
        ) from None


def _save(path: Path, policy, state: dict | None, rng: dict) -> Path:
    tmp, old = _aside(path, ".tmp"), _aside(path, ".old")
    recover_checkpoint(path)  # a crash of an earlier save: put its complete checkpoint back in place first
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = {}
    if policy.layout.ranks > 1:  # every rank writes its part (DCP); rank 0 the rest
        policy.save_shards(shards_of_save(path))
        _crash_point("shards written")
        tensors = {}
        files = sorted((tmp / SHARDS).iterdir())
        for f in files:
            _fsync(f)
        shards = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files}
        _fsync(tmp / SHARDS)
    else:
        weights, opt = policy.full_state()
        tensors = {f"weights/{n}": t.contiguous() for n, t in weights.items()}
        names = list(weights)
        for idx, st in opt["state"].items():
            for key, value in st.items():
                tensors[f"optim/{names[idx]}/{key}"] = value.contiguous()
    tensors["rng/torch"] = rng["torch"]
    tensors |= {f"rng/cuda/{i}": s for i, s in enumerate(rng["cuda"])}  # dropout and sampling on the GPUs draw these
    np_state, py_state = rng["numpy"], rng["python"]
    save_file(tensors, tmp / TENSORS)
    _fsync(tmp / TENSORS)
    _crash_point("tensors written")
    meta = {
        **policy.state_dict(),
        "python_random": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "state": state or {},
        "tensors_bytes": (tmp / TENSORS).stat().st_size,
        "tensors_sha256": _sha256(tmp / TENSORS),
        "shards": shards,  # sharded weights and optimizer state (under shards/), or {} when TENSORS holds them
    }
    (tmp / META).write_text(json.dumps(meta))  # written last: a checkpoint without it is incomplete
    _fsync(tmp / META)
    _fsync(tmp)
    _crash_point("new checkpoint complete")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        _crash_point("old checkpoint moved aside")
    tmp.rename(path)
    _fsync(path.parent)
    _crash_point("new checkpoint in place")
    shutil.rmtree(old, ignore_errors=True)
    _crash_point("done")
    return path


def read_meta(path: str | os.PathLike) -> dict:
    """The JSON part of checkpoint ``path``, checked; CheckpointError names the file and what is wrong."""
    path = Path(path)
    for f in (META, TENSORS):
        if not (path / f).exists():
            raise CheckpointError(f"{path / f} does not exist: not a complete moerl training checkpoint")
    try:
        meta = json.loads((path / META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / META} is not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path / META}: expected a JSON object, got {type(meta).__name__}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"{path / META} lacks the key(s) {missing}: not a complete moerl training checkpoint")
    size = (path / TENSORS).stat().st_size
    if "tensors_bytes" in meta and size != meta["tensors_bytes"]:
        raise CheckpointError(
            f"{path / TENSORS} has {size} bytes, {META} records {meta['tensors_bytes']}: the file is truncated or "
            "was replaced"
        )
    for name, rec in meta.get("shards", {}).items():
        f = path / SHARDS / name
        if not f.exists() or f.stat().st_size != rec["bytes"]:
            got = f"{f.stat().st_size} bytes" if f.exists() else "no file"
            raise CheckpointError(f"{f}: {META} records {rec['bytes']} bytes, found {got}: truncated or missing")
    return meta


def _complete(path: Path) -> bool:
    try:
        read_meta(path)
    except (CheckpointError, OSError):
        return False
    return True


def recover_checkpoint(path: str | os.PathLike, dry_run: bool = False) -> tuple[Path | None, str | None]:
    """Where the complete checkpoint of ``path`` is after an interrupted save, and a note of what was (or, with
    ``dry_run``, would be) done: ``path`` itself; or a complete ``<path>.tmp`` (the crash came between the two
    renames) or ``<path>.old`` moved into place. Leftovers of the interrupted save are removed. ``(None, None)``
    when there is no complete checkpoint under any of the three names."""
    path = Path(path)
    tmp, old = _aside(path, ".tmp"), _aside(path, ".old")
    found = next((p for p in (path, tmp, old) if _complete(p)), None)
    leftovers = [p for p in (tmp, old) if p.exists() and p != found]
    note = None
    if found is not None and found != path:
        note = f"recovered the complete checkpoint {found.name} left by an interrupted save"
    elif leftovers:
        note = f"removed {', '.join(p.name for p in leftovers)} left by an interrupted save"
    if dry_run or found is None:
        return found, note
    if found != path:
        shutil.rmtree(path, ignore_errors=True)
        found.rename(path)
        _fsync(path.parent)
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True)
    return path, note


def _load_tensors(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    file = path / TENSORS
    if "tensors_sha256" in meta and _sha256(file) != meta["tensors_sha256"]:
        raise CheckpointError(f"{file} is corrupt: its SHA-256 differs from the one {META} recorded at save")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    if "rng/torch" not in tensors:
        raise CheckpointError(f"{file} lacks the tensor 'rng/torch': not a complete moerl training checkpoint")
    return tensors


def _check_shards(path: Path, meta: dict) -> None:
    for name, rec in meta["shards"].items():
        if _sha256(path / SHARDS / name) != rec["sha256"]:
            raise CheckpointError(
                f"{path / SHARDS / name} is corrupt: its SHA-256 differs from the one {META} recorded"
            )


def _check_finite(policy, path: Path, parts: dict[str, torch.Tensor], every: list[str]) -> None:
    """Refuse non-finite values, naming the first bad tensor in ``every`` (the checkpoint's keys, the same list on
    every rank: the ranks agree on which)."""
    first = next((i for i, k in enumerate(every) if k in parts and not all_finite(local(parts[k]))), len(every))
    first = policy.layout.agreed_min(first)
    if first < len(every):
        bad = every[first]
        raise CheckpointError(f"{path}: tensor {bad!r} holds non-finite values (NaN or inf); refusing to load it")


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, policy) -> dict:
    """Restore ``policy`` (built with the same config) from ``path``; returns the caller's saved state.

    The state (weights, optimizer moments, step, schedule position, RNGs) comes from the checkpoint; the optimizer's
    hyperparameters (learning rate, weight decay, betas, eps) come from ``policy.cfg``, so a resume may change them.
    Nothing of ``policy`` changes unless every check passes.
    """
    path = Path(path)
    meta = read_meta(path)
    if meta["mode"] != policy.cfg.mode:
        raise CheckpointError(f"{path} was saved in mode {meta['mode']!r}, this policy is {policy.cfg.mode!r}")
    tensors = _load_tensors(path, meta)
    shards = path / SHARDS
    own, layout = policy.trained, policy.layout
    if meta.get("shards"):
        _check_shards(path, meta)
        sizes = saved_sizes(shards)
        whole = {k: v[0] for k, v in sizes.items()}
    else:
        whole = {k: v.shape for k, v in tensors.items()}
    saved = {k.removeprefix("weights/") for k in whole if k.startswith("weights/")}
    if saved != set(policy.all_names):  # the whole model's, whatever part of it this rank holds
        missing, extra = sorted(set(policy.all_names) - saved)[:3], sorted(saved - set(policy.all_names))[:3]
        raise CheckpointError(f"{path}: weights do not match this policy (missing {missing}, unexpected {extra})")
    for name, p in own.items():
        shape, expected = whole[f"weights/{name}"], layout.whole_shape(name, p)
        if shape != expected:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)}")
    names = list(own)  # the optimizer's order
    wanted = {f"weights/{n}": n for n in names}
    wanted |= {k: n for n in names for k in whole if k.startswith(f"optim/{n}/")}
    if meta.get("shards") and layout.ranks > 1:
        parts = load_parts(layout, own, shards, wanted)  # this rank's parts, read from the shard files
    else:
        if meta.get("shards"):  # one process: the whole tensors
            tensors |= load_whole(shards, list(wanted))
        parts = {k: layout.laid_out(n, own[n], tensors[k]) for k, n in wanted.items()}
    _check_finite(policy, path, parts, sorted(whole))
    policy.load_state_dict(meta, parts)
    torch.set_rng_state(tensors["rng/torch"])
    cuda_keys = sorted((k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    cuda = [tensors[k] for k in cuda_keys]
    if cuda and torch.cuda.is_available():  # saved on a GPU host; a CPU host has none to restore
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    py = meta["python_random"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npr = meta["numpy_random"]
    np.random.set_state((npr[0], np.array(npr[1], dtype=np.uint32), *npr[2:]))
    return meta["state"]
