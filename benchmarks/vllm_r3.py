"""What recording routed experts (R3) costs a vLLM engine: generation with ``capture_routing`` on against off.

Each contender is a fresh process (a vLLM engine through moerl's ``VLLMEngine`` on a random ``qwen3_moe`` preset;
one warm-up call, then the median of ``--calls`` timed ``generate`` calls of ``--seqs`` sequences x ``--tokens``
tokens); rounds run the two interleaved, rotating who goes first. Prints tokens/s per contender and the ratio.

    python benchmarks/vllm_r3.py [--presets tiny small] [--rounds 3] [--seqs 64] [--tokens 64]
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

CONTENDERS = ("r3", "no_r3")


def child(args) -> None:
    from moerl.engine import EngineConfig, Request, SamplingParams
    from moerl.rollout import make_engine

    cfg = EngineConfig(max_num_seqs=args.seqs, max_model_len=args.tokens + 16, capture_routing=args.child == "r3")
    engine = make_engine("vllm", args.ckpt, cfg)
    reqs = [
        Request([5 + i % 50, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=i))
        for i in range(args.seqs)
    ]
    try:
        engine.generate(reqs)
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            outs = engine.generate(reqs)
            times.append(time.perf_counter() - t0)
        assert all((c.routed_experts is not None) == (args.child == "r3") for o in outs for c in o.outputs)
    finally:
        engine.close()
    print(json.dumps({"tokens_per_s": args.seqs * args.tokens / statistics.median(times)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--child", choices=CONTENDERS)
    p.add_argument("--ckpt")
    args = p.parse_args()
    if args.child:
        return child(args)
    from moerl.presets import init_model

    print(
        f"# vLLM generate with and without R3 capture: {args.seqs} sequences x {args.tokens} tokens, median of "
        f"{args.calls} calls per fresh process, {args.rounds} interleaved rounds; torch {torch.__version__}, "
        f"cpu {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, {platform.machine()}"
    )
    print("| preset | contender | tokens/s (median, min-max of rounds) | vs no R3 |")
    print("|---|---|---|---|")
    for preset in args.presets:
        with tempfile.TemporaryDirectory() as d:
            ckpt = str(Path(d) / "model")
            init_model("qwen3_moe", preset, ckpt, seed=0)
            runs: dict[str, list[float]] = {c: [] for c in CONTENDERS}
            for r in range(args.rounds):
                order = CONTENDERS[r % 2 :] + CONTENDERS[: r % 2]
                for c in order:
                    cmd = [sys.executable, __file__, "--child", c, "--ckpt", ckpt, "--calls", str(args.calls)]
                    cmd += ["--seqs", str(args.seqs), "--tokens", str(args.tokens)]
                    runs[c].append(run_contender(cmd)["tokens_per_s"])
            ref = statistics.median(runs["no_r3"])
            for c in CONTENDERS:
                med = statistics.median(runs[c])
                print(
                    f"| {preset} | {c} | {med:,.0f} ({min(runs[c]):,.0f}-{max(runs[c]):,.0f}) | {med / ref:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
