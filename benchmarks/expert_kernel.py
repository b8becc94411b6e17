"""What a prepacked small-M expert kernel would give small's fp32 decode (issue 42 part 2): the routed experts'
GEMMs of one decode step of 64 sequences, as the engine runs them and as a hand-written kernel would.

Contenders, each in a fresh process per round, rounds interleaved in a rotating order (median and spread over
rounds; within a process the median of ``--reps`` passes over every layer):

- ``torch grouped_mm``: what the engine runs today (``moerl.model.grouped.group_mm`` on K-major weights:
  ``torch._grouped_mm``, one MKL sgemm per expert);
- ``prepacked kernel``: a C kernel written here and built with the host's compiler (``-O3 -march=native -fopenmp``,
  AVX-512 intrinsics; OpenMP is torch's own runtime, already loaded), the weights packed once into 32-column panels
  ``[E, N / 32, K, 32]`` so each panel streams contiguously, 8 rows x 32 columns of accumulators in registers;
- ``read``: ``sum`` over the same weights, the bandwidth a kernel streaming them can approach at this size.

Every layer's weights differ (8 layers of 16 experts, 24 MiB a layer: they do not stay in cache between passes);
the 128 (token, expert) rows of a step are spread over the experts either evenly (8 each) or as a trained router's
skew (drawn once, seeded: up to ~2.4x the mean). The kernel's output is checked against ``torch._grouped_mm``
(fp32, max abs error <= 1e-3 on outputs of ~100) in every process that runs it.

This is a measurement of what it would take, not moerl's code: the engine keeps torch's kernels (BENCHMARKS.md says
why). Needs gcc and an AVX-512 CPU for the kernel contender (skipped, said, elsewhere).

    python benchmarks/expert_kernel.py [--rounds 3] [--reps 9]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contender import run_contender  # noqa: E402

E, H, INTER, LAYERS, ROWS, NT = 16, 512, 256, 8, 128, 32  # small's experts; 64 sequences x top-2
CONTENDERS = ["torch grouped_mm", "prepacked kernel", "read"]
KERNEL = r"""
#include <stdint.h>
#include <immintrin.h>
#define MB 8
#define NT 32
/* y[rows of group g] = x[rows of g] @ w[g]; w packed [G][N / NT][K][NT]; offs: each group's end row */
void packed_group_mm(const float* x, const float* w, const int32_t* offs, int G, int K, int N, float* y) {
  int tiles = N / NT;
  #pragma omp parallel for schedule(static, 1)
  for (int t = 0; t < G * tiles; t++) {
    int g = t / tiles, n0 = (t % tiles) * NT, r0 = g ? offs[g - 1] : 0, r1 = offs[g];
    const float* wt = w + ((int64_t)g * tiles + t % tiles) * K * NT;
    for (int m0 = r0; m0 < r1; m0 += MB) {
      int mb = r1 - m0 < MB ? r1 - m0 : MB;
      const float* xr[MB];
      for (int m = 0; m < MB; m++) xr[m] = x + (int64_t)(m0 + (m < mb ? m : 0)) * K;
      __m512 acc[2 * MB];
      for (int i = 0; i < 2 * MB; i++) acc[i] = _mm512_setzero_ps();
      for (int k = 0; k < K; k++) {
        const float* wk = wt + (int64_t)k * NT;
        _mm_prefetch((const char*)(wk + 8 * NT), _MM_HINT_T0);
        __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        #pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
          __m512 s = _mm512_set1_ps(xr[m][k]);
          acc[2 * m] = _mm512_fmadd_ps(s, w0, acc[2 * m]);
          acc[2 * m + 1] = _mm512_fmadd_ps(s, w1, acc[2 * m + 1]);
        }
      }
      for (int m = 0; m < mb; m++) {
        _mm512_storeu_ps(y + (int64_t)(m0 + m) * N + n0, acc[2 * m]);
        _mm512_storeu_ps(y + (int64_t)(m0 + m) * N + n0 + 16, acc[2 * m + 1]);
      }
    }
  }
}
"""


def offsets(skewed: bool) -> torch.Tensor:
    """Each expert's end row among the step's 128 rows: 8 each, or drawn from a skewed router (seeded)."""
    if not skewed:
        counts = torch.full((E,), ROWS // E)
    else:
        g = torch.Generator().manual_seed(0)
        probs = (torch.randn(E, generator=g) * 0.9).softmax(0)
        counts = torch.bincount(torch.multinomial(probs, ROWS, replacement=True, generator=g), minlength=E)
    return counts.cumsum(0).to(torch.int32)


def build_kernel(where: Path) -> ctypes.CDLL | None:
    src, lib = where / "kernel.c", where / "kernel.so"
    src.write_text(KERNEL)
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)]
    if subprocess.run(cmd, capture_output=True).returncode:
        return None
    return ctypes.CDLL(str(lib))  # after torch: its libgomp is the one loaded, so the kernel shares its threads


def child(args) -> None:
    torch.manual_seed(1)
    gate_up = [torch.randn(E, H, 2 * INTER) for _ in range(LAYERS)]  # K-major [E, K, N], as the engine stores them
    down = [torch.randn(E, INTER, H) for _ in range(LAYERS)]
    x, h = torch.randn(ROWS, H), torch.randn(ROWS, INTER)
    offs = offsets(args.skewed)
    if args.child == "torch grouped_mm":

        def layer(i):
            torch._grouped_mm(x, gate_up[i], offs=offs)
            torch._grouped_mm(h, down[i], offs=offs)
    elif args.child == "read":

        def layer(i):
            gate_up[i].sum()
            down[i].sum()
    else:
        with tempfile.TemporaryDirectory() as d:
            lib = build_kernel(Path(d))
        if lib is None or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
            print(json.dumps({"ms_per_layer": None}))
            return
        packed = [[w.view(E, w.shape[1], -1, NT).transpose(1, 2).contiguous() for w in p] for p in (gate_up, down)]

        def gmm(rows, w, wp):
            y = torch.empty(rows.shape[0], w.shape[2])
            ptr = ctypes.c_void_p
            args_ = (ptr(rows.data_ptr()), ptr(wp.data_ptr()), ptr(offs.data_ptr()), E, w.shape[1], w.shape[2])
            lib.packed_group_mm(*args_, ptr(y.data_ptr()))
            return y

        for rows, w, wp in ((x, gate_up[0], packed[0][0]), (h, down[0], packed[1][0])):
            err = (gmm(rows, w, wp) - torch._grouped_mm(rows, w, offs=offs)).abs().max().item()
            assert err <= 1e-3, f"the kernel's output differs from torch._grouped_mm by {err}"

        def layer(i):
            gmm(x, gate_up[i], packed[0][i])
            gmm(h, down[i], packed[1][i])

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
                print(f"| {'skewed' if skewed else 'even'} | {c} | not run (needs gcc and AVX-512) | | |")
                continue
            med = statistics.median(ms)
            print(
                f"| {'skewed' if skewed else 'even'} | {c} | {med:.3f} ({min(ms):.3f}..{max(ms):.3f}) | "
                f"{nbytes / med / 1e6:.1f} | {base / med:.2f}x |"
            )


if __name__ == "__main__":
    main()
