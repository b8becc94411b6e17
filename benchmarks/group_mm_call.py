"""What a grouped-GEMM call of the experts costs beyond its GEMMs, at small's fp32 decode shape (128 rows over 16
experts, 512 x 512 weights): ``torch._grouped_mm`` alone, with moerl's grouping of the rows (``Groups``), through
``group_mm`` and through the op a compiled graph calls (``moerl::group_mm``). Rounds interleaved in one process
(medians over rounds of 10 calls each); every contender reads the same weights.

    python benchmarks/group_mm_call.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

import moerl.model.grouped as grouped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    experts, rows = 16, 128
    keys = torch.sort(torch.randint(0, experts, (rows,), generator=torch.Generator().manual_seed(0))).values
    x, w = torch.randn(rows, 512), torch.randn(experts, 512, 512)
    offs = grouped.Groups(keys, experts).offs
    calls = {
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
        "Groups + torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=grouped.Groups(keys, experts).offs),
        "group_mm": lambda: grouped.group_mm(x, w, grouped.Groups(keys, experts)),
        "moerl::group_mm (the op)": lambda: torch.ops.moerl.group_mm(x, w, keys, experts),
    }
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            for _ in range(10):
                call()
            times[name].append((time.perf_counter() - t0) / 10 * 1e6)
    alone = statistics.median(times["torch._grouped_mm"])
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; moerl from {grouped.__file__}")
    print("| call | us (spread) | beyond the GEMMs |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:,.0f} ({min(ts):,.0f}..{max(ts):,.0f}) | {med - alone:+,.0f} |")


if __name__ == "__main__":
    main()
