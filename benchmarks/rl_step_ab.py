"""The RL step of two git revisions side by side: ``rl_step.py``'s moerl contender (its ``--child`` mode), run from a
worktree of each revision in a fresh process, rounds interleaved; median seconds per step (steps after the first),
the median stage split, and the ratio B / A in samples/s.

    python benchmarks/rl_step_ab.py A_REV B_REV [--presets tiny small] [--modes full lora] [--rounds 3]
        [--steps 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from contender import run_contender

ROOT = Path(__file__).resolve().parent.parent


def child(tree: Path, ckpt: str, run_dir: str, mode: str, args) -> dict:
    cmd = [sys.executable, str(tree / "benchmarks" / "rl_step.py"), "--child", f"{mode}:inprocess:1", "--ckpt", ckpt]
    cmd += ["--run-dir", run_dir, "--steps", str(args.steps), "--dtype", args.dtype]
    env = os.environ | {"PYTHONPATH": str(tree)}  # this revision's moerl, not the installed one
    return run_contender(cmd, env=env, cwd=tree)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--modes", nargs="+", default=["full", "lora"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    args = p.parse_args()
    from moerl.presets import init_model

    with tempfile.TemporaryDirectory() as d:
        trees = {}
        for name in (args.a, args.b):
            trees[name] = Path(d) / f"tree-{len(trees)}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[name]), name], check=True,
                           capture_output=True)  # fmt: skip
        try:
            print(f"# RL step (rl_step.py workload), trainer {args.dtype}; {args.rounds} rounds; A={args.a} B={args.b}")
            print("| preset | mode | A s/step (spread) | B s/step (spread) | B vs A samples/s | A stages | B stages |")
            print("|---|---|---|---|---|---|---|")
            for preset in args.presets:
                ckpt = str(Path(d) / f"model-{preset}")
                init_model("qwen3_moe", preset, ckpt, seed=0)
                for mode in args.modes:
                    res: dict[str, list[dict]] = {n: [] for n in trees}
                    for r in range(args.rounds):
                        for i, (name, tree) in enumerate(trees.items()):
                            run_dir = str(Path(d) / f"{preset}-{mode}-{i}-{r}")
                            res[name].append(child(tree, ckpt, run_dir, mode, args))
                    cells = []
                    for name in trees:
                        secs = [x["seconds_per_step"] for x in res[name]]
                        keys = res[name][0]["stages"]
                        stages = {k: statistics.median(x["stages"][k] for x in res[name]) for k in keys}
                        cells.append((statistics.median(secs), min(secs), max(secs), stages))
                    (sa, la, ha, st_a), (sb, lb, hb, st_b) = cells
                    fmt = lambda st: " / ".join(f"{v:.2f}" for v in st.values())  # noqa: E731
                    print(f"| {preset} | {mode} | {sa:.2f} ({la:.2f}..{ha:.2f}) | {sb:.2f} ({lb:.2f}..{hb:.2f}) "
                          f"| {sa / sb:.2f}x | {fmt(st_a)} | {fmt(st_b)} |", flush=True)  # fmt: skip
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    main()
