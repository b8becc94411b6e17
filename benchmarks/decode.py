"""Decode throughput of the rollout engine: moerl (base, and LoRA on every target incl. experts in three
variants) vs transformers ``generate`` vs vLLM (CPU build, in its own venv; the column is skipped without it).

64 concurrent sequences x 64 new tokens (16-token prompts), bf16, Qwen3-MoE presets. The in-process contenders
run interleaved round by round, in a rotating order (median of rounds after a warm-up); vLLM runs in a
subprocess before each round. Peak memory: each contender once more in a child process of its own (VmHWM).

    python benchmarks/decode.py [--presets tiny small] [--rounds 3] [--vllm-python /work/vllm-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from contender import run_contender

from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.model.lora import LoraConfig, attach_lora, default_targets, lora_modules, slot_tensors
from moerl.presets import init_model

HERE = Path(__file__).resolve().parent
LORA_VARIANTS = {  # name -> (adapter layout, engine layout, fused)
    "LoRA per_expert naive": ("per_expert", "per_expert", False),
    "LoRA per_expert fused": ("per_expert", "per_expert", True),
    "LoRA shared_outer fused": ("shared_outer", "shared_outer", True),
}
RANK = 8


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


def build(name: str, ckpt: str, num_seqs: int, max_len: int):
    """A callable running one full generate for contender ``name`` (and its KV cache bytes)."""
    batch = prompts(num_seqs, 16)
    if name == "transformers":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
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
    cfg = EngineConfig(max_num_seqs=num_seqs, max_model_len=max_len)
    adapter = None
    if name != "moerl base":
        layout, engine_layout, fused = LORA_VARIANTS[name.removeprefix("moerl ")]
        cfg = EngineConfig(
            max_num_seqs=num_seqs,
            max_model_len=max_len,
            max_loras=1,
            max_lora_rank=RANK,
            lora_layout=engine_layout,
            fused_lora=fused,
        )
        adapter = "a"
    engine = LLMEngine(ckpt, cfg, dtype=torch.bfloat16)
    if adapter:
        engine.add_adapter(adapter, random_adapter(ckpt, LORA_VARIANTS[name.removeprefix("moerl ")][0]))

    def run(new_tokens: int, seed: int) -> int:
        params = SamplingParams(
            temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, seed=seed
        )
        outs = engine.generate([Request(p, params, adapter=adapter) for p in batch])
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run, engine.kv_cache_bytes


def vllm_round(python: str, ckpt: str, num_seqs: int, new_tokens: int, rounds: int) -> dict:
    cmd = [
        python,
        str(HERE / "vllm_decode.py"),
        "--model",
        ckpt,
        "--num-seqs",
        str(num_seqs),
        "--new-tokens",
        str(new_tokens),
        "--rounds",
        str(rounds),
    ]
    return run_contender(cmd)


def child_peak_mb(name: str, ckpt: str, num_seqs: int, new_tokens: int) -> float:
    """Run one contender alone in a child process; its peak RSS in MB."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--ckpt",
        ckpt,
        "--num-seqs",
        str(num_seqs),
        "--new-tokens",
        str(new_tokens),
    ]
    return run_contender(cmd)["peak_rss_mb"]


def peak_rss_mb() -> float:
    # VmHWM: this process image's high-water mark (ru_maxrss would still count the parent's pages after exec)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(args) -> None:
    run, _ = build(args.child, args.ckpt, args.num_seqs, 16 + args.new_tokens + 16)
    run(args.new_tokens, 0)
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def bench(preset: str, args, vllm_python: str | None) -> None:
    names = ["moerl base", *(f"moerl {v}" for v in LORA_VARIANTS), "transformers"]
    with tempfile.TemporaryDirectory() as ckpt:
        init_model("qwen3_moe", preset, ckpt, seed=0)
        max_len = 16 + args.new_tokens + 16
        runs = {n: build(n, ckpt, args.num_seqs, max_len) for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        vllm: list[dict] = []
        for n in names:  # warm-up
            runs[n][0](args.new_tokens, 0)
        for r in range(args.rounds):
            if vllm_python:
                vllm.append(vllm_round(vllm_python, ckpt, args.num_seqs, args.new_tokens, 1))
                time.sleep(2)  # let the machine settle after the subprocess exits
            for n in names[r % len(names) :] + names[: r % len(names)]:  # rotate who runs first
                start = time.perf_counter()
                produced = runs[n][0](args.new_tokens, r + 1)
                times[n].append(time.perf_counter() - start)
                assert produced == args.num_seqs * args.new_tokens, (n, produced)
        peaks = {n: child_peak_mb(n, ckpt, args.num_seqs, args.new_tokens) for n in names}
    tokens = args.num_seqs * args.new_tokens
    tps = {n: tokens / statistics.median(t) for n, t in times.items()}
    if vllm:
        tps["vLLM"] = statistics.median(v["tokens_per_s"] for v in vllm)
        peaks["vLLM"] = max(v["peak_rss_mb"] for v in vllm)
    base = tps["moerl base"]
    print(
        f"\n## {preset} (Qwen3-MoE), {args.num_seqs} seqs x {args.new_tokens} new tokens, bf16, median of "
        f"{args.rounds} rounds"
    )
    print("| engine | tokens/s | vs moerl base | vs vLLM | peak RSS (MB) | KV cache (MB) |")
    print("|---|---|---|---|---|---|")
    for n, v in tps.items():
        kv = runs[n][1] if n in runs else None
        vs_vllm = f"{v / tps['vLLM']:.2f}x" if "vLLM" in tps else "n/a"
        kv_mb = f"{kv / 2**20:.1f}" if kv else "-"
        print(f"| {n} | {v:,.0f} | {v / base:.2f}x | {vs_vllm} | {peaks[n]:,.0f} | {kv_mb} |")
    fused, naive = tps["moerl LoRA per_expert fused"], tps["moerl LoRA per_expert naive"]
    print(
        f"\ntargets: base / vLLM = {base / tps['vLLM']:.2f}x" if "vLLM" in tps else "\ntargets: vLLM not run",
        f"(tiny >= 1.5x, small >= 1.2x); shared_outer fused / base = "
        f"{tps['moerl LoRA shared_outer fused'] / base:.2f}x (>= 0.9x); per_expert fused / naive = "
        f"{fused / naive:.2f}x (>= 1.62x)",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vllm-python", default=os.environ.get("MOERL_VLLM_PYTHON", "/work/vllm-venv/bin/python"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    vllm_python = args.vllm_python if Path(args.vllm_python).exists() else None
    print(
        f"# decode throughput; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}; vLLM: {'yes (' + vllm_python + ')' if vllm_python else 'not installed, skipped'}"
    )
    for preset in args.presets:
        bench(preset, args, vllm_python)


if __name__ == "__main__":
    main()
