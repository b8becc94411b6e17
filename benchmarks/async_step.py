"""Samples/s of the RL loop, synchronous vs asynchronous (``algo.async``, k = 1, 2), with each step's timeline.

Workload of ``rl_step.py``: 16 prompts x group 8 x <= 16 new tokens, arithmetic, full mode (fp32 trainer, bf16
engine), one PPO epoch. Contenders, each in its own fresh process, rounds interleaved:

- ``sync, 2 threads``: the default loop, engine in the trainer's process; every stage uses both cores in turn.
- ``sync, split 1+1``: the engine in its own process with 1 thread, the trainer with 1 thread: the cores split
  as the asynchronous rows split them, but taking turns.
- ``async k=1`` / ``async k=2``: the same split, generating the next steps while this one trains.

Per contender: samples/s (samples over wall time of all the steps of a run, from the end of the first evaluation
to the end of the last step; median and min..max over the rounds), and the median step's generate / learn
(logprobs + train) / sync seconds and the trainer's and the engine's idle seconds. The ceiling of overlap on two
cores: a step cannot take less than max(generate, learn) + sync of the split contender, so ``ceiling`` = samples /
that.

    python benchmarks/async_step.py [--presets tiny small] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from contender import add_child_args, run_contender

from moerl.config import load_config
from moerl.loop import RunConfig, train
from moerl.presets import init_model

SPLIT = ["rollout.placement=process", "rollout.engine_threads=1"]
CONTENDERS = {
    "sync, 2 threads": (2, []),
    "sync, split 1+1": (1, SPLIT),
    "async k=1, split 1+1": (1, [*SPLIT, "algo.async=true", "algo.max_staleness=1"]),
    "async k=2, split 1+1": (1, [*SPLIT, "algo.async=true", "algo.max_staleness=2"]),
}
TIMES = ("seconds_generate", "learn", "seconds_sync", "seconds_trainer_idle", "seconds_engine_idle")


def child(args) -> None:
    threads, extra = CONTENDERS[args.child]
    torch.set_num_threads(threads)
    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={args.run_dir}",
            f"model.path={args.ckpt}",
            "policy.mode=full",
            "policy.dtype=float32",
            "policy.micro_batch_size=64",
            f"train.steps={args.steps}",
            "train.checkpoint_every=0",
            "env.name=arithmetic",
            "env.eval_problems=0",
            "rollout.prompts_per_step=16",
            "rollout.group_size=8",
            "rollout.max_tokens=16",
            "rollout.max_model_len=32",
            *extra,
        ],
    )
    train(cfg)
    rows = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
    # every step, the first included: a window that leaves the first steps out would start with up to k batches
    # already generated ahead (a head start the window never pays for); over the whole run both loops generate and
    # train every batch, the asynchronous one overlapping all but the first generation
    steps = [r for r in rows if "samples_per_s" in r]
    for r in steps:
        r["learn"] = r["seconds_logprobs"] + r["seconds_train"]
    out = {"samples_per_s": sum(r["samples"] for r in steps) / sum(r["seconds_step"] for r in steps)}
    out |= {k: statistics.median(r[k] for r in steps) for k in TIMES}
    out["staleness_max"] = max(r["staleness_max"] for r in steps)
    print(json.dumps(out))


def run(name: str, ckpt: str, run_dir: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--ckpt", ckpt, "--run-dir", run_dir, "--steps", str(args.steps)]
    return run_contender(cmd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    add_child_args(p)
    args = p.parse_args()
    if args.child:
        return child(args)
    print(
        f"# RL step, 16 prompts x group 8 x 16 new tokens, full, fp32 trainer, bf16 engine; {args.steps} steps per "
        f"run, {args.rounds} rounds interleaved; torch {torch.__version__}, "
        f"cpu {torch.backends.cpu.get_cpu_capability()}, {platform.machine()}"
    )
    print(
        "| preset | contender | samples/s (median, spread) | vs sync 2 threads | generate / learn / sync s "
        "| trainer idle / engine idle s | max staleness |"
    )
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        with tempfile.TemporaryDirectory() as d:
            ckpt = str(Path(d) / "model")
            init_model("qwen3_moe", preset, ckpt, seed=0)
            results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
            for i in range(args.rounds):
                for name in CONTENDERS:
                    results[name].append(run(name, ckpt, str(Path(d) / f"{i}-{len(results[name])}-{name}"), args))
        base = statistics.median(r["samples_per_s"] for r in results["sync, 2 threads"])
        for name, rs in results.items():
            sps = [r["samples_per_s"] for r in rs]
            med = {k: statistics.median(r[k] for r in rs) for k in TIMES}
            print(
                f"| {preset} | {name} | {statistics.median(sps):.1f} ({min(sps):.1f}..{max(sps):.1f}) "
                f"| {statistics.median(sps) / base:.2f}x | {med['seconds_generate']:.2f} / {med['learn']:.2f} / "
                f"{med['seconds_sync']:.2f} | {med['seconds_trainer_idle']:.2f} / {med['seconds_engine_idle']:.2f} "
                f"| {max(r['staleness_max'] for r in rs):.0f} |",
                flush=True,
            )
        split = {k: statistics.median(r[k] for r in results["sync, split 1+1"]) for k in TIMES}
        floor = max(split["seconds_generate"], split["learn"]) + split["seconds_sync"]
        print(
            f"| {preset} | ceiling of overlap (split stages) | {128 / floor:.1f} | {128 / floor / base:.2f}x "
            f"| max({split['seconds_generate']:.2f}, {split['learn']:.2f}) + {split['seconds_sync']:.2f} | | |",
            flush=True,
        )


if __name__ == "__main__":
    main()
