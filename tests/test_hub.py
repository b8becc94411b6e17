"""Checkpoints by Hugging Face hub id (``moerl.hub``): a cache laid out on disk under ``HF_HOME`` as huggingface_hub
writes it (refs -> commit -> snapshot), read with ``HF_HUB_OFFLINE=1``: the CLI and a run's ``model.path`` take the
id (and a revision) and compute what the directory gives; a missing id or revision, a revision on a directory and a
path that is neither are named errors saying what to do."""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from moerl.errors import ConfigError
from moerl.presets import init_model

MAIN, V1 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """HF_HOME holding owner/tiny: main -> one random tiny model, tag v1 -> another (another seed)."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--owner--tiny"
    for commit, ref, seed in ((MAIN, "main", 0), (V1, "v1", 1)):
        init_model("qwen3_moe", "tiny", repo / "snapshots" / commit, seed=seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return home


def _generate(hub, model: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"} | (env or {})
    args = [sys.executable, "-m", "moerl.cli", "generate", model, "--prompt", "12+7=", "--max-tokens", "8"]
    args += ["--temperature", "1.0", *extra]  # seeded samples: another model samples other text
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_a_hub_id_and_its_revision_come_from_the_cache_offline(hub):
    snapshots = hub / "hub" / "models--owner--tiny" / "snapshots"
    by_id, by_dir = _generate(hub, "owner/tiny"), _generate(hub, str(snapshots / MAIN))
    assert by_id.returncode == by_dir.returncode == 0, by_id.stderr[-2000:]
    assert by_id.stdout == by_dir.stdout and by_id.stdout.strip()
    tagged = _generate(hub, "owner/tiny", "--revision", "v1")
    assert tagged.returncode == 0 and tagged.stdout == _generate(hub, str(snapshots / V1)).stdout
    assert tagged.stdout != by_id.stdout  # control: the revision chose the other model
    pinned = _generate(hub, "owner/tiny", "--revision", V1)  # a commit, as well as a tag
    assert pinned.returncode == 0 and pinned.stdout == tagged.stdout


def test_what_the_cache_does_not_hold_is_named_with_how_to_fetch_it(hub, tmp_path):
    missing = _generate(hub, "owner/absent")
    assert missing.returncode == 2
    assert "model_dir='owner/absent': owner/absent@main is not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE is set; fetch it where the hub is reachable (hf download owner/absent" in missing.stderr
    revision = _generate(hub, "owner/tiny", "--revision", "v9")
    assert revision.returncode == 2 and "owner/tiny@v9 is not in the Hugging Face cache" in revision.stderr
    assert "hf download owner/tiny --revision v9" in revision.stderr


def test_a_run_takes_a_hub_id_as_model_path(hub, monkeypatch, tmp_path):
    """``model.path`` / ``model.revision`` in a run's config resolve as the CLI's argument does (in this process:
    huggingface_hub reads its cache and offline settings from its constants)."""
    from huggingface_hub import constants

    from moerl.build import ensure_model
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshots = hub / "hub" / "models--owner--tiny" / "snapshots"
    for over, want in ((["model.path=owner/tiny"], MAIN), (["model.path=owner/tiny", "model.revision=v1"], V1)):
        cfg = load_config(RunConfig, None, [f"run_dir={tmp_path / 'run'}", *over])
        assert ensure_model(cfg, tmp_path / "run", fresh=True) == snapshots / want
    local = tmp_path / "local"
    shutil.copytree(snapshots / MAIN, local)
    cfg = load_config(RunConfig, None, [f"model.path={local}", "model.revision=v1"])
    with pytest.raises(ConfigError, match=r"model.path='.*local' is a directory: a revision \('v1'\) applies to hub"):
        ensure_model(cfg, tmp_path / "run", fresh=True)
    cfg = load_config(RunConfig, None, [f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"model.path='.*nowhere' does not exist: give a checkpoint directory or a"):
        ensure_model(cfg, tmp_path / "run", fresh=True)


@pytest.mark.parametrize("revision", ["..", "../../etc", "v1 ", "refs//pr", ".hidden", "a:b", ""])
def test_a_revision_that_is_no_ref_name_is_named_before_the_cache_is_read(hub, revision):
    """huggingface_hub makes a path of the revision (``refs/<revision>``): ``..`` read the repository's directory as
    a file (IsADirectoryError); git's ref-name rules refuse it, and the rest, by name."""
    out = _generate(hub, "owner/tiny", "--revision", revision)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        f"moerl: error: --revision {revision!r} (of owner/tiny): not a branch, tag or commit name (git refuses "
        "'..', a leading '.' or '/', spaces and ~^:?*[\\ in one)\n"
    )
    from moerl.hub import checkpoint_dir

    with pytest.raises(ConfigError, match=r"^model.revision='\.\.' \(of owner/tiny\): not a branch"):
        checkpoint_dir("owner/tiny", "..")


@pytest.fixture
def silent_hub():
    """A real TCP server on a local port that accepts every connection and never answers: (its URL, the
    connections it accepted)."""
    server = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", held
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_hub_that_accepts_and_never_answers_is_named_with_its_deadline(silent_hub, tmp_path):
    """Not in the cache and online: the id goes to the hub (HF_ENDPOINT), whose silence ends at the deadline
    (HF_HUB_DOWNLOAD_TIMEOUT seconds per request) in one line naming the id, the endpoint and the deadline."""
    url, held = silent_hub
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": url, "HF_HUB_DOWNLOAD_TIMEOUT": "1", "HF_HUB_ETAG_TIMEOUT": "1"}
    start = time.monotonic()
    out = _generate(tmp_path / "hf_home", "nobody/x", env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert held, "the request never reached the hub"  # control: the wait that hung is the one that ended
    assert out.stderr.splitlines()[-1] == (
        f"moerl: error: model_dir='nobody/x': the Hugging Face hub at {url} did not answer within 1 s "
        "(HF_HUB_DOWNLOAD_TIMEOUT) while fetching nobody/x@main; check HF_ENDPOINT and the network, raise "
        "HF_HUB_DOWNLOAD_TIMEOUT for a slow hub, or fetch it yourself (hf download nobody/x) and give its directory"
    )
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start < 120  # the deadline is the behaviour: seconds, where it used to hang forever


def test_a_session_the_hub_makes_again_keeps_the_deadline():
    """huggingface_hub closes its session after a failed connection and makes a new one: that one's requests get
    the deadline too (the control: a session made before moerl bounded the waits has no hook)."""
    import huggingface_hub

    from moerl.hub import _bound_hub_waits, _fill_deadline

    huggingface_hub.set_client_factory(huggingface_hub.utils._http.default_client_factory)  # as a fresh process
    assert _fill_deadline not in huggingface_hub.get_session().event_hooks["request"]
    _bound_hub_waits()
    assert _fill_deadline in huggingface_hub.get_session().event_hooks["request"]
    huggingface_hub.close_session()  # what a failed connection makes it do
    assert huggingface_hub.get_session().event_hooks["request"].count(_fill_deadline) == 1
