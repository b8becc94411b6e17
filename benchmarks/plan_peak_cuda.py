"""What a training step holds at its CUDA peak, by the moerl line that allocated it, beside ``moerl plan``'s breakdown
(the GPU check's plan lines, issue 39: the third GPU run found the plan 9.4% over a LoRA step's peak, 17.3% over a
full one's, where on a CPU it is within 0.3%).

The step runs as the GPU check's plan line runs it (small preset, 512 tokens, micro-batch 4); the second step is
recorded by CUDA's allocator history; at the peak of live bytes the tensors alive that the step made are summed by
their innermost moerl frame. Needs a CUDA device.

    PYTHONPATH=. python benchmarks/plan_peak_cuda.py [lora full]
"""

from __future__ import annotations

import collections
import gc
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from moerl.config import load_config
from moerl.parallel.world import World
from moerl.plan.rank import trace_rank, traced_rows, worst_batch
from moerl.presets import init_model, preset_config
from moerl.run_config import RunConfig
from moerl.trainer import Policy
from moerl.trainer.losses import make_policy_loss


def where(frames: list[dict]) -> str:
    """The innermost moerl frame of an allocation's stack (else its innermost)."""
    inner = [f for f in frames if "/moerl/" in f["filename"]] or frames or [{"filename": "?", "line": 0, "name": "?"}]
    f = inner[0]
    return f"{f['filename'].rsplit('/moerl/', 1)[-1]}:{f['line']} {f['name']}"


def peak_by_line(trace: list[dict]) -> tuple[int, dict[str, int]]:
    """The largest sum of live traced bytes, and what was live then by allocating line."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_set: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            total += e["size"]
            if total > best:
                best, best_set = total, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    by = collections.Counter()
    for size, line in best_set.values():
        by[line] += size
    return best, dict(by)


def main(modes: list[str]) -> None:
    hf, cfg = preset_config("qwen3_moe", "small")
    for mode in modes:
        over = [f"policy.mode={mode}", "policy.dtype=bfloat16", "rollout.max_model_len=512"]
        run = load_config(RunConfig, None, [*over, "policy.micro_batch_size=4"])
        plan = trace_rank(cfg, run, 0, hf, gpu=True)
        print(f"{mode} plan at peak (MiB): " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in plan.peak.bytes.items()))
        gc.collect()
        before = torch.cuda.memory_allocated()
        with tempfile.TemporaryDirectory() as tmp:
            init_model("qwen3_moe", "small", Path(tmp) / "small")
            pol = Policy(Path(tmp) / "small", replace(run.policy, compile=False, device="cuda"))
            batch, loss = worst_batch(cfg, run, traced_rows(run, World())), make_policy_loss(run.algo.loss)
            pol.train_step(batch, loss)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - before
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=500_000)
            pol.train_step(batch, loss)
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak = torch.cuda.max_memory_allocated() - before
        traced, by = peak_by_line(snap["device_traces"][0])
        print(
            f"{mode}: measured peak {peak / 2**20:.0f} MiB over others; held between steps {held / 2**20:.0f} MiB; "
            f"the step's own at its peak {traced / 2**20:.0f} MiB; planned total {plan.peak.total / 2**20:.0f} MiB"
        )
        for line, size in sorted(by.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {size / 2**20:8.1f} MiB  {line}")
        del pol
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1:] or ["lora", "full"])
