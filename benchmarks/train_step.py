"""Training throughput per Policy mode: forward + backward + optimizer tokens/s, MFU and peak memory.

Modes: lora (rank 16 on q/k/v/o and the experts, frozen base in the compute dtype, fp32 adapters), full (compute
dtype, fp32 masters and AdamW state), mxfp8 (full with MXFP8-emulated GEMMs: fake quantization costs extra on a
CPU, it does not save anything there), and with ``--ragged`` full-padded (full without sequence packing).

``--ragged``: row lengths drawn from [seq / 4, seq] (right padding, as RL batches are) instead of full rows.

MFU: model FLOPs per second over the GEMM rate this machine reaches, in the same dtype, on the shapes the model
multiplies (each forward GEMM of a micro-batch: projections, experts at their average rows, head), measured in
the same run. Model FLOPs count real tokens only: 2 x active matmul parameters per token forward (+ causal
attention), backward twice that (full) or once (lora: activation gradients only, the base is frozen).

Every contender (and the GEMM rate) runs in a fresh process of its own, rounds interleaved in a rotating order;
each reports the median of its timed steps after a warm-up step and its peak RSS (VmHWM).

    python benchmarks/train_step.py [--preset small] [--dtype bfloat16] [--batch 8] [--seq 256] [--rounds 3]
        [--ragged] [--modes lora full mxfp8]
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
import torch.nn.functional as F
from contender import run_contender

from moerl.bridges import load_model
from moerl.model.lora import LoraConfig
from moerl.presets import init_model
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import sft_loss

MODES = ("lora", "full", "mxfp8", "full-padded", "full-compiled", "lora-compiled")


def make_policy(ckpt: str, mode: str, micro: int, dtype: str) -> Policy:
    lora = LoraConfig(rank=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "experts"])
    return Policy(
        ckpt,
        PolicyConfig(
            mode=mode.removesuffix("-padded").removesuffix("-compiled"),
            compile=mode.endswith("-compiled"),  # the others eager (auto would wait for the loop)
            dtype=dtype,
            lora=lora,
            micro_batch_size=micro,
            optim=OptimConfig(lr=1e-5),
            packing=not mode.endswith("-padded"),
        ),
    )


def make_batch(b: int, t: int, ragged: bool) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (b, t), generator=g)
    lengths = torch.randint(max(2, t // 4), t + 1, (b,), generator=g) if ragged else torch.full((b,), t)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return Batch(ids * mask, mask, mask)


def forward_flops(model, batch: Batch) -> tuple[float, list[tuple[int, int, int]]]:
    """Model FLOPs of one forward over the batch's real tokens, and the (rows, in, out) GEMMs of one forward."""
    cfg, mask = model.config, batch.attention_mask
    tokens = int(mask.sum())
    lengths = mask.sum(1).double()
    per_token, shapes = 0, []
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name or ".lora." in name:
            continue
        if "experts" in name and "shared" not in name and p.ndim == 3:  # routed experts: top_k of num_experts
            per_token += p[0].numel() * cfg.top_k
            rows = tokens * cfg.top_k // cfg.num_experts
            shapes += [(rows, p.shape[2], p.shape[1])] * p.shape[0]
        else:
            per_token += p.numel()
            shapes.append((tokens, p.shape[1], p.shape[0]))
    if cfg.tie_word_embeddings:
        per_token += cfg.vocab_size * cfg.hidden_size
    # causal attention: each query against (its position + 1) keys, q.k and p.v, every head
    heads, dim = cfg.num_heads, cfg.head_dim
    pairs = float((lengths * (lengths + 1) / 2).sum())
    attention = 2 * 2 * heads * dim * pairs * cfg.num_layers
    return 2.0 * per_token * tokens + attention, shapes


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gemm_rate(shapes: list[tuple[int, int, int]], dtype: torch.dtype, repeats: int = 3) -> float:
    """FLOP/s of the model's forward GEMMs (one micro-batch's shapes), each timed after a warm-up."""
    mats = [(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)) for m, k, n in shapes if m > 0]
    for x, w in mats:
        F.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        for x, w in mats:
            F.linear(x, w)
    seconds = time.perf_counter() - start
    return repeats * sum(2 * x.shape[0] * x.shape[1] * w.shape[0] for x, w in mats) / seconds


def child(args) -> None:
    batch = make_batch(args.batch, args.seq, args.ragged)
    if args.child == "gemm":
        _, shapes = forward_flops(load_model(args.ckpt), batch.rows(slice(0, args.micro)))
        print(json.dumps({"flops_per_s": gemm_rate(shapes, getattr(torch, args.dtype))}))
        return
    pol = make_policy(args.ckpt, args.child, args.micro, args.dtype)
    start = time.perf_counter()
    pol.train_step(batch, sft_loss)  # warm-up (compiled modes: the compilation, inductor's caches off)
    first = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        pol.train_step(batch, sft_loss)
        times.append(time.perf_counter() - start)
    fwd, _ = forward_flops(pol.model, batch)
    backward = 1.0 if args.child.startswith("lora") else 2.0  # lora: no weight gradients for the frozen base
    row = {"seconds": statistics.median(times), "flops": fwd * (1 + backward), "peak_mb": peak_mb(), "first": first}
    print(json.dumps(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender and round")
    p.add_argument("--ragged", action="store_true")
    p.add_argument("--modes", nargs="+", choices=MODES)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    modes = args.modes or (["lora", "full", "mxfp8"] + (["full-padded"] if args.ragged else []))
    contenders = [*modes, "gemm"]
    runs = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory() as ckpt:
        init_model("qwen3_moe", args.preset, ckpt, seed=0)
        common = ["--ckpt", ckpt, "--dtype", args.dtype, "--batch", str(args.batch), "--seq", str(args.seq)]
        common += ["--micro", str(args.micro), "--steps", str(args.steps)] + (["--ragged"] if args.ragged else [])
        for r in range(args.rounds):
            k = r % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                cold = os.environ | {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}  # each compiled run compiles anew
                env = cold if c.endswith("-compiled") else None
                runs[c].append(run_contender([sys.executable, __file__, "--child", c, *common], env=env))
    rate = [x["flops_per_s"] for x in runs["gemm"]]
    peak = statistics.median(rate)
    tokens = int(make_batch(args.batch, args.seq, args.ragged).attention_mask.sum())
    print(
        f"# train step, qwen3_moe {args.preset}, {args.dtype}, batch {args.batch} x {args.seq} tokens"
        f"{' (ragged: ' + str(tokens) + ' real tokens)' if args.ragged else ''} (micro-batch {args.micro}), median of"
        f" {args.rounds} rounds x {args.steps} steps, each contender in a fresh process; torch {torch.__version__},"
        f" {torch.get_num_threads()} threads, {platform.machine()}, CPU {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"GEMM rate on the model's shapes ({args.dtype}): {peak / 1e9:.1f} GFLOP/s "
        f"(spread {min(rate) / 1e9:.1f}..{max(rate) / 1e9:.1f})"
    )
    print("| mode | tokens/s (spread) | vs full | model TFLOP/step | MFU | peak RSS (MB) | first step (s) |")
    print("|---|---|---|---|---|---|---|")
    tps = {m: [tokens / x["seconds"] for x in runs[m]] for m in modes}
    full = statistics.median(tps["full"]) if "full" in tps else None
    for m in modes:
        med = statistics.median(tps[m])
        flops = runs[m][0]["flops"]
        mfu = flops / statistics.median(x["seconds"] for x in runs[m]) / peak
        vs = f"{med / full:.2f}x" if full else "-"
        print(
            f"| {m} | {med:,.0f} ({min(tps[m]):,.0f}..{max(tps[m]):,.0f}) | {vs} | {flops / 1e12:.3f} | {mfu:.0%} |"
            f" {statistics.median(x['peak_mb'] for x in runs[m]):,.0f} |"
            f" {statistics.median(x['first'] for x in runs[m]):.1f} |"
        )


if __name__ == "__main__":
    main()
