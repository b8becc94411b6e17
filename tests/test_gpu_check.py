"""The GPU check's dry run (``DEV=cpu python benchmarks/gpu_check.py``): the script a GPU machine runs once per
window must work here first, on the same code with smaller shapes. Here, not after the suite, so the dry run shares
the machine's cores with the other tests rather than running alone on one of them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_checks_dry_run_passes_every_line(tmp_path):
    env = {**os.environ, "DEV": "cpu", "GPU_CHECK_OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, (done.stdout[-6000:], done.stderr[-3000:])
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {line["name"]: line["status"] for line in record["lines"]}
    assert record["result"] == "PASS" and set(statuses.values()) <= {"PASS", "INFO"}, statuses
    assert "LoRA decode, Qwen3-30B-A3B shapes, compiled layer by layer" in statuses
    assert done.stdout.rstrip().splitlines()[-1].startswith("PASS gpu-check on cpu")
