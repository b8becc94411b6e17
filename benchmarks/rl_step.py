"""Seconds per RL step and samples/s: moerl's loop vs TRL's GRPOTrainer (in its own venv; the column is skipped
without it), same checkpoint, prompts and sizes: 16 prompts x group 8 x 16 new tokens, tiny and small presets.

moerl: the full step of ``moerl.loop.train`` (generate with routing capture, rewards, the training forward with R3,
one PPO epoch, weight sync), in full mode (fp32 masters: what TRL's trainer does) and in LoRA mode (every linear
layer and the experts). TRL: ``benchmarks/trl_grpo_step.py`` (full fine-tune). Every contender computes in
each of ``--dtypes`` (default: fp32, and bf16 too where the CPU multiplies it natively; TRL's bf16 is autocast):
a row per contender and dtype, and "vs TRL" against TRL's fastest dtype, so every contender is compared in its best
dtype. The fidelity beside the speed: the rollout-vs-trainer mismatch (k3, mean per token) with R3 (median over the
steps) and without it (the last step's: ``algo.mismatch_metric_every`` set to measure it there). The first step of
each run is a warm-up; a run's figure is the median of the rest; each run is a fresh process, ``--rounds`` of them
per contender interleaved in a rotating order; the table shows the median over rounds and the spread. The first
line names the host (CPU features, what ``auto`` picks).

The peers live in venvs of their own (CI does not need them): ``make peers`` creates ``.venv-trl`` (TRL 1.16 and its
transformers beside the same CPU torch); ``--trl-python`` (or ``MOERL_TRL_PYTHON``) points elsewhere.

``--engines process:1 process:2`` adds rows with the rollouts on native engines in their own processes
(placement:num_engines), ``vllm:1 vllm:2`` rows with vLLM engines (full mode: the CPU build of vLLM serves no MoE
LoRA).

    python benchmarks/rl_step.py [--presets tiny small] [--steps 5] [--rounds 1] [--dtypes float32 bfloat16]
        [--modes full lora] [--trl-python .venv-trl/bin/python] [--engines process:1 vllm:1]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from contender import add_child_args, add_dtypes, rl_overrides, run_contender
from contender import dtypes as contender_dtypes

from moerl.config import load_config
from moerl.loop import RunConfig, train
from moerl.precision import host_summary
from moerl.presets import init_model

HERE = Path(__file__).resolve().parent
CPU = torch.backends.cpu.get_cpu_capability()  # AVX2-only hosts have no fast bf16 GEMM
STAGES = ("seconds_generate", "seconds_logprobs", "seconds_train", "seconds_sync")


def moerl_step(
    ckpt: str, run_dir: str, args, dtype: str, mode: str, placement: str = "inprocess", engines: int = 1
) -> dict:
    """One moerl contender in a fresh child process (this script with ``--child``)."""
    cmd = [sys.executable, __file__, "--child", f"{mode}:{placement}:{engines}", "--ckpt", ckpt, "--run-dir", run_dir]
    cmd += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group)]
    cmd += ["--new-tokens", str(args.new_tokens), "--dtype", dtype]
    return run_contender(cmd)


def child(args) -> None:
    mode, placement, engines = args.child.split(":")
    mode, compiled = mode.removesuffix("-compiled"), mode.endswith("-compiled")
    ckpt, run_dir = args.ckpt, args.run_dir
    cfg = load_config(
        RunConfig,
        None,
        [
            *rl_overrides(run_dir, ckpt, mode, args.dtype, args.steps, args.prompts, args.group, args.new_tokens),
            f"rollout.num_engines={engines}",
            f"algo.mismatch_metric_every={args.steps - 1}",  # the R3-off mismatch once, on the last step
            *(["rollout.engine=vllm"] if placement == "vllm" else [f"rollout.placement={placement}"]),
            # what auto settles on in a long run where compiling pays; the first (dropped) step compiles
            *(["policy.compile=true", "rollout.compile_decode=true"] if compiled else []),
        ],
    )
    train(cfg)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "seconds_train" in r][1:]  # the first step warms up
    secs = statistics.median(sum(r[s] for s in STAGES) for r in steps)
    stage = {s.removeprefix("seconds_"): statistics.median(r[s] for r in steps) for s in STAGES}
    k3 = {
        "r3": statistics.median(r["mismatch_k3_r3"] for r in steps),
        "no_r3": next((r["mismatch_k3_no_r3"] for r in reversed(steps) if "mismatch_k3_no_r3" in r), None),
    }
    out = {"seconds_per_step": secs, "samples_per_s": args.prompts * args.group / secs, "stages": stage, "k3": k3}
    print(json.dumps(out))


def trl_step(python: str, ckpt: str, args, dtype: str) -> dict:
    cmd = [
        python,
        str(HERE / "trl_grpo_step.py"),
        "--model",
        ckpt,
        "--prompts",
        str(args.prompts),
        "--group",
        str(args.group),
        "--new-tokens",
        str(args.new_tokens),
        "--steps",
        str(args.steps),
        "--dtype",
        dtype,
    ]
    return run_contender(cmd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="runs of every contender, interleaved in a rotating order")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    add_dtypes(p)
    p.add_argument(
        "--modes",
        nargs="+",
        default=["full", "lora"],
        choices=["full", "lora", "full-compiled", "lora-compiled"],
        help="-compiled: the trainer's blocks and the engine's decode step compiled from the start",
    )
    p.add_argument(
        "--archs", nargs="+", default=["qwen3_moe"], help="moerl contenders per architecture (TRL: the first)"
    )
    p.add_argument(
        "--trl-python", default=os.environ.get("MOERL_TRL_PYTHON", str(HERE.parent / ".venv-trl/bin/python"))
    )
    p.add_argument(
        "--engines",
        nargs="*",
        default=[],
        help="more rollouts for moerl, e.g. process:1 process:2 vllm:1 (placement or vllm:num_engines)",
    )
    add_child_args(p)
    args = p.parse_args()
    if args.child:
        return child(args)
    dtypes = contender_dtypes(args)
    trl = args.trl_python if Path(args.trl_python).exists() else None
    print(f"# {host_summary()}")
    print(
        f"# RL step, {args.prompts} prompts x group {args.group} x {args.new_tokens} new tokens, each contender in "
        f"{' and '.join(dtypes)}, median of {args.rounds} round(s) x {args.steps - 1} timed steps; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, cpu {CPU}, {platform.machine()}; TRL: "
        f"{args.trl_python if trl else 'not installed (make peers), skipped'}"
    )
    print(
        "| preset | engine | dtype | s/step (spread) | samples/s | stages (gen / logprobs / train / sync s) | k3 R3 |"
        " k3 no R3 | vs TRL's best |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        with tempfile.TemporaryDirectory() as d:
            contenders = {}
            for arch in args.archs:
                ckpt = str(Path(d) / arch)
                init_model(arch, preset, ckpt, seed=0)
                for m in args.modes:
                    for where in ["inprocess:1", *args.engines]:
                        placement, n = where.split(":")
                        if placement == "vllm" and m.startswith("lora"):
                            continue
                        name = f"moerl {m}" + ("" if where == "inprocess:1" else f" ({placement}, {n} engines)")
                        name += "" if arch == args.archs[0] else f" [{arch}]"
                        for dt in dtypes:
                            run_dir = str(Path(d) / f"{arch}-{m}-{placement}-{n}-{dt}")
                            contenders[(name, dt)] = (ckpt, run_dir, dt, m, placement, int(n))
            ckpt = str(Path(d) / args.archs[0])
            if trl:
                for dt in dtypes:
                    contenders[("TRL GRPOTrainer", dt)] = dt
            names = list(contenders)
            rows = {n: [] for n in names}
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    c = contenders[name]
                    if isinstance(c, str):
                        rows[name].append(trl_step(trl, ckpt, args, c))
                    else:
                        shutil.rmtree(c[1], ignore_errors=True)
                        rows[name].append(moerl_step(c[0], c[1], args, *c[2:]))
        ref = None
        if trl:  # TRL in its fastest dtype on this host
            best = min(statistics.median(x["seconds_per_step"] for x in rows[("TRL GRPOTrainer", dt)]) for dt in dtypes)
            ref = args.prompts * args.group / best
        for (name, dtype), runs in rows.items():
            secs = [x["seconds_per_step"] for x in runs]
            med = statistics.median(secs)
            st = "-"
            if "stages" in runs[0]:
                st = " / ".join(f"{statistics.median(x['stages'][k] for x in runs):.2f}" for k in runs[0]["stages"])
            sps = args.prompts * args.group / med
            vs = f"{sps / ref:.2f}x" if ref else "n/a"
            k3 = []
            for key in ("r3", "no_r3"):  # TRL reports none
                got = [x["k3"][key] for x in runs if "k3" in x and x["k3"][key] is not None]
                k3.append(f"{statistics.median(got):.1e}" if got else "-")
            print(
                f"| {preset} | {name} | {dtype} | {med:.2f} ({min(secs):.2f}..{max(secs):.2f}) | {sps:.1f} | {st} |"
                f" {k3[0]} | {k3[1]} | {vs} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
