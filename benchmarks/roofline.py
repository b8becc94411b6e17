"""The roofline of this machine for moerl's presets: measured memory bandwidth and GEMM rates, and the bounds they
put on a decode step and a training step.

Measured, each kernel in a fresh process per round, rounds interleaved in a rotating order (median and spread over
rounds; within a process the best of ``--reps``):

- memory bandwidth at the thread count moerl uses: a streaming read (the faster of ``sum`` of a 256 MiB fp32 tensor
  and a GEMV over it as an [8192, n] matrix: on some hosts the reduction's own loop, not memory, bounds ``sum``) and
  a copy (``copy_`` of one: bytes read + bytes written);
- GEMM rates (GFLOP/s) in fp32 and bf16 at the shapes a decode step of 64 sequences and a training micro-batch of
  the preset run (the experts' gate-up and down projections with the rows an expert gets, the attention's qkv
  projection), and at a 2048^3 GEMM as the machine's peak.

From them, per preset and dtype: the bytes a decode step must read (every weight but the embedding table, which a
step gathers rows of, plus the KV cache at the mean context) over the read bandwidth, as milliseconds per step and
tokens/s for 64 sequences; and a training step's FLOPs over the GEMM rate at its shapes. Every decode and train figure
in BENCHMARKS.md is set against these bounds.

    python benchmarks/roofline.py [--rounds 3] [--reps 5] [--presets tiny small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SEQS, PROMPT, NEW = 64, 16, 64  # the decode benchmark's workload (benchmarks/decode.py)
TRAIN_ROWS = 64 * 32  # tokens of a training micro-batch: 64 sequences of 32 tokens
BANDWIDTH_MIB = 256


def _best(fn, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` (after one untimed), in seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth(reps: int) -> dict:
    n = BANDWIDTH_MIB * 2**20 // 4
    src, dst = torch.rand(n), torch.empty(n)
    matrix, vector = src.view(8192, -1), torch.rand(n // 8192)
    read = min(_best(lambda: src.sum(), reps), _best(lambda: matrix @ vector, reps))
    copy = _best(lambda: dst.copy_(src), reps)
    nbytes = n * 4
    return {"read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9}


def gemm_shapes(preset: str) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the GEMMs a decode step and a training micro-batch of ``preset`` run, and the peak square one."""
    from moerl.presets import PRESETS

    p = PRESETS[preset]
    per_expert = SEQS * p.top_k // p.num_experts  # decode rows an expert gets, spread evenly
    qkv = (p.num_heads + 2 * p.num_kv_heads) * p.head_dim
    train_per_expert = TRAIN_ROWS * p.top_k // p.num_experts
    return {
        "decode gate_up": (per_expert, p.hidden_size, 2 * p.moe_intermediate_size),
        "decode down": (per_expert, p.moe_intermediate_size, p.hidden_size),
        "decode qkv": (SEQS, p.hidden_size, qkv),
        "train gate_up": (train_per_expert, p.hidden_size, 2 * p.moe_intermediate_size),
        "train qkv": (TRAIN_ROWS, p.hidden_size, qkv),
    }


def measure_gemm(shape: tuple[int, int, int], dtype: str, reps: int) -> dict:
    m, k, n = shape
    dt = getattr(torch, dtype)
    a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
    out = torch.empty(m, n, dtype=dt)
    calls = max(1, int(2e8 // (2 * m * k * n)))  # ~0.2 GFLOP a timing: small GEMMs repeated
    seconds = _best(lambda: [torch.mm(a, b, out=out) for _ in range(calls)], reps) / calls
    return {"gflops": 2 * m * k * n / seconds / 1e9, "us": seconds * 1e6}


def decode_bytes(preset: str, dtype: str) -> int:
    """Bytes one decode step of 64 sequences reads: every weight but the embedding table (routers fp32), and the KV
    cache at the mean context of the decode benchmark."""
    from moerl.model.transformer import MoEModel
    from moerl.presets import preset_config

    _, cfg = preset_config("qwen3_moe", preset)
    dt = getattr(torch, dtype)
    with torch.device("meta"):
        model = MoEModel(cfg, dt)
    weights = sum(
        p.numel() * (4 if ".router." in n else dt.itemsize)
        for n, p in model.named_parameters()
        if not n.startswith("embed_tokens")
    )
    if cfg.tie_word_embeddings:  # the lm_head is the embedding: read whole by the logits
        weights += model.embed_tokens.weight.numel() * dt.itemsize
    context = PROMPT + NEW / 2
    kv = SEQS * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dt.itemsize
    return int(weights + kv)


def train_flops(preset: str) -> float:
    """FLOPs of a forward and backward of a ``TRAIN_ROWS``-token micro-batch: 6 per active parameter per token (the
    weights each token meets: the experts it is routed to, not the others), the lm_head included."""
    from moerl.model.transformer import MoEModel
    from moerl.presets import preset_config

    _, cfg = preset_config("qwen3_moe", preset)
    with torch.device("meta"):
        model = MoEModel(cfg, torch.float32)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens")) - experts
    lm_head = model.embed_tokens.weight.numel() if cfg.tie_word_embeddings else 0
    active = rest + lm_head + experts * cfg.top_k / cfg.num_experts
    return 6 * active * TRAIN_ROWS


def child(args) -> None:
    torch.manual_seed(0)
    kind, *rest = args.child.split(":")
    if kind == "bandwidth":
        out = measure_bandwidth(args.reps)
    else:
        preset, name, dtype = rest
        shape = (2048, 2048, 2048) if name == "peak" else gemm_shapes(preset)[name]
        out = measure_gemm(shape, dtype, args.reps)
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from moerl.precision import host_summary

    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(host_summary())
    jobs = ["bandwidth"] + [f"gemm:-:peak:{d}" for d in args.dtypes]
    jobs += [f"gemm:{pr}:{name}:{d}" for pr in args.presets for name in gemm_shapes(pr) for d in args.dtypes]
    results: dict[str, list[dict]] = {j: [] for j in jobs}
    for r in range(args.rounds):
        order = jobs[r % len(jobs) :] + jobs[: r % len(jobs)]  # rotating: no kernel always runs first or last
        for job in order:
            cmd = [sys.executable, str(Path(__file__)), "--child", job, "--reps", str(args.reps)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=HERE, env=os.environ)
            results[job].append(json.loads(done.stdout.strip().splitlines()[-1]))

    def med(job: str, key: str) -> tuple[float, float, float]:
        values = [x[key] for x in results[job]]
        return statistics.median(values), min(values), max(values)

    read, copy = med("bandwidth", "read_gbs"), med("bandwidth", "copy_gbs")
    print(f"\nmemory bandwidth ({torch.get_num_threads()} threads, {BANDWIDTH_MIB} MiB, median [min-max] of "
          f"{args.rounds} rounds):")  # fmt: skip
    print(f"  read {read[0]:.1f} GB/s [{read[1]:.1f}-{read[2]:.1f}]", end="   ")
    print(f"copy {copy[0]:.1f} GB/s [{copy[1]:.1f}-{copy[2]:.1f}]")
    print("\nGEMM rate, GFLOP/s (median [min-max]):")
    print(f"  {'shape':<32}" + "".join(f"{d:>24}" for d in args.dtypes))
    rows = [("peak 2048x2048x2048", "-", "peak")]
    rows += [(f"{pr} {name} {gemm_shapes(pr)[name]}", pr, name) for pr in args.presets for name in gemm_shapes(pr)]
    for label, pr, name in rows:
        cells = []
        for d in args.dtypes:
            g = med(f"gemm:{pr}:{name}:{d}", "gflops")
            cells.append(f"{g[0]:8.1f} [{g[1]:.1f}-{g[2]:.1f}]")
        print(f"  {label:<32}" + "".join(f"{c:>24}" for c in cells))
    context = f"context {PROMPT}+{NEW // 2} on average"
    print(f"\nbounds ({SEQS} sequences decoding, {context}; read bandwidth {read[0]:.1f} GB/s):")
    for pr in args.presets:
        for d in args.dtypes:
            nbytes = decode_bytes(pr, d)
            ms = nbytes / (read[0] * 1e9) * 1e3
            print(f"  {pr:<6} {d:<9} a decode step reads {nbytes / 2**20:7.1f} MiB: >= {ms:6.2f} ms/step, "
                  f"<= {SEQS / ms * 1e3:9.0f} tokens/s")  # fmt: skip
    for pr in args.presets:
        flops = train_flops(pr)
        for d in args.dtypes:
            at = med(f"gemm:{pr}:train gate_up:{d}", "gflops")[0]
            peak = med(f"gemm:-:peak:{d}", "gflops")[0]
            bounds = f">= {flops / at / 1e6:7.1f} ms at its expert GEMMs' rate, >= {flops / peak / 1e6:7.1f} ms at peak"
            print(f"  {pr:<6} {d:<9} a training micro-batch of {TRAIN_ROWS} tokens: {flops / 1e9:6.2f} GFLOP: {bounds}")


if __name__ == "__main__":
    main()
