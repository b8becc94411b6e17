"""Checkpoints by Hugging Face hub id (``Qwen/Qwen3-30B-A3B``) as well as by directory: through ``huggingface_hub``'s
cache (``HF_HOME``), offline first. A cached snapshot of the revision is used without a network call; one not cached
is downloaded (the files a checkpoint is made of) unless ``HF_HUB_OFFLINE`` is set; either way a missing one is a
named error that says how to fetch it. Every request to the hub has a deadline (``HF_HUB_DOWNLOAD_TIMEOUT``
seconds without an answer): a hub that does not answer is a named error, not a wait without end."""

from __future__ import annotations

import re
from pathlib import Path

from moerl.errors import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]  # a checkpoint: config, weights, tokenizer
# what git refuses in a ref name (git check-ref-format): huggingface_hub also makes a cache path of it
BAD_REF = re.compile(r"\.\.|//|@\{|[\x00-\x20\x7f~^:?*\[\\]|^/|/$|^\.|/\.|\.lock(/|$)|\.$|^@$")


def checkpoint_dir(name: str | Path, revision: str | None = None, key: str = "model.path") -> Path:
    """The local directory of checkpoint ``name``: ``name`` itself when it is a directory, else the snapshot of hub
    id ``name`` at ``revision`` (a branch, tag or commit; default main) from the Hugging Face cache. ``key`` names
    the setting in errors (``model.path``, whose revision is ``model.revision``; else a CLI argument, whose revision
    is ``--revision``)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConfigError(f"{key}={str(name)!r} is a directory: a revision ({revision!r}) applies to hub ids only")
        return path
    text = str(name)
    if path.exists() or not HUB_ID.match(text):  # an id starts with a letter or digit: no path prefix matches
        what = "is not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"{key}={text!r} {what}: give a checkpoint directory or a Hugging Face hub id (owner/name)")
    if revision is not None and (not revision or BAD_REF.search(revision)):
        flag = "model.revision=" if key == "model.path" else "--revision "
        raise ConfigError(
            f"{flag}{revision!r} (of {text}): not a branch, tag or commit name (git refuses '..', a leading '.' or "
            "'/', spaces and ~^:?*[\\ in one)"
        )
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
    import httpx2

    deadline = constants.HF_HUB_DOWNLOAD_TIMEOUT
    _bound_hub_waits()
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=FILES, etag_timeout=deadline))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, httpx2.HTTPError) as e:
        if _timed_out(e, httpx2.TimeoutException):
            raise ConfigError(
                f"{key}={repo!r}: the Hugging Face hub at {constants.ENDPOINT} did not answer within {deadline} s "
                f"(HF_HUB_DOWNLOAD_TIMEOUT) while fetching {at}; check HF_ENDPOINT and the network, raise "
                f"HF_HUB_DOWNLOAD_TIMEOUT for a slow hub, or fetch it yourself ({fetch}) and give its directory"
            ) from None
        raise ConfigError(
            f"{key}={repo!r}: {at} could not be fetched from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); check the id and revision, log in for a gated model "
            f"(hf auth login), or fetch it yourself ({fetch}) and give its directory"
        ) from None


def _bound_hub_waits() -> None:
    """Give every request of huggingface_hub's shared HTTP sessions a deadline. Some of its calls (``repo_info``,
    ``list_repo_tree``, which ``snapshot_download`` makes first) pass ``timeout=None`` and take no timeout argument
    through ``snapshot_download``: against a hub that accepts a connection and never answers they would wait
    forever. A request hook (httpx's public ``event_hooks``) fills in ``HF_HUB_DOWNLOAD_TIMEOUT``, which
    huggingface_hub documents as the default timeout of requests that give none, wherever a request has none. The
    hook goes on the session of now and, through huggingface_hub's client factory, on every session it makes after
    (it makes a new one after a failed connection)."""
    from huggingface_hub import get_session, set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    if get_session().event_hooks["request"].count(_fill_deadline):
        return
    set_client_factory(lambda: _with_deadline(default_client_factory()))  # replaces the open HTTP client


def _with_deadline(session):
    """``session`` with ``_fill_deadline`` among its request hooks."""
    hooks = session.event_hooks
    if _fill_deadline not in hooks["request"]:
        session.event_hooks = {**hooks, "request": [*hooks["request"], _fill_deadline]}
    return session


def _fill_deadline(request) -> None:
    """``_bound_hub_waits``' hook: each of the request's timeouts (connect, read, write, pool) that is None becomes
    ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds; timeouts the caller gave are kept."""
    from huggingface_hub import constants

    timeout = request.extensions.get("timeout") or dict.fromkeys(("connect", "read", "write", "pool"))
    if any(v is None for v in timeout.values()):
        bounded = {k: constants.HF_HUB_DOWNLOAD_TIMEOUT if v is None else v for k, v in timeout.items()}
        request.extensions = {**request.extensions, "timeout": bounded}


def _timed_out(error: BaseException, timeout: type[BaseException]) -> bool:
    """Whether ``error`` is, or was caused by, a ``timeout`` (huggingface_hub raises its own errors from the
    request's)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, timeout):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
