"""The RL step under the default micro-batching (a token budget: ``policy.max_tokens_per_micro_batch`` null, no row
limit) against fixed micro-batches of 8 sequences (the old default) and of 128 (a tuned run).

Each contender is a ``moerl train`` of ``--steps`` steps in a fresh process of its own, rounds interleaved in a
rotating order; its figure is the median ``seconds_step`` of the steps after the first (metrics.jsonl). Prints each
contender's median and spread and its speed against the default.

    python benchmarks/micro_batches.py [--preset tiny] [--mode full] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from contender import rl_overrides

from moerl.presets import init_model

CONTENDERS = {
    "default (16384 tokens, no row limit)": [],
    "8 rows (the old default)": ["policy.micro_batch_size=8", "policy.max_tokens_per_micro_batch=0"],
    "128 rows (tuned)": ["policy.micro_batch_size=128", "policy.max_tokens_per_micro_batch=0"],
}


def run(ckpt: Path, run_dir: Path, over: list[str], args) -> float:
    base = rl_overrides(run_dir, ckpt, args.mode, "float32", args.steps, 16, 8, 8)
    base = [o for o in base if "micro_batch" not in o]
    subprocess.run([sys.executable, "-m", "moerl.cli", "train", *base, *over, "metrics.plot=false"],
                   check=True, capture_output=True)  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["seconds_step"] for r in rows if r["step"] > 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--mode", default="full")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"load {os.getloadavg()}")
    names = list(CONTENDERS)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / args.preset
        init_model("qwen3_moe", args.preset, ckpt)
        for r in range(args.rounds):
            for i, name in enumerate(names[r % len(names) :] + names[: r % len(names)]):
                seconds[name].append(run(ckpt, Path(tmp) / f"run-{r}-{i}", CONTENDERS[name], args))
    base = statistics.median(seconds[names[0]])
    print(f"\n{args.preset} {args.mode} fp32, 16 x 8 samples of 8 tokens a step, {args.rounds} rounds")
    print("| micro-batches | s / step (min..max) | speed vs default |")
    print("|---|---|---|")
    for name, s in seconds.items():
        median = statistics.median(s)
        print(f"| {name} | {median:.3f} ({min(s):.3f}..{max(s):.3f}) | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
