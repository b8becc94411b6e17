"""TRL GRPO step-time runner on CPU, the external baseline for moerl's RL-step benchmark (``benchmarks/rl_step.py``).

Standalone: it does not import moerl and runs inside the separate TRL virtualenv, normally as a subprocess::

    /work/trl-venv/bin/python benchmarks/trl_grpo_step.py --model DIR [--prompts 16] [--group 8]
        [--new-tokens 16] [--steps 4] [--seed 0] [--dtype bfloat16] [--micro-batch N]

DIR is a local HF checkpoint (config.json, model.safetensors, tokenizer.json + tokenizer_config.json), e.g. one
written by ``moerl init-model --arch qwen3_moe``. It runs TRL's ``GRPOTrainer`` (full fine-tuning, AdamW, lr 1e-5,
no vLLM, no reference model, transformers ``generate`` at temperature 1) on ``prompts`` deterministic plain-text
prompts ``"a+b="`` (a, b in [0, 20], drawn from ``seed``); the reward is 1.0 when the completion starts with the sum
(optional leading spaces, then the integer), else 0.0. One optimizer step consumes exactly ``prompts * group``
completions: one generation of that many, then ``prompts * group / micro_batch`` accumulated micro-batches.
``--dtype bfloat16`` is mixed precision (fp32 weights and AdamW state, bf16 autocast compute, generation included);
``float32`` is plain fp32. The MoE load-balancing loss is off (``--router-aux-loss-coef 0``), as in moerl's loop.

Each optimizer step is timed by wall clock from ``on_step_begin`` to ``on_step_end`` (generation, rewards, loss,
backward, optimizer); the first is a warm-up. All logging goes to stderr; the last stdout line is one JSON object:
engine, version, seconds_per_step (median), samples_per_s (prompts * group / seconds_per_step), steps_timed.
"""

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

_LEADING_INT = re.compile(r" *(-?[0-9]+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory")
    p.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--new-tokens", type=int, default=16, help="max_completion_length")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, the first one a warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--micro-batch", type=int, default=None, help="completions per forward/backward (default: all)")
    p.add_argument("--router-aux-loss-coef", type=float, default=0.0, help="MoE load-balancing loss weight")
    return p.parse_args(argv)


def make_dataset(n, seed):
    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [a + b for a, b in pairs]})


def sum_reward(prompts, completions, answer, **kwargs):
    """1.0 when the completion starts with the right sum (after optional spaces), else 0.0."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        m = _LEADING_INT.match(completion)
        out.append(1.0 if m is not None and int(m.group(1)) == want else 0.0)
    return out


def main(argv=None):
    args = parse_args(argv)
    total = args.prompts * args.group
    micro = args.micro_batch or total
    if args.steps < 2:
        sys.exit("--steps must be >= 2 (the first step is a warm-up)")
    if total % micro:
        sys.exit(f"--micro-batch {micro} must divide prompts * group = {total}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    # Everything but the final JSON goes to stderr, including C-level writes to fd 1.
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory() as out_dir:
        import torch
        import trl
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        times = []

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                times.append(time.perf_counter() - self.t0)

        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=args.dtype == "bfloat16",
            fp16=False,
            model_init_kwargs={"dtype": torch.float32},  # master weights; bf16 comes from autocast
            seed=args.seed,
            data_seed=args.seed,
            max_steps=args.steps,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            warmup_steps=0,
            # One optimizer step = one generation of `total` completions = total / micro micro-batches.
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=total // micro,
            generation_batch_size=total,
            num_generations=args.group,
            num_iterations=1,
            max_completion_length=args.new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            router_aux_loss_coef=args.router_aux_loss_coef,
            use_vllm=False,
            activation_checkpointing=False,  # transformers 5 name; `gradient_checkpointing` is its deprecated alias
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=args.model,
            reward_funcs=sum_reward,
            args=config,
            train_dataset=make_dataset(args.prompts, args.seed),
            callbacks=[StepTimer()],
        )
        trainer.train()
        if len(times) != args.steps:
            raise RuntimeError(f"timed {len(times)} optimizer steps, expected {args.steps}")
        timed = times[1:]
        median_s = statistics.median(timed)
        print(
            f"step times (s): {[round(t, 3) for t in times]} (first = warm-up), dtype {args.dtype} "
            f"(bf16 autocast: {config.bf16}), micro-batch {micro} x {config.gradient_accumulation_steps}, "
            f"generation batch {config.generation_batch_size}, torch threads {torch.get_num_threads()}",
            file=sys.stderr,
        )

    result = {
        "engine": "trl",
        "version": trl.__version__,
        "seconds_per_step": median_s,
        "samples_per_s": total / median_s,
        "steps_timed": len(timed),
    }
    print(json.dumps(result), file=real_stdout, flush=True)


if __name__ == "__main__":
    main()
