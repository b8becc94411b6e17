"""Shared pieces of the loop tests: the easy task, a small run config, the metrics rows, a run directory's hash."""

import hashlib
import json
from pathlib import Path

from moerl.config import load_config
from moerl.run_config import RunConfig

EASY = {"max_operand": 4, "ops": "+", "num_terms": 2}


def run_cfg(run_dir, model, mode="lora", steps=2, **over) -> RunConfig:
    """A fast run of ``steps`` RL steps on the easy task (fp32, checkpoints every 2 steps)."""
    overrides = [
        f"run_dir={run_dir}",
        f"model.path={model}",
        f"policy.mode={mode}",
        "policy.dtype=float32",
        "rollout.dtype=float32",  # pinned: auto is bf16 on AVX512-BF16 / AMX hosts
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        "env.name=arithmetic",
        f"env.kwargs={json.dumps(EASY)}",
        "env.eval_problems=16",
        "rollout.prompts_per_step=8",
        "rollout.group_size=8",
        "rollout.max_tokens=3",
        "rollout.max_model_len=32",
        "policy.micro_batch_size=64",
        "policy.lora.rank=8",
        "policy.lora.alpha=16",
    ]
    overrides += [f"{k}={v}" for k, v in over.items()]
    return load_config(RunConfig, None, overrides)


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def tree_hash(path) -> str:
    """A hash of every file name and content under ``path`` (or of its absence): equal means nothing changed."""
    path = Path(path)
    h = hashlib.sha256()
    if not path.exists():
        return "absent"
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    h.update(repr(sorted(str(p.relative_to(path)) for p in path.rglob("*"))).encode())
    return h.hexdigest()


def fix_problems(problems) -> None:
    """Make ArithmeticEnv's training split draw only from ``problems`` (held-out problems unchanged), so a rise in
    reward is learning, not luck; for processes a test cannot monkeypatch (torchrun ranks, Ray actors)."""
    from moerl.envs.arithmetic import ArithmeticEnv

    held_out = ArithmeticEnv.problems
    ArithmeticEnv.problems = lambda self, n, seed, split="train": (
        (problems * n)[:n] if split == "train" else held_out(self, n, seed, split)
    )


def fix_four_problems() -> None:
    """The four fixed easy problems the learning tests train on (a Ray worker's setup hook)."""
    from moerl.envs.arithmetic import ArithmeticEnv

    fix_problems(ArithmeticEnv(**EASY).problems(4, seed=3))


def random_adapter(ckpt, out) -> None:
    """A PEFT adapter of ``ckpt`` at ``out`` (rank 4 on attention and the experts, seeded random factors: its
    greedy answers differ from the base model's), as moerl exports one."""
    import torch

    from moerl.bridges import load_model
    from moerl.bridges.peft import write_peft_adapter
    from moerl.model.lora import LoraConfig, attach_lora, lora_modules

    model = load_model(ckpt, dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "experts"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    write_peft_adapter(model, out)


def stepped_grads(policy) -> dict:
    """The gradients each later optimizer step of ``policy`` steps with, by trained name, in the optimizer's order:
    cloned as the step begins (the policy drops them once it has stepped)."""
    out: dict = {}
    names = {id(p): n for n, p in policy.trained.items()}

    def keep(optimizer, args, kwargs) -> None:
        out.clear()
        for group in optimizer.param_groups:
            out.update({names[id(p)]: p.grad.clone() for p in group["params"] if p.grad is not None})

    policy.optimizer.register_step_pre_hook(keep)
    return out
