"""``moerl`` command line: init-model, generate, archs, demo."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from moerl.errors import MoerlError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def sample(
    model, prompt_ids: list[int], max_tokens: int, temperature: float, eos_id: int | None, generator: torch.Generator
) -> list[int]:
    """Plain sampling by full recompute, one sequence. The rollout engine (moerl.engine) replaces this."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
        ids.append(nxt)
        if nxt == eos_id:
            break
    return ids[len(prompt_ids) :]


def cmd_init_model(args) -> None:
    from moerl.presets import count_params, init_model

    model = init_model(args.arch, args.preset, args.out_dir, seed=args.seed, dtype=DTYPES[args.dtype])
    print(f"wrote {args.arch} preset {args.preset} ({count_params(model) / 1e6:.2f}M parameters) to {args.out_dir}")


def cmd_generate(args) -> None:
    from transformers import AutoTokenizer

    from moerl.bridges import load_model

    model = load_model(args.model_dir, dtype=DTYPES[args.dtype])
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    gen = torch.Generator().manual_seed(args.seed)
    for prompt in args.prompt:
        start = time.perf_counter()
        out = sample(model, tok(prompt)["input_ids"], args.max_tokens, args.temperature, tok.eos_token_id, gen)
        secs = time.perf_counter() - start
        print(f"{prompt!r} -> {tok.decode(out, skip_special_tokens=True)!r}  ({len(out)} tokens, {secs:.2f}s)")


def cmd_archs(args) -> None:
    from moerl.bridges import supported

    print("\n".join(supported()))


def cmd_demo(args) -> None:
    out = Path(args.run_dir) / "model"
    print(f"[demo] building the tiny Qwen3-MoE checkpoint in {out}")
    cmd_init_model(argparse.Namespace(arch="qwen3_moe", preset="tiny", out_dir=out, seed=0, dtype="float32"))
    print("[demo] generating from it (random weights: the text is noise until the RL loop trains it)")
    cmd_generate(
        argparse.Namespace(
            model_dir=out, prompt=["12+7=", "3*4="], max_tokens=16, temperature=1.0, seed=0, dtype="bfloat16"
        )
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moerl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-model", help="write a random HF checkpoint of a supported architecture")
    s.add_argument("--arch", required=True, help="HF architecture or model_type, e.g. qwen3_moe")
    s.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="float32", choices=list(DTYPES))
    s.add_argument("out_dir")
    s.set_defaults(func=cmd_init_model)

    s = sub.add_parser("generate", help="sample continuations of prompts from a checkpoint")
    s.add_argument("model_dir")
    s.add_argument("--prompt", action="append", required=True)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("archs", help="list the supported HF architectures")
    s.set_defaults(func=cmd_archs)

    s = sub.add_parser("demo", help="the main job (see README)")
    s.add_argument("--run-dir", default="runs/demo")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except MoerlError as e:
        print(f"moerl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
