"""vLLM CPU decode-throughput runner, the external baseline for moerl's decode benchmark.

Standalone: it does not import moerl and runs inside the separate vLLM virtualenv, normally as a subprocess::

    /work/vllm-venv/bin/python benchmarks/vllm_decode.py --model DIR [--num-seqs 64] [--new-tokens 64]
        [--prompt-len 16] [--rounds 3] [--dtype bfloat16] [--seed 0]

DIR is a local HF checkpoint (config.json, model.safetensors, tokenizer.json), e.g. one written by
``moerl init-model --arch qwen3_moe``. It builds ``num_seqs`` deterministic random token-id prompts of ``prompt_len``
ids in [4, 100), runs one warm-up ``generate`` and then ``rounds`` timed ones, each sampling exactly ``new_tokens``
tokens per sequence (temperature 1, EOS ignored). All logging goes to stderr; the last stdout line is one JSON
object: engine, version, median_s, tokens_per_s (num_seqs * new_tokens / median_s), peak_rss_mb (self + children).
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "auto"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB, int) if not already set")
    return p.parse_args(argv)


def peak_rss_mb():
    """Peak resident set size of this process plus its (waited-for) children, in MB (ru_maxrss is KiB on Linux)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) / 1024.0


def make_prompts(num_seqs, prompt_len, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 100, size=(num_seqs, prompt_len))
    return [{"prompt_token_ids": [int(t) for t in row]} for row in ids]


def main(argv=None):
    args = parse_args(argv)
    if args.max_model_len < args.prompt_len + args.new_tokens:
        sys.exit(f"--max-model-len {args.max_model_len} < prompt_len + new_tokens")
    # Keep vLLM's own footprint small and in this process: the KV cache size on CPU comes from this variable
    # (GiB), and the in-process engine core keeps the RSS accounting and the timing free of IPC.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    # Everything but the final JSON goes to stderr, including C-level writes to fd 1 (oneDNN, worker prints).
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with contextlib.redirect_stdout(sys.stderr):
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=True,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.num_seqs, 1),
            seed=args.seed,
        )
        prompts = make_prompts(args.num_seqs, args.prompt_len, args.seed)

        def params(seed):
            return SamplingParams(
                temperature=1.0,
                max_tokens=args.new_tokens,
                min_tokens=args.new_tokens,
                ignore_eos=True,
                seed=seed,
            )

        def run(seed):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params(seed), use_tqdm=False)
            dt = time.perf_counter() - t0
            got = sum(len(o.outputs[0].token_ids) for o in outs)
            want = args.num_seqs * args.new_tokens
            if got != want:
                raise RuntimeError(f"generated {got} tokens, expected {want}")
            return dt

        run(args.seed)  # warm-up
        times = [run(args.seed + 1 + r) for r in range(args.rounds)]
        median_s = statistics.median(times)
        rounded = [round(t, 4) for t in times]
        print(f"round times (s): {rounded}, torch threads {torch.get_num_threads()}", file=sys.stderr)

    result = {
        "engine": "vllm",
        "version": vllm.__version__,
        "median_s": median_s,
        "tokens_per_s": args.num_seqs * args.new_tokens / median_s,
        "peak_rss_mb": peak_rss_mb(),
    }
    print(json.dumps(result), file=real_stdout, flush=True)


if __name__ == "__main__":
    main()
