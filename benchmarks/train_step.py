"""Training throughput per Policy mode: forward+backward+optimizer tokens/s and peak memory on one checkpoint.

Modes: lora (rank 16, every linear layer and the experts, bf16 base), full (bf16 compute, fp32 masters and
AdamW state), mxfp8 (full with MXFP8-emulated GEMMs: fake quantization costs extra on a CPU, it does not save
anything there). Steps run interleaved across the modes, median of rounds after a warm-up step. Peak memory:
each mode once more alone in a child process (VmHWM).

    python benchmarks/train_step.py [--preset small] [--batch 8] [--seq 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from contender import run_contender

from moerl.model.lora import LoraConfig
from moerl.presets import init_model
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import sft_loss

MODES = ("lora", "full", "mxfp8")


def make_policy(ckpt: str, mode: str, micro: int) -> Policy:
    lora = LoraConfig(rank=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "experts"])
    return Policy(
        ckpt, PolicyConfig(mode=mode, dtype="bfloat16", lora=lora, micro_batch_size=micro, optim=OptimConfig(lr=1e-5))
    )


def make_batch(b: int, t: int) -> Batch:
    ids = torch.randint(4, 100, (b, t), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    return Batch(ids, mask, mask)


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args) -> None:
    pol = make_policy(args.ckpt, args.child, args.micro)
    pol.train_step(make_batch(args.batch, args.seq), sft_loss)
    print(json.dumps({"peak_mb": peak_mb()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    tokens = args.batch * args.seq
    with tempfile.TemporaryDirectory() as ckpt:
        init_model("qwen3_moe", args.preset, ckpt, seed=0)
        policies = {m: make_policy(ckpt, m, args.micro) for m in MODES}
        batch = make_batch(args.batch, args.seq)
        times = {m: [] for m in MODES}
        for pol in policies.values():
            pol.train_step(batch, sft_loss)  # warm-up
        for r in range(args.rounds):
            for m in MODES[r % 3 :] + MODES[: r % 3]:
                start = time.perf_counter()
                policies[m].train_step(batch, sft_loss)
                times[m].append(time.perf_counter() - start)
        del policies
        peaks = {}
        for m in MODES:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                m,
                "--ckpt",
                ckpt,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--micro",
                str(args.micro),
            ]
            peaks[m] = run_contender(cmd)["peak_mb"]
    tps = {m: tokens / statistics.median(t) for m, t in times.items()}
    print(
        f"# train step, qwen3_moe {args.preset}, batch {args.batch} x {args.seq} tokens (micro-batch {args.micro}),"
        f" median of {args.rounds} interleaved rounds; torch {torch.__version__}, {torch.get_num_threads()} threads,"
        f" {platform.machine()}"
    )
    print("| mode | tokens/s | vs full | peak RSS (MB) |")
    print("|---|---|---|---|")
    for m in MODES:
        print(f"| {m} | {tps[m]:,.0f} | {tps[m] / tps['full']:.2f}x | {peaks[m]:,.0f} |")
    print(
        f"\nLoRA / full = {tps['lora'] / tps['full']:.2f}x; MXFP8 emulation / bf16 full = "
        f"{tps['mxfp8'] / tps['full']:.2f}x"
    )


if __name__ == "__main__":
    main()
