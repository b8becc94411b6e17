"""Does the compiled decode step pay in a run, and where is the break-even? The same RL run with
``rollout.compile_decode`` false and true (compiled from the first decode), each a fresh process, rounds interleaved.

Per run: wall seconds of ``moerl.loop.train``; the engine's decode seconds per step (``LLMEngine.decode_seconds``,
read by the loop's own query) eager and compiled; the compilation (the first compiled step's extra generate
seconds). The break-even follows from them (compile cost / seconds saved per step) and is printed beside the one
``compile_decode: auto`` estimates from the eager decode seconds alone (``moerl.engine.compiled.pays``).

    python benchmarks/compile_decode_run.py [--preset tiny] [--steps 30] [--rounds 2] [--new-tokens 64]
        [--mode lora] [--dtype float32]"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from contender import add_child_args, rl_overrides, run_contender

from moerl.config import load_config
from moerl.engine import compiled
from moerl.loop import RunConfig, train
from moerl.precision import host_summary
from moerl.presets import init_model
from moerl.rollout.pool import EnginePool


def child(args) -> None:
    cfg = load_config(
        RunConfig,
        None,
        [
            *rl_overrides(args.run_dir, args.ckpt, args.mode, args.dtype, args.steps, 16, 8, args.new_tokens),
            f"rollout.compile_decode={args.child}",
        ],
    )
    decode = []  # the pool's decode seconds after every generate
    generate = EnginePool.generate

    def timed(self, requests):
        out = generate(self, requests)
        decode.append(self.decode_seconds())
        return out

    EnginePool.generate = timed
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
    gen = [r["seconds_generate"] for r in rows if "seconds_generate" in r]
    per_step = [b - a for a, b in zip([0.0, *decode], decode, strict=False)]
    print(json.dumps({"wall": wall, "generate": gen, "decode": per_step}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--mode", default="lora", choices=["full", "lora", "mxfp8"])
    p.add_argument("--dtype", default="float32")
    add_child_args(p)
    args = p.parse_args()
    if args.child:
        return child(args)
    print(f"# {host_summary()}")
    print(
        f"# {args.preset}, {args.mode}, {args.dtype}: {args.steps} RL steps of 16 prompts x group 8 x <= "
        f"{args.new_tokens} tokens; {args.rounds} round(s), each contender a fresh process, interleaved"
    )
    runs = {"false": [], "true": []}
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(Path(d) / "ckpt")
        init_model("qwen3_moe", args.preset, ckpt, seed=0)
        for r in range(args.rounds):
            for setting in list(runs)[r % 2 :] + list(runs)[: r % 2]:
                run_dir = Path(d) / setting
                shutil.rmtree(run_dir, ignore_errors=True)
                cmd = [sys.executable, __file__, "--child", setting, "--ckpt", ckpt, "--run-dir", str(run_dir)]
                cmd += ["--steps", str(args.steps), "--new-tokens", str(args.new_tokens), "--mode", args.mode]
                runs[setting].append(run_contender([*cmd, "--dtype", args.dtype]))
    med = statistics.median
    print("| compile_decode | run wall s (spread) | decode s/step (steps 3+) | generate s/step (steps 3+) |")
    print("|---|---|---|---|")
    for setting, got in runs.items():
        walls = [g["wall"] for g in got]
        dec = med(med(g["decode"][3:]) for g in got)
        gen = med(med(g["generate"][3:]) for g in got)
        print(f"| {setting} | {med(walls):.1f} ({min(walls):.1f}..{max(walls):.1f}) | {dec:.3f} | {gen:.3f} |")
    eager = med(med(g["decode"][3:]) for g in runs["false"])
    fast = med(med(g["decode"][3:]) for g in runs["true"])
    # the compiled run's first generate holds the compilation (its eager twin's first generate as the base)
    cost = med(g["generate"][0] for g in runs["true"]) - med(g["generate"][0] for g in runs["false"])
    saved = eager - fast
    print(
        f"# decode {eager / fast:.2f}x compiled (saves {saved / eager:.0%} of the decode time, {saved:.3f} s a step); "
        f"compiling cost {cost:.1f} s: break-even after {cost / saved:.0f} steps measured; auto's rule "
        f"({compiled.GAIN} saved, {compiled.COMPILE_SECONDS:.0f} s) puts it at "
        f"{compiled.COMPILE_SECONDS / (compiled.GAIN * eager):.0f} steps"
    )


if __name__ == "__main__":
    main()
