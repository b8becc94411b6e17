"""Checkpoints by Hugging Face hub id (``Qwen/Qwen3-30B-A3B``) as well as by directory: through ``huggingface_hub``'s
cache (``HF_HOME``), offline first. A cached snapshot of the revision is used without a network call; one not cached
is downloaded (the files a checkpoint is made of) unless ``HF_HUB_OFFLINE`` is set; either way a missing one is a
named error that says how to fetch it."""

from __future__ import annotations

import re
from pathlib import Path

from moerl.errors import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]  # a checkpoint: config, weights, tokenizer


def checkpoint_dir(name: str | Path, revision: str | None = None, key: str = "model.path") -> Path:
    """The local directory of checkpoint ``name``: ``name`` itself when it is a directory, else the snapshot of hub
    id ``name`` at ``revision`` (a branch, tag or commit; default main) from the Hugging Face cache. ``key`` names
    the setting in errors."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConfigError(f"{key}={str(name)!r} is a directory: a revision ({revision!r}) applies to hub ids only")
        return path
    text = str(name)
    if path.exists() or not HUB_ID.match(text):  # an id starts with a letter or digit: no path prefix matches
        what = "is not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"{key}={text!r} {what}: give a checkpoint directory or a Hugging Face hub id (owner/name)")
    return _snapshot(text, revision, key)


def _snapshot(repo: str, revision: str | None, key: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    at = f"{repo}@{revision or 'main'}"
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"{key}={repo!r}: {at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is "
            f"set; fetch it where the hub is reachable ({fetch}, into the same HF_HOME) or give its directory"
        ) from None
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ConfigError(
            f"{key}={repo!r}: {at} could not be fetched from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); check the id and revision, log in for a gated model "
            f"(hf auth login), or fetch it yourself ({fetch}) and give its directory"
        ) from None
