"""A training step at a long sequence: today's plain step against blocks recomputed in the backward
(``policy.activation_checkpointing``), logits in chunks (``policy.logits_chunk``) and the optimizer stepping each
tensor in the backward (``policy.optimizer_in_backward``), on one packed row.

Each contender runs in a fresh process of its own, rounds interleaved in a rotating order: a warm-up step, then
``--steps`` timed steps (median), then one step under ``moerl.plan.memory.Memory`` for the peak of live tensors above
the policy's own (weights, masters, optimizer state: what every contender holds alike), and of it the activations
(the rest: the gradients). Prints each contender's median step time and peaks, and their ratios to the first.

    python benchmarks/long_step.py [--preset small] [--mode lora] [--tokens 8192] [--rounds 3] [--steps 2]
        [--contenders plain recompute+chunks]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from contender import run_contender

from moerl.plan.memory import Memory
from moerl.plan.rank import count_the_step, held
from moerl.presets import init_model
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import sft_loss

# contender -> (activation_checkpointing, logits_chunk, optimizer_in_backward: without clipping, which it excludes)
CONTENDERS = {
    "plain": ("none", 0, False),
    "chunks": ("none", 2048, False),
    "recompute": ("full", 0, False),
    "recompute+chunks": ("full", 2048, False),
    "selective+chunks": ("selective", 2048, False),
    "recompute+chunks+in-backward": ("full", 2048, True),
}


def child(args) -> dict:
    how, chunk, in_backward = CONTENDERS[args.child]
    optim = OptimConfig(lr=1e-5, grad_clip=0.0 if in_backward else 1.0)
    cfg = PolicyConfig(mode=args.mode, dtype=args.dtype, micro_batch_size=1, activation_checkpointing=how,
                       logits_chunk=chunk, compile=False, optim=optim, optimizer_in_backward=in_backward)  # fmt: skip
    policy = Policy(args.ckpt, cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (1, args.tokens), generator=g)
    mask = torch.ones_like(ids)
    batch = Batch(ids, mask, mask)
    policy.train_step(batch, sft_loss)  # warm-up
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        policy.train_step(batch, sft_loss)
        times.append(time.perf_counter() - start)
    with Memory(held(policy)) as memory:
        hooks = count_the_step(policy, memory)
        policy.train_step(batch, sft_loss)
        for hook in hooks:
            hook.remove()
    at_rest = sum(memory.peak.bytes[k] for k in ("weights", "masters", "optimizer"))
    peak = memory.peak
    return {"seconds": statistics.median(times), "peak": peak.total - at_rest, "activations": peak.bytes["activations"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--mode", default="lora", choices=["lora", "full"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--contenders", nargs="+", default=["plain", "recompute+chunks"], choices=list(CONTENDERS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load {os.getloadavg()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / args.preset
        init_model("qwen3_moe", args.preset, ckpt)
        results: dict[str, list[dict]] = {c: [] for c in args.contenders}
        for r in range(args.rounds):
            order = args.contenders[r % len(args.contenders) :] + args.contenders[: r % len(args.contenders)]
            for c in order:
                cmd = [sys.executable, __file__, "--child", c, "--ckpt", str(ckpt), "--preset", args.preset,
                       "--mode", args.mode, "--dtype", args.dtype, "--tokens", str(args.tokens),
                       "--steps", str(args.steps)]  # fmt: skip
                results[c].append(run_contender(cmd, cwd=Path(__file__).parent))
    base = args.contenders[0]
    base_s = statistics.median(x["seconds"] for x in results[base])
    base_peak = statistics.median(x["peak"] for x in results[base])
    print(f"\n{args.preset} {args.mode} {args.dtype}, one packed row of {args.tokens} tokens, {args.rounds} rounds")
    base_acts = statistics.median(x["activations"] for x in results[base])
    print("| contender | step s (min..max) | peak above the policy at rest, MiB (of it activations) | step vs first "
          "| peak vs first | activations vs first |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for c, rows in results.items():
        s = [x["seconds"] for x in rows]
        peak = statistics.median(x["peak"] for x in rows)
        acts = statistics.median(x["activations"] for x in rows)
        print(f"| {c} | {statistics.median(s):.2f} ({min(s):.2f}..{max(s):.2f}) | {peak / 2**20:,.0f} "
              f"({acts / 2**20:,.0f}) | {statistics.median(s) / base_s:.2f}x | {peak / base_peak:.2f} | "
              f"{acts / base_acts:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
