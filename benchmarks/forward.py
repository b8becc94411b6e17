"""Forward throughput: moerl (grouped and loop expert paths) vs transformers, same checkpoint, bf16, CPU.

Contenders run interleaved round by round so machine noise hits them alike; the table reports the median
tokens/s and the ratios, which are what to compare across machines.

    python benchmarks/forward.py [--presets tiny small] [--rounds 7] [--batch 16] [--seq 128]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from moerl.bridges import load_model
from moerl.presets import count_params, init_model


def bench(preset: str, arch: str, rounds: int, batch: int, seq: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        init_model(arch, preset, d, seed=0)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
        ours = load_model(d, dtype=torch.bfloat16)
    ids = torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(0))

    def run_hf():
        return hf(ids).logits

    def run_grouped():
        ours.set_expert_path(grouped=True)
        return ours(ids).logits

    def run_loop():
        ours.set_expert_path(grouped=False)
        return ours(ids).logits

    contenders = {"transformers": run_hf, "moerl grouped": run_grouped, "moerl loop": run_loop}
    times = {name: [] for name in contenders}
    with torch.inference_mode():
        for fn in contenders.values():  # warm-up
            fn()
        for _ in range(rounds):
            for name, fn in contenders.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    tokens = batch * seq
    return {
        "preset": preset,
        "params": count_params(ours),
        "experts_impl": hf.config._experts_implementation,
        **{name: tokens / statistics.median(t) for name, t in times.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    print(
        f"# forward tokens/s, {args.arch}, bf16, batch {args.batch} x {args.seq} tokens, median of {args.rounds} "
        f"interleaved rounds; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        "| preset | params | transformers (experts impl) | moerl grouped | moerl loop | grouped / transformers "
        "| loop / transformers | grouped / loop |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        r = bench(preset, args.arch, args.rounds, args.batch, args.seq)
        hf, g, loop = r["transformers"], r["moerl grouped"], r["moerl loop"]
        print(
            f"| {preset} | {r['params'] / 1e6:.1f}M | {hf:,.0f} ({r['experts_impl']}) | {g:,.0f} | {loop:,.0f} "
            f"| {g / hf:.2f}x | {loop / hf:.2f}x | {g / loop:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
