"""Where a decode step's time goes, module by module, for engines side by side in one process (issue 42: what bounds
LoRA decode against the base engine).

Each contender (``benchmarks/decode.py``'s names) is built on the same checkpoint; forward hooks time every decoder
layer's children (norms, q / k / v / o, the router, the experts) summed over the layers. Generates of 64 x
``--new-tokens`` alternate between the contenders for ``--rounds`` rounds after a warm-up; the table gives ms per
generated token step (a generate's seconds over its new tokens: the prefill's share included), the whole generate
first. The hooks add a little to every module alike; ``benchmarks/decode.py`` measures without them, in fresh
processes.

    PYTHONPATH=. python benchmarks/decode_profile.py [--preset small] [--contenders "moerl base" "moerl LoRA
        shared_outer fused"]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path

import torch
from decode import CONTENDERS, build

from moerl.precision import host_summary
from moerl.presets import init_model


def timed(model: torch.nn.Module, spent: dict[str, float]) -> None:
    """Hooks adding each layer child's forward seconds to ``spent`` under its name (``self_attn.q_proj``, ...)."""

    def add(module: torch.nn.Module, key: str) -> None:
        def pre(m, args):
            m._moerl_t0 = time.perf_counter()

        def post(m, args, out):
            spent[key] += time.perf_counter() - m._moerl_t0

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    add(model, "model forward")
    for layer in model.layers:
        for name, child in layer.named_children():
            add(child, name)
            for sub, grandchild in child.named_children():
                add(grandchild, f"{name}.{sub}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--contenders", nargs="+", default=["moerl base", "moerl LoRA shared_outer fused"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    bad = [n for n in args.contenders if n not in CONTENDERS or not n.startswith("moerl")]
    if bad:
        p.error(f"--contenders {bad}: moerl engines only, from {[n for n in CONTENDERS if n.startswith('moerl')]}")
    print(f"# {host_summary()}; uptime: {os.popen('uptime').read().strip()}")
    spent = {n: collections.defaultdict(float) for n in args.contenders}
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(Path(d) / args.preset)
        init_model("qwen3_moe", args.preset, ckpt, seed=0)
        runs = {}
        for name in args.contenders:
            run, _ = build(name, ckpt, 64, 16 + args.new_tokens + 16, args.dtype)
            timed(run.engine.model, spent[name])
            run(8, 0)  # the warm-up (a compiled contender compiles here)
            runs[name] = run
        for s in spent.values():
            s.clear()
        for r in range(args.rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(args.new_tokens, r)
                spent[name]["generate (all of it)"] += time.perf_counter() - t0
    steps = args.rounds * args.new_tokens
    keys = ["generate (all of it)", *[k for k in spent[args.contenders[0]] if k != "generate (all of it)"]]
    print(f"\n# ms per decode step, {args.preset}, {args.dtype}, 64 sequences, {args.rounds} rounds x {args.new_tokens}"
          " tokens, contenders alternating in one process")  # fmt: skip
    print("| module (summed over the layers) | " + " | ".join(args.contenders) + " | difference |")
    print("|---|" + "---|" * (len(args.contenders) + 1))
    for key in keys:
        ms = [spent[n][key] / steps * 1e3 for n in args.contenders]
        print(f"| {key} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[-1] - ms[0]:+.2f} |")


if __name__ == "__main__":
    main()
