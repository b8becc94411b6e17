"""Seconds of the Gated DeltaNet chunked rule's forward + backward
(``moerl.model.linear_attention.delta_rule_chunked``), this tree's against another revision's, each contender in a
fresh process of its own, rounds interleaved.

Workload: q, k, v of B x T tokens x H heads x 128 (fp32), the rule's gradients of every input; a contender reports the
median of ``--reps`` timed calls after one warm-up. ``--rev`` names the other revision (its file is read with ``git
show``, run from this directory); the ratio printed is rev / this tree (> 1: this tree is faster).

    python benchmarks/gdn_chunk.py --rev 74d86ad [--tokens 4096] [--heads 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from contender import run_contender

ROOT = Path(__file__).resolve().parents[1]


def rule(rev: str | None):
    """The chunked rule of ``rev`` (None: this tree's)."""
    if rev is None:
        from moerl.model.linear_attention import delta_rule_chunked

        return delta_rule_chunked
    source = subprocess.run(
        ["git", "show", f"{rev}:moerl/model/linear_attention.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    import importlib.util
    import tempfile

    path = Path(tempfile.mkdtemp()) / "linear_attention_at_rev.py"  # our own file as it was at ``rev``
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("linear_attention_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.delta_rule_chunked


def child(rev: str | None, batch: int, tokens: int, heads: int, reps: int) -> dict:
    fn = rule(rev)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, tokens, heads, 128, generator=g), dim=-1) for _ in "qk")
    v = torch.randn(batch, tokens, heads, 128, generator=g)
    gate, beta = -torch.rand(batch, tokens, heads, generator=g) * 0.5, torch.rand(batch, tokens, heads, generator=g)
    inputs = [x.requires_grad_() for x in (q * 128**-0.5, k, v, gate, beta)]
    seconds = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        out, state = fn(*inputs)
        torch.autograd.grad(out.sum() + state.sum(), inputs)
        if i:
            seconds.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(seconds)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rev", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(child(None if a.child == "tree" else a.child, a.batch, a.tokens, a.heads, a.reps)))
        return
    host = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    shape = f"B {a.batch} x T {a.tokens} x H {a.heads} x 128, fwd + bwd"
    print(f"# {host}, load {os.getloadavg()[0]:.2f}; {shape}")
    times: dict[str, list[float]] = {a.rev: [], "tree": []}
    base = [sys.executable, __file__, "--rev", a.rev, "--batch", str(a.batch), "--tokens", str(a.tokens)]
    base += ["--heads", str(a.heads), "--reps", str(a.reps)]
    for _ in range(a.rounds):
        for who in times:
            times[who].append(run_contender([*base, "--child", who], cwd=Path(__file__).parent)["seconds"])
    for who, t in times.items():
        print(f"{who:>10}: median {statistics.median(t):.3f} s (min {min(t):.3f}, max {max(t):.3f})")
    ratios = [r / t for r, t in zip(times[a.rev], times["tree"], strict=True)]
    print(
        f"ratio {a.rev} / tree: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
