"""Where a training step's time goes: torch profiler self time by kind of op (GEMM, elementwise, attention, MoE
routing, optimizer), one step after a warm-up, on a random checkpoint of a preset.

    python benchmarks/train_profile.py [--preset small] [--mode full] [--dtype float32] [--batch 8] [--seq 256]
        [--micro 4]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time

from torch.profiler import ProfilerActivity, profile
from train_step import make_batch, make_policy

from moerl.presets import init_model
from moerl.trainer.losses import sft_loss

# op-name fragments per kind, first match wins
KINDS = (
    ("GEMM (mm, bmm, grouped mm)", ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm", "aten::baddbmm")),
    ("attention (SDPA forward + backward)", ("scaled_dot_product",)),
    (
        "MoE routing (sort, gather / scatter, top-k)",
        ("index", "scatter", "gather", "sort", "bincount", "cumsum", "topk", "nonzero", "embedding"),
    ),
    ("optimizer (fused AdamW, grad norm)", ("_fused_adamw", "linalg_vector_norm", "aminmax", "_foreach")),
)
OTHER = "elementwise, norms, casts, concatenation"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--mode", default="full", choices=["full", "lora", "mxfp8"])
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as ckpt:
        init_model("qwen3_moe", args.preset, ckpt, seed=0)
        pol = make_policy(ckpt, args.mode, args.micro, args.dtype)
        batch = make_batch(args.batch, args.seq, ragged=True)
        pol.train_step(batch, sft_loss)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            pol.train_step(batch, sft_loss)
            wall = time.perf_counter() - start
    seconds = collections.Counter()
    for e in prof.key_averages():
        kind = next((k for k, frags in KINDS if any(f in e.key for f in frags)), OTHER)
        seconds[kind] += e.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    print(
        f"# {args.preset} {args.mode} {args.dtype}, {args.batch} ragged rows of <= {args.seq} tokens, micro-batch "
        f"{args.micro}: step {wall:.2f} s, profiled self time {total:.2f} s"
    )
    print("| kind of op | seconds | share |\n|---|---|---|")
    for kind, s in seconds.most_common():
        print(f"| {kind} | {s:.2f} | {s / total:.0%} |")


if __name__ == "__main__":
    main()
