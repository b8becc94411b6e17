"""The engine's prepacked expert kernel (``moerl.cpu.kernels``, issue 42 part 2) against torch's grouped GEMM: the
routed experts' GEMMs of one fp32 decode step of 64 sequences on small's shapes.

Contenders, each in a fresh process per round, rounds interleaved in a rotating order (median and spread over
rounds; within a process the median of ``--reps`` passes over every layer):

- ``torch grouped_mm``: the engine before the kernel (``torch._grouped_mm`` on K-major weights: one MKL sgemm per
  expert), SiLU(gate) * up * the routing weight after it, as ``Experts._hidden`` computes them;
- ``packed``: ``moerl.cpu.kernels``'s kernel as the engine calls it (gate-up with the activation fused, then down);
- ``read``: ``sum`` over the same weights, the bandwidth a kernel streaming them can approach at this size.

Every layer's weights differ (8 layers of 16 experts, 24 MiB a layer: they do not stay in cache between passes);
the 128 (token, expert) rows of a step are spread over the experts either evenly (8 each) or as a trained router's
skew (drawn once, seeded: up to ~2.4x the mean). The kernel's output is checked against torch's in every process
that runs it (fp32, 1e-3 relative).

    python benchmarks/expert_kernel.py [--rounds 3] [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contender import run_contender  # noqa: E402

E, H, INTER, LAYERS, ROWS = 16, 512, 256, 8, 128  # small's experts; 64 sequences x top-2
CONTENDERS = ["torch grouped_mm", "packed", "read"]


def offsets(skewed: bool) -> torch.Tensor:
    """Each expert's end row among the step's 128 rows: 8 each, or drawn from a skewed router (seeded)."""
    if not skewed:
        counts = torch.full((E,), ROWS // E)
    else:
        g = torch.Generator().manual_seed(0)
        probs = (torch.randn(E, generator=g) * 0.9).softmax(0)
        counts = torch.bincount(torch.multinomial(probs, ROWS, replacement=True, generator=g), minlength=E)
    return counts.cumsum(0).to(torch.int32)


def child(args) -> None:
    torch.manual_seed(1)
    gate_up = [torch.randn(E, H, 2 * INTER) for _ in range(LAYERS)]  # K-major [E, K, N], as the engine stores them
    down = [torch.randn(E, INTER, H) for _ in range(LAYERS)]
    x = torch.randn(ROWS, H)
    offs, scale = offsets(args.skewed), torch.rand(ROWS)
    if args.child == "torch grouped_mm":

        def layer(i):
            gate, up = torch._grouped_mm(x, gate_up[i], offs=offs).chunk(2, dim=-1)
            torch._grouped_mm(F.silu(gate) * up * scale[:, None], down[i], offs=offs)
    elif args.child == "read":

        def layer(i):
            gate_up[i].sum()
            down[i].sum()
    else:
        from moerl.cpu.kernels import kernel, pack, packed_group_mm

        if kernel() is None:
            print(json.dumps({"ms_per_layer": None}))
            return
        packed = [[pack(w, gu) for w in p] for p, gu in ((gate_up, True), (down, False))]
        gate, up = torch._grouped_mm(x, gate_up[0], offs=offs).chunk(2, dim=-1)
        want = F.silu(gate) * up * scale[:, None]
        got = packed_group_mm(x, packed[0][0], offs, 2, scale)
        assert (got - want).abs().max() <= 1e-3 * (1 + want.abs().max()), "the kernel differs from torch's GEMM"

        def layer(i):
            packed_group_mm(packed_group_mm(x, packed[0][i], offs, 2, scale), packed[1][i], offs, 0)

    times = []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        for i in range(LAYERS):
            layer(i)
        if rep:  # the first pass warms up
            times.append((time.perf_counter() - t0) / LAYERS)
    print(json.dumps({"ms_per_layer": 1e3 * statistics.median(times)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--skewed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    nbytes = E * 3 * H * INTER * 4  # a layer's gate_up and down weights
    print(
        f"# small's routed experts, one fp32 decode step of 64 sequences (128 rows, 16 experts, 24 MiB a layer); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    )
    print("| routing | contender | ms / layer (spread) | GB/s of weights | vs torch grouped_mm |")
    print("|---|---|---|---|---|")
    for skewed in (False, True):
        runs = {c: [] for c in CONTENDERS}
        for r in range(args.rounds):
            for c in CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]:
                cmd = [sys.executable, __file__, "--child", c, "--reps", str(args.reps)] + ["--skewed"] * skewed
                runs[c].append(run_contender(cmd)["ms_per_layer"])
        base = statistics.median(runs["torch grouped_mm"])
        for c, ms in runs.items():
            if None in ms:
                print(f"| {'skewed' if skewed else 'even'} | {c} | not run (the kernel does not build here) | | |")
                continue
            med = statistics.median(ms)
            print(
                f"| {'skewed' if skewed else 'even'} | {c} | {med:.3f} ({min(ms):.3f}..{max(ms):.3f}) | "
                f"{nbytes / med / 1e6:.1f} | {base / med:.2f}x |"
            )


if __name__ == "__main__":
    main()
