"""Where a decode step's time goes on a GPU, eager engine beside the compiled one (CUDA graphs), under torch.profiler.

The first GPU run of ``make gpu-check`` measured the compiled decode (CUDA graphs) at 0.95x the eager engine on
Qwen3-30B-A3B shapes (2 layers, 16 sequences) and the eager engine at 15% of the HBM roofline. This prints, for
each engine, the wall milliseconds of a decode step, the device's busy milliseconds (summed kernel time) within it,
the forward's share (``engine.decode_seconds``), and the ops that take the host's and the device's time, so the gap
between the wall time and the kernels is named. Tables go to ``$OUT`` where set (the device machine's output folder).

    PYTHONPATH=. DEV=cuda python benchmarks/gpu_decode_profile.py [--seqs 16] [--tokens 32]
    PYTHONPATH=. DEV=cpu  python benchmarks/gpu_decode_profile.py     # the dry run, small shapes, CPU only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import COMPILED_SHAPES, CUDA, DT, QWEN3_30B_A3B, SMALL_MOE, _random_model, requests, sync  # noqa: E402

from moerl.engine import EngineConfig, LLMEngine  # noqa: E402


def profiled(engine: LLMEngine, seqs: int, tokens: int, label: str, out: Path | None) -> str:
    """One generate of ``seqs`` x ``tokens`` under the profiler (after a warm one): a line of figures per decode
    step, and the op tables written to ``out``."""
    engine.generate(requests(seqs, tokens))  # compile / record the graphs, warm the allocator
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    engine.decode_seconds = 0.0
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.generate(requests(seqs, tokens, seed=1))
        sync()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # the device's own events (kernels, copies): a CPU op's device time repeats its kernels'
    device_us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    steps = tokens - 1  # decode steps; the prefill's share is in the wall time
    tables = [
        events.table(sort_by="self_cpu_time_total", row_limit=25),
        events.table(sort_by="self_device_time_total", row_limit=25) if CUDA else "",
    ]
    if out is not None:
        (out / f"profile_{label}.txt").write_text("\n\n".join(tables))
    print(tables[0][:6000], flush=True)
    if CUDA:
        print(tables[1][:4000], flush=True)
    return (
        f"{label}: {wall / steps * 1e3:.2f} ms a step (wall, under the profiler), device busy "
        f"{device_us / 1e3 / steps:.2f} ms a step, forward calls {engine.decode_seconds / steps * 1e3:.2f} ms a step"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=16 if CUDA else 4)
    p.add_argument("--tokens", type=int, default=32 if CUDA else 6)
    args = p.parse_args()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    shape = (QWEN3_30B_A3B if CUDA else SMALL_MOE) | COMPILED_SHAPES["cuda" if CUDA else "cpu"]
    model = _random_model(shape, DT)
    cfg = {"max_num_seqs": args.seqs, "max_model_len": 64 + args.tokens, "capture_routing": True}
    lines = [profiled(LLMEngine(model, EngineConfig(**cfg)), args.seqs, args.tokens, "eager", out)]
    if CUDA:  # the compiled step on a CPU is not what this looks for
        fast = LLMEngine(model, EngineConfig(**cfg, compile_decode=True))
        lines.append(profiled(fast, args.seqs, args.tokens, "compiled", out))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
