"""``moerl plan`` for each shipped config at 8, 64 and 256 GPUs, each in a fresh process: its wall time, verdict and
per-rank totals. Usage: ``python benchmarks/plan_matrix.py [--gpu-memory 141GB] [--mode lora] [extra key=value ...]``.

Layouts: 8 GPUs dp 1 x ep 8; 64 GPUs dp 2 x ep 8 x pp 4; 256 GPUs dp 4 x ep 16 x pp 4 (1F1B).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

LAYOUTS = {8: (1, 8, 1), 64: (2, 8, 4), 256: (4, 16, 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu-memory", default="141GB")
    p.add_argument("--mode", default="lora")
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("extra", nargs="*", default=["rollout.max_model_len=4096", "policy.micro_batch_size=1"])
    args = p.parse_args()
    from moerl.plan.plan import shipped

    print(f"# moerl plan, mode {args.mode}, {args.gpu_memory} GPUs, {' '.join(args.extra)}")
    print("| model | GPUs | layout | seconds | verdict | GiB per rank (total, each stage) | proposal / limits |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models or shipped():
        for gpus, (dp, ep, pp) in LAYOUTS.items():
            cmd = [sys.executable, "-m", "moerl.cli", "plan", f"model.path={model}", f"policy.mode={args.mode}"]
            cmd += [f"parallel.dp={dp}", f"parallel.ep={ep}", f"parallel.pp={pp}", *args.extra]
            cmd += ["--gpus", str(gpus), "--gpu-memory", args.gpu_memory]
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            out = done.stdout.splitlines()
            verdict = next((line.split(": ", 1)[1] for line in out if line.startswith("verdict")), "ERROR")
            rows = [line.split() for line in out if line.strip()[:1].isdigit()]
            totals = [row[-3] for row in rows if row[-2] in ("yes", "NO")]
            extra = [line for line in out if line.startswith(("smallest", "no layout", "limit"))]
            note = "; ".join(x.split(": ", 1)[-1][:90] for x in extra)
            if done.returncode:
                note = (done.stderr.strip().splitlines() or ["?"])[-1][:160]
            print(f"| {model} | {gpus} | {dp}x{ep}x{pp} | {seconds:.1f} | {verdict} | {', '.join(totals)} | {note} |")


if __name__ == "__main__":
    main()
