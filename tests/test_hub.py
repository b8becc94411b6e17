"""Checkpoints by Hugging Face hub id (``moerl.hub``): a cache laid out on disk under ``HF_HOME`` as huggingface_hub
writes it (refs -> commit -> snapshot), read with ``HF_HUB_OFFLINE=1``: the CLI and a run's ``model.path`` take the
id (and a revision) and compute what the directory gives; a missing id or revision, a revision on a directory and a
path that is neither are named errors saying what to do."""

import os
import shutil
import subprocess
import sys

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


def _generate(hub, model: str, *extra: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"}
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
