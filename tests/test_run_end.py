"""How runs end: ``moerl train`` on several ranks exits 0 within a bound after its last step, its exported results
load where they are meant to (transformers, PEFT, moerl), and nothing is left behind: no process of the run's
session, no new /dev/shm segment. One case per path: a hybrid family (fused projections: merged weights instead of a
PEFT adapter) at ep=2, a Qwen3-MoE LoRA run at pp=2 with engine processes, an MLA family's full run at dp=2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BOUND_S = 240  # each of these runs ends in 10-40 s on 2 cores; a run that hangs at its end is killed here
EXAMPLE = Path(__file__).parents[1] / "examples" / "lora_arithmetic.yaml"
SMALL = [
    "model.sft_steps=0",
    "train.steps=2",
    "env.eval_problems=0",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_tokens=4",
]
CASES = [
    ("qwen3_next", ["parallel.ep=2"], "merged"),
    ("qwen3_moe", ["parallel.pp=2", "rollout.placement=process", "rollout.num_engines=2"], "adapter"),
    ("deepseek_v3", ["parallel.dp=2", "policy.mode=full"], "checkpoint"),
]


def _session_processes(sid: int) -> list[str]:
    """The processes still in session ``sid`` (the run's launcher started it): pid and command line."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                left.append(f"{entry.name} {command[:200]}")
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
    return left


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize(("arch", "layout", "made"), CASES, ids=[c[0] for c in CASES])
def test_a_run_on_several_ranks_ends_cleanly_with_its_results_loadable(arch, layout, made, tmp_path):
    from moerl.presets import init_model

    model = tmp_path / "model"
    init_model(arch, "tiny", model, seed=0)
    run_dir = tmp_path / "run"
    args = [str(EXAMPLE), f"model.path={model}", f"run_dir={run_dir}", *SMALL, *layout]
    shm_before = _shm()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=os.environ | {"GLOO_SOCKET_IFNAME": "lo"},
    )
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"the run did not end within {BOUND_S} s; its last lines:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-4000:]
    assert "training done" in err
    assert _session_processes(proc.pid) == [], "processes of the run outlived it"
    assert _shm() - shm_before == set(), "shared-memory segments outlived the run"

    saved = json.loads((run_dir / "checkpoint" / "checkpoint.json").read_text())
    assert saved["state"]["step"] == 2
    if made == "merged":  # transformers loads every tensor of the merged export, none missing or unexpected
        from transformers import AutoModelForCausalLM

        assert f"merged={run_dir / 'merged'}" in out
        _, info = AutoModelForCausalLM.from_pretrained(run_dir / "merged", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    elif made == "adapter":  # PEFT loads the adapter onto the base with every adapter tensor placed
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model)
        saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
        peft = PeftModel.from_pretrained(base, run_dir / "adapter")
        placed = {n for n, _ in peft.named_parameters() if "lora_" in n}
        assert len(placed) == len(saved) > 0
    else:  # full mode exports nothing: its last checkpoint, each rank's shards written, every tensor finite
        files = [run_dir / "checkpoint" / "shards" / name for name in saved["shards"]]
        assert len(files) == 2 and all(f.is_file() for f in files)
        tensors = [t for f in files for t in load_file(f).values()]
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
