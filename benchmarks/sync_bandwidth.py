"""Weight-sync bandwidth per mode to a native engine in another process, as a ratio to a plain memcpy of the same
bytes on the same machine.

Contenders per preset and mode: ``process`` (the engine in its own process: shared-memory buckets, staged and
committed there), ``inprocess`` (the engine in the trainer's process), ``memcpy`` (one ``copy_`` of a buffer of
the same size, the floor of any transfer) and, with ``--vllm``, a vLLM engine (the same shared-memory buckets,
loaded by moerl's worker extension; LoRA and MXFP8 in the dense form: merged weights, MX-rounded bf16 values) and
``vllm-reload``, the same engine committing each sync through vLLM's general in-place ``reload_weights`` instead
(how moerl's worker committed before it loaded through the model's own loaders: the baseline). Each
measurement is a fresh child process (model built, one warm-up sync, then the median of ``--syncs`` timed syncs);
rounds run the contenders interleaved, rotating who goes first.

    python benchmarks/sync_bandwidth.py [--presets tiny small] [--rounds 3] [--syncs 5] [--vllm]
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

CPU = torch.backends.cpu.get_cpu_capability()  # AVX2-only hosts have no fast bf16 GEMM

MODES = ("full", "lora", "mxfp8")
CONTENDERS = ("process", "inprocess", "memcpy")  # and VLLM with --vllm
VLLM = ("vllm", "vllm-reload")


def child(args) -> None:
    from moerl.engine import EngineConfig
    from moerl.model.lora import LoraConfig
    from moerl.rollout import make_engine
    from moerl.sync import sync_policy
    from moerl.trainer import Policy, PolicyConfig

    lora = LoraConfig(rank=16, alpha=32, layout="shared_outer")
    policy = Policy(args.ckpt, PolicyConfig(mode=args.mode, dtype="bfloat16", lora=lora))
    dense = "bfloat16" if args.child in VLLM else None  # what a vLLM engine is sent: LoRA merged, MX values
    nbytes = sum(t.numel() * t.element_size() for _, t in policy.sync_tensors(dense))
    times = []
    if args.child == "memcpy":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        for _ in range(args.syncs):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    else:
        lora_engine = args.mode == "lora"
        cfg = EngineConfig(max_num_seqs=4, max_model_len=64, max_loras=int(lora_engine), max_lora_rank=16)
        cfg.lora_layout = "shared_outer"
        mx = "rceil" if args.mode == "mxfp8" else None
        if args.child in VLLM:
            if args.child == "vllm-reload":  # vLLM's worker imports the extension class by name: from this folder
                import os

                import moerl.rollout.vllm_args as moerl_vllm

                here = str(Path(__file__).resolve().parent)
                os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
                moerl_vllm.EXTENSION = "vllm_reload_commit.ReloadCommit"
            engine = make_engine("vllm", args.ckpt, cfg, mx_scale_mode=mx)
        else:
            engine = make_engine(
                "native", args.ckpt, cfg, placement=args.child, threads=torch.get_num_threads(), mx_scale_mode=mx
            )
        try:
            sync_policy(policy, engine, version=0, bucket_bytes=args.bucket_mb << 20)
            for v in range(args.syncs):
                t0 = time.perf_counter()
                sync_policy(policy, engine, version=v + 1, bucket_bytes=args.bucket_mb << 20)
                times.append(time.perf_counter() - t0)
        finally:
            engine.close()
    print(json.dumps({"bytes": nbytes, "seconds": statistics.median(times)}))


def run_child(script: str, ckpt: str, mode: str, contender: str, args) -> dict:
    cmd = [sys.executable, script, "--child", contender, "--mode", mode, "--ckpt", ckpt]
    cmd += ["--syncs", str(args.syncs), "--bucket-mb", str(args.bucket_mb)]
    return run_contender(cmd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--vllm", action="store_true", help="add vLLM as a contender")
    p.add_argument("--child", choices=(*CONTENDERS, *VLLM))
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--ckpt")
    args = p.parse_args()
    if args.child:
        return child(args)
    from moerl.presets import init_model

    print(
        f"# weight sync to a native engine, bucket {args.bucket_mb} MiB, median of {args.syncs} syncs per fresh "
        f"process, {args.rounds} interleaved rounds; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu {CPU}, {platform.machine()}"
    )
    print("| preset | mode | MB sent | contender | ms a sync | GB/s (median, min-max of rounds) | vs memcpy |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        with tempfile.TemporaryDirectory() as d:
            ckpt = str(Path(d) / "model")
            init_model("qwen3_moe", preset, ckpt, seed=0)
            for mode in args.modes:
                contenders = CONTENDERS + (VLLM if args.vllm else ())
                runs: dict[str, list[dict]] = {c: [] for c in contenders}
                for r in range(args.rounds):
                    k = r % len(contenders)
                    for c in contenders[k:] + contenders[:k]:
                        runs[c].append(run_child(__file__, ckpt, mode, c, args))
                gbs = {c: [x["bytes"] / x["seconds"] / 1e9 for x in v] for c, v in runs.items()}
                ref = statistics.median(gbs["memcpy"])
                for c in contenders:
                    med, mb = statistics.median(gbs[c]), runs[c][0]["bytes"] / 1e6
                    ms = statistics.median(x["seconds"] for x in runs[c]) * 1e3
                    print(
                        f"| {preset} | {mode} | {mb:.1f} | {c} | {ms:.1f} | {med:.2f} ({min(gbs[c]):.2f}-"
                        f"{max(gbs[c]):.2f}) | {med / ref:.2f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
