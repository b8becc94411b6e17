"""``moerl`` command line: init-model, generate, archs, train, plot, demo."""

from __future__ import annotations

import argparse
import sys
import time

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
    from moerl.demo import run_demo

    run_demo(args.run_dir, sft_steps=args.sft_steps, rl_steps=args.rl_steps)


def cmd_train(args) -> None:
    from moerl.config import load_config
    from moerl.loop import RunConfig, train

    overrides = list(args.overrides)
    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        overrides.insert(0, args.config)  # no file given, only overrides
        args.config = None
    cfg = load_config(RunConfig, args.config, overrides)
    summary = train(cfg, resume=args.resume)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


def cmd_plot(args) -> None:
    from moerl.metrics import plot_run

    print(plot_run(args.run_dir, args.out))


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

    s = sub.add_parser("demo", help="the main job: a tiny MoE learns arithmetic (warm-up, then GRPO + LoRA + R3)")
    s.add_argument("--run-dir", default="runs/demo")
    s.add_argument("--sft-steps", type=int, default=120)
    s.add_argument("--rl-steps", type=int, default=300)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("train", help="run the RL loop from a YAML config with key.sub=value overrides")
    s.add_argument("config", nargs="?", help="YAML file (optional: defaults plus overrides also work)")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 policy.mode=full")
    s.add_argument("--resume", action="store_true", help="continue from run_dir/checkpoint")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("plot", help="write a PNG of a run's reward and mismatch curves")
    s.add_argument("run_dir")
    s.add_argument("--out", default=None)
    s.set_defaults(func=cmd_plot)
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
