"""Train-step throughput and peak memory per rank of the distributed trainer: one process vs dp=2 (FSDP2), ep=2
(experts split, tokens exchanged) and pp=2 (two pipeline stages, 1F1B), and on four ranks pp=2 with dp=2 or ep=2,
on the same batch.

Each layout runs in fresh processes (one launch per layout and round; the rounds interleave the layouts): a warm-up
step, then ``--steps`` timed steps (the ranks meet at a barrier before and after each). Tokens/s counts the batch's
tokens per step time; peak memory is each rank's VmHWM. One process uses every core; each rank of a 2-rank launch
gets half (torchrun's default of one thread per rank on this 2-core machine is raised to cores / ranks); four
ranks on two cores share them (one thread each).

    python benchmarks/parallel_step.py [--preset small] [--mode full] [--dtype float32] [--batch 8] [--seq 128]
        [--layouts "one process" dp=2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {
    "one process": "1,1,1",
    "dp=2": "2,1,1",
    "ep=2": "1,2,1",
    "pp=2": "1,1,2",
    "pp=2 x dp=2": "2,1,2",
    "pp=2 x ep=2": "1,2,2",
}


def worker(args) -> None:
    import torch.distributed as dist
    from train_step import peak_mb  # this directory's script

    from moerl.model.lora import LoraConfig
    from moerl.parallel.world import init_world
    from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
    from moerl.trainer.losses import sft_loss

    dp, ep, pp = (int(n) for n in args.worker.split(","))
    world = init_world(dp, ep, pp)
    torch.manual_seed(0)
    lora = LoraConfig(rank=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "experts"])
    cfg = PolicyConfig(mode=args.mode, dtype=args.dtype, lora=lora, micro_batch_size=args.micro, optim=OptimConfig())
    policy = Policy(args.ckpt, cfg, world)
    ids = torch.randint(4, 100, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))
    times = []
    for i in range(args.steps + 1):
        if world.size > 1:
            dist.barrier()
        start = time.perf_counter()
        policy.train_step(batch, sft_loss)
        if world.size > 1:
            dist.barrier()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    peaks = torch.tensor([peak_mb()])
    if world.size > 1:
        every = [torch.zeros(1) for _ in range(world.size)]
        dist.all_gather(every, peaks)
        peaks = torch.cat(every)
    if world.driver:
        Path(args.out).write_text(json.dumps({"times": times, "peak_mb": peaks.tolist()}))
    world.close()


def launch(layout: str, args, ckpt: str, out: str) -> dict:
    ranks = 1
    for n in layout.split(","):
        ranks *= int(n)
    cmd = [__file__, "--worker", layout, "--ckpt", ckpt, "--out", out, "--mode", args.mode, "--dtype", args.dtype]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--micro", str(args.micro)]
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    if ranks > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cmd]
    subprocess.run([sys.executable, *cmd], env=env, check=True, capture_output=True)
    return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--mode", default="full", choices=["full", "lora", "mxfp8"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--worker")
    p.add_argument("--ckpt")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from moerl.presets import init_model

    tmp = tempfile.mkdtemp()
    ckpt = str(Path(tmp) / "model")
    init_model("qwen3_moe", args.preset, ckpt, seed=0)
    names = ["one process", *(n for n in args.layouts if n != "one process")]  # the baseline of the ratios
    results = {name: {"step": [], "peak": []} for name in names}
    for r in range(args.rounds):
        for name in names:
            layout = LAYOUTS[name]
            got = launch(layout, args, ckpt, str(Path(tmp) / f"{r}-{layout}.json"))
            results[name]["step"].append(statistics.median(got["times"]))
            results[name]["peak"].append(got["peak_mb"])
    tokens = args.batch * args.seq
    base = statistics.median(results["one process"]["step"])
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"# {platform.processor() or platform.machine()} ({cpu}), {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"# qwen3_moe {args.preset}, mode {args.mode} ({args.dtype}), batch {args.batch} x {args.seq} tokens,")
    print(f"# micro-batches of {args.micro}, {args.steps} timed steps x {args.rounds} rounds (median of rounds;")
    print("# spread min-max)\n")
    print("| layout | step s | spread | tokens/s | vs one process | peak MiB per rank |")
    print("|---|---|---|---|---|---|")
    for name, res in results.items():
        med = statistics.median(res["step"])
        peaks = [statistics.median(p[i] for p in res["peak"]) for i in range(len(res["peak"][0]))]
        print(
            f"| {name} | {med:.3f} | {min(res['step']):.3f}-{max(res['step']):.3f} | {tokens / med:,.0f} | "
            f"{base / med:.2f}x | {' / '.join(f'{m:,.0f}' for m in peaks)} |"
        )


if __name__ == "__main__":
    main()
