"""How every benchmark runs a contender: in a fresh process of its own, whose last line of output is its result as
JSON (the scripts put this directory on ``sys.path`` by being run from it)."""

from __future__ import annotations

import json
import subprocess


def run_contender(cmd: list[str], **kwargs) -> dict:
    """Run ``cmd`` (``subprocess.run`` keywords in ``kwargs``), fail if it fails, return its last line's JSON."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, **kwargs)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rl_overrides(run_dir, ckpt, mode: str, dtype: str, steps: int, prompts: int, group: int, new_tokens: int) -> list:
    """The config overrides of a benchmark's RL run: ``steps`` steps of ``prompts`` x ``group`` samples of at most
    ``new_tokens`` tokens on the arithmetic task, no checkpoints, export or evaluation."""
    return [
        f"run_dir={run_dir}",
        f"model.path={ckpt}",
        f"policy.mode={mode}",
        f"policy.dtype={dtype}",
        f"rollout.dtype={dtype}",
        "policy.micro_batch_size=64",
        f"train.steps={steps}",
        "train.checkpoint_every=0",
        "train.export_adapter=false",
        "env.name=arithmetic",
        "env.eval_problems=0",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.group_size={group}",
        f"rollout.max_tokens={new_tokens}",
        f"rollout.max_model_len={16 + new_tokens}",
    ]


def add_child_args(parser) -> None:
    """The hidden arguments a benchmark passes its contender child: ``--child`` (which contender), ``--ckpt``,
    ``--run-dir``."""
    import argparse

    for flag in ("--child", "--ckpt", "--run-dir"):
        parser.add_argument(flag, help=argparse.SUPPRESS)


def add_dtypes(parser) -> None:
    """``--dtypes`` (each contender runs in each) and a child's ``--dtype`` on a benchmark's argument parser."""
    import argparse

    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["bfloat16", "float32"],
        help="dtypes every contender runs in (default: float32, and bfloat16 where the CPU has it natively)",
    )
    parser.add_argument("--dtype", help=argparse.SUPPRESS)  # a child's


def dtypes(args) -> list[str]:
    """The dtypes asked for, else fp32 and, where the host multiplies it natively, bf16."""
    from moerl.precision import native_bf16

    return args.dtypes or (["float32", "bfloat16"] if native_bf16() else ["float32"])
