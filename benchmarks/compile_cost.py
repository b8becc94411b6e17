"""What compiling costs a run the first time and the next time (issue 42 part 3): the first call of the engine's
compiled decode step and of the trainer's compiled blocks, each in a fresh process, with inductor's cache empty
("cold", a new cache directory per round) and then holding that graph ("warm", the next process on the same
directory), rounds interleaved. The warm figure is what ``auto`` prices a compilation at in the next run
(``moerl.dynamo``'s ledger), where it used to assume the cold one.

    PYTHONPATH=. python benchmarks/compile_cost.py [--presets tiny small] [--rounds 3]

A first call's seconds include one step's own work (a decode step of 64 rows; a training step of 16 x 64 tokens),
printed beside it (the second call).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from contender import add_child_args, run_contender

GRAPHS = ("decode", "train")


def child(args) -> None:
    """One graph's first and second call in this fresh process."""
    import torch

    from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams

    torch.set_num_threads(args.threads)
    if args.child == "decode":
        engine = LLMEngine(args.ckpt, EngineConfig(max_num_seqs=64, max_model_len=48, compile_decode=True),
                           dtype=torch.float32)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(4, 100, (64, 16), generator=g).tolist()

        def call() -> None:  # a prefill, then the decode steps: the first decode step compiles
            params = SamplingParams(temperature=1.0, max_tokens=2, min_tokens=2, ignore_eos=True, seed=0)
            engine.generate([Request(p, params) for p in prompts])
    else:
        from moerl.trainer import Batch, Policy, PolicyConfig
        from moerl.trainer.losses import sft_loss

        policy = Policy(args.ckpt, PolicyConfig(mode="full", dtype="float32", compile=True))
        ids = torch.randint(4, 100, (16, 64), generator=torch.Generator().manual_seed(0))
        batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))

        def call() -> None:
            policy.train_step(batch, sft_loss, replay=False)

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    print(json.dumps({"first": first, "second": time.perf_counter() - t0}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    add_child_args(p)
    args = p.parse_args()
    if args.child:
        return child(args)
    from moerl.presets import init_model

    print(f"# uptime: {os.popen('uptime').read().strip()}")
    runs: dict[tuple[str, str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as d:
        for preset in args.presets:
            init_model("qwen3_moe", preset, Path(d) / preset, seed=0)
        for r in range(args.rounds):
            for preset in args.presets:
                for graph in GRAPHS[r % 2 :] + GRAPHS[: r % 2]:  # rotate which graph runs first
                    cache = tempfile.mkdtemp(dir=d)  # empty: the first process compiles cold, the next warm
                    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": os.getcwd()}
                    cmd = [sys.executable, __file__, "--child", graph, "--ckpt", str(Path(d) / preset)]
                    for state in ("cold", "warm"):
                        out = run_contender(cmd + ["--threads", str(args.threads)], env=env)
                        runs.setdefault((preset, graph, state), []).append(out)
    print(f"\n# the first call of a compiled graph, fresh processes, {args.threads} threads, median of {args.rounds}"
          " rounds (spread)")  # fmt: skip
    print("| preset | graph | inductor's cache | first call s | second call s | warm / cold |")
    print("|---|---|---|---|---|---|")
    for (preset, graph, state), outs in runs.items():
        first = [o["first"] for o in outs]
        cold = statistics.median(o["first"] for o in runs[(preset, graph, "cold")])
        ratio = f"{statistics.median(first) / cold:.2f}" if state == "warm" else ""
        print(f"| {preset} | {graph} | {state} | {statistics.median(first):.1f} ({min(first):.1f}..{max(first):.1f}) | "
              f"{statistics.median(o['second'] for o in outs):.2f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
