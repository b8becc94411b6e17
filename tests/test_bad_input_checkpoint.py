"""Checkpoints are replaced atomically (a kill at every point of a save leaves a complete one) and a truncated,
corrupt, incomplete or non-finite checkpoint is refused by name, with the policy left as it was."""

import json
import os

import pytest
import torch
from run_helpers import tree_hash

from moerl.errors import CheckpointError
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer import checkpoint as ckpt
from moerl.trainer.checkpoint import load_checkpoint, recover_checkpoint, save_checkpoint
from moerl.trainer.losses import sft_loss

ARCH = "Qwen3MoeForCausalLM"
POINTS = ["tensors written", "new checkpoint complete", "old checkpoint moved aside", "new checkpoint in place", "done"]


def _policy(hf_checkpoints) -> Policy:
    return Policy(hf_checkpoints[ARCH][0], PolicyConfig(mode="lora", dtype="float32", optim=OptimConfig(lr=1e-2)))


def _step(pol: Policy) -> None:
    ids = torch.randint(4, 100, (2, 8), generator=torch.Generator().manual_seed(pol.step))
    mask = torch.ones_like(ids)
    pol.train_step(Batch(ids, mask, mask), sft_loss)


def _weights(pol: Policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pol.trainable_state().items()}


@pytest.fixture
def two_states(hf_checkpoints, tmp_path):
    """A policy after one step (saved as the old checkpoint) and after two (to be saved over it)."""
    pol = _policy(hf_checkpoints)
    _step(pol)
    save_checkpoint(tmp_path / "checkpoint", pol, state={"step": 1})
    old = _weights(pol)
    _step(pol)
    return pol, old, _weights(pol)


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_any_point_of_a_save_leaves_a_complete_checkpoint(point, two_states, hf_checkpoints, tmp_path):
    pol, old, new = two_states
    pid = os.fork()
    if pid == 0:  # the child saves and is killed (no cleanup, no flush) at ``point``
        try:
            ckpt._crash_point = lambda name: os._exit(9) if name == point else None
            save_checkpoint(tmp_path / "checkpoint", pol, state={"step": 2})
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    found, _ = recover_checkpoint(tmp_path / "checkpoint")
    assert found == tmp_path / "checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # leftovers cleaned up
    fresh = _policy(hf_checkpoints)
    state = load_checkpoint(found, fresh)
    expected = old if state["step"] == 1 else new
    assert state["step"] == (1 if point in POINTS[:2] else 2)  # the new one counts once it is complete beside
    assert all(torch.equal(expected[k], v) for k, v in fresh.trainable_state().items())


def test_a_complete_new_checkpoint_left_between_the_renames_is_recovered_and_reported(two_states, tmp_path):
    pol, _, _ = two_states
    save_checkpoint(tmp_path / "scratch", pol, state={"step": 2})
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    (tmp_path / "scratch").rename(tmp_path / "checkpoint.tmp")
    before = tree_hash(tmp_path)
    found, note = recover_checkpoint(tmp_path / "checkpoint", dry_run=True)
    assert found == tmp_path / "checkpoint.tmp" and "recovered the complete checkpoint checkpoint.tmp" in note
    assert tree_hash(tmp_path) == before  # a dry run moves nothing
    found, _ = recover_checkpoint(tmp_path / "checkpoint")
    assert json.loads((found / "checkpoint.json").read_text())["state"] == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def _corrupt(case: str, path):
    tensors, meta = path / "checkpoint.safetensors", path / "checkpoint.json"
    if case == "truncated tensors":
        tensors.write_bytes(tensors.read_bytes()[:1000])
    elif case == "flipped byte":
        data = bytearray(tensors.read_bytes())
        data[-5] ^= 0x40
        tensors.write_bytes(bytes(data))
    elif case == "truncated json":
        meta.write_text(meta.read_text()[:50])
    elif case == "json lacks a key":
        m = json.loads(meta.read_text())
        del m["scheduler"]
        meta.write_text(json.dumps(m))
    elif case == "no json":
        meta.unlink()
    elif case == "non-finite weight":
        from safetensors.torch import load_file, save_file

        t = load_file(tensors)
        name = next(k for k in t if k.startswith("weights/"))
        t[name][0] = float("nan")
        save_file(t, tensors)
        m = json.loads(meta.read_text())
        m.pop("tensors_sha256"), m.pop("tensors_bytes")  # as a checkpoint of an older moerl, without them
        meta.write_text(json.dumps(m))


CASES = {
    "truncated tensors": r"checkpoint\.safetensors has \d+ bytes, checkpoint\.json records \d+: .*truncated",
    "flipped byte": r"checkpoint\.safetensors is corrupt: its SHA-256 differs",
    "truncated json": r"checkpoint\.json is not valid JSON \(truncated or corrupt\?\)",
    "json lacks a key": r"checkpoint\.json lacks the key\(s\) \['scheduler'\]",
    "no json": r"checkpoint\.json does not exist: not a complete moerl training checkpoint",
    "non-finite weight": r"tensor 'weights/.*' holds non-finite values \(NaN or inf\); refusing to load it",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_checkpoint_is_refused_by_name_and_the_policy_is_untouched(case, two_states, hf_checkpoints, tmp_path):
    _corrupt(case, tmp_path / "checkpoint")
    before = tree_hash(tmp_path)
    fresh = _policy(hf_checkpoints)
    initial = _weights(fresh)
    with pytest.raises(CheckpointError, match=CASES[case]):
        load_checkpoint(tmp_path / "checkpoint", fresh)
    assert all(torch.equal(initial[k], v) for k, v in fresh.trainable_state().items()) and fresh.step == 0
    assert tree_hash(tmp_path) == before


def test_an_intact_checkpoint_without_integrity_fields_still_loads(two_states, hf_checkpoints, tmp_path):
    """Checkpoints written before sizes and hashes were recorded load as before (negative control of the above)."""
    path = tmp_path / "checkpoint"
    m = json.loads((path / "checkpoint.json").read_text())
    m.pop("tensors_sha256"), m.pop("tensors_bytes")
    (path / "checkpoint.json").write_text(json.dumps(m))
    assert load_checkpoint(path, _policy(hf_checkpoints)) == {"step": 1}


def test_a_full_disk_while_saving_is_a_named_error_and_the_last_checkpoint_stays(tmp_path):
    # a 6 MiB filesystem of its own (a private mount namespace: root only): the first save of a tiny full-mode
    # policy (~4 MiB of fp32 masters; no moments before a step) fits, the second (a new copy beside it) does not
    import subprocess
    import sys
    import textwrap

    disk = tmp_path / "disk"
    disk.mkdir()
    script = textwrap.dedent(
        f"""
        import torch
        from moerl.errors import CheckpointError
        from moerl.presets import init_model
        from moerl.trainer import Policy, PolicyConfig
        from moerl.trainer.checkpoint import load_checkpoint, save_checkpoint
        init_model("qwen3_moe", "tiny", "{tmp_path}/model")
        pol = Policy("{tmp_path}/model", PolicyConfig(mode="full", dtype="float32"))
        save_checkpoint("{disk}/ckpt", pol, state={{"step": 1}})
        pol.step = 2
        try:
            save_checkpoint("{disk}/ckpt", pol, state={{"step": 2}})
        except CheckpointError as e:
            print("REFUSED", e)
        import os
        print("LEFT", sorted(os.listdir("{disk}")))
        print("LOADS", load_checkpoint("{disk}/ckpt", pol))
        """
    )
    (tmp_path / "save.py").write_text(script)
    mount = f"mount -t tmpfs -o size=6M tmpfs {disk}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("this host does not let a test mount a filesystem of its own")
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mount} && {sys.executable} {tmp_path}/save.py"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED"))
    assert f"REFUSED saving checkpoint {disk}/ckpt failed: " in refused and "No space left on device" in refused
    assert f"({disk} has " in refused and f"the last complete checkpoint {disk}/ckpt is kept" in refused
    assert "LEFT ['ckpt']" in out.stdout  # the partial save is gone
    assert "LOADS {'step': 1}" in out.stdout  # and the first one loads as saved
