"""``moerl demo``: a tiny MoE learns arithmetic on a CPU in minutes — supervised warm-up, then GRPO with LoRA
on every layer and the experts, with rollout routing replay; held-out accuracy before and after RL."""

from __future__ import annotations

import json
import time
from pathlib import Path

from moerl.console import held_out_text
from moerl.errors import RunDirError
from moerl.loop import train
from moerl.metrics import read_metrics
from moerl.model.lora import LoraConfig
from moerl.run_config import AlgoSection, EnvSection, ModelSection, RolloutSection, RunConfig, TrainSection
from moerl.trainer import OptimConfig, PolicyConfig
from moerl.trainer.losses import PolicyLossConfig

# sums of three digits ("3+5+7="): 1000 problems, a fifth (~200, by prompt hash) held out and never trained on. The
# digits sit at fixed positions, so what the tiny model learns carries over to problems it has not seen: RL's gain
# shows on the held-out set (two-digit operands of varying width it only memorises)
ENV = {"max_operand": 9, "ops": "+", "num_terms": 3, "test_fraction": 0.2}


def demo_config(run_dir: Path, model_path: Path, rl_steps: int) -> RunConfig:
    return RunConfig(
        run_dir=str(run_dir / "rl"),
        model=ModelSection(path=str(model_path)),
        policy=PolicyConfig(
            mode="lora",
            # fp32 on every host: the tiny preset's GEMMs are too small for bf16 to pay even where it is native
            # (its conversions cost more than the narrower GEMMs save)
            dtype="float32",
            lora=LoraConfig(rank=8, alpha=16, layout="shared_outer"),
            optim=OptimConfig(lr=1e-3, schedule="constant", grad_clip=1.0),
            micro_batch_size=128,
        ),
        rollout=RolloutSection(
            prompts_per_step=16, group_size=8, max_tokens=4, temperature=1.0, max_model_len=32, dtype="float32"
        ),
        algo=AlgoSection(
            advantage="grpo",
            loss=PolicyLossConfig(kind="ppo", clip_low=0.2, clip_high=0.28),
            mini_batches=2,
            r3=True,
        ),
        env=EnvSection(name="arithmetic", kwargs=dict(ENV), eval_problems=200),
        train=TrainSection(steps=rl_steps, checkpoint_every=50, eval_every=50),
    )


def run_demo(
    run_dir: str = "runs/demo",
    sft_steps: int = 120,
    rl_steps: int = 300,
    log=print,
    overwrite: bool = False,
    arch: str = "qwen3_moe",
) -> dict:
    """Build, warm up, train with GRPO; returns accuracies, timings and where the outputs are. A directory holding
    a previous demo is refused unless ``overwrite`` (then the demo starts over there). ``arch``: the tiny preset of
    this architecture (e.g. ``qwen3_5_moe``, the hybrid)."""
    from moerl.envs import make_env
    from moerl.presets import init_model
    from moerl.rundir import holds_run
    from moerl.warmup import warm_up

    run_dir = Path(run_dir)
    if holds_run(run_dir / "rl") and not overwrite:
        raise RunDirError(
            f"{run_dir} holds a previous demo (its RL run in {run_dir / 'rl'}); pass --overwrite to start over"
        )
    start = time.perf_counter()
    base = run_dir / "base_model"
    model = init_model(arch, "tiny", base, seed=0)
    kinds = "" if set(model.config.layer_types) == {"full"} else f": {', '.join(model.config.layer_types)}"
    log(f"[demo] tiny {arch} ({model.config.num_layers} layers{kinds}; 8 experts top-2) written to {base}")
    env = make_env("arithmetic", **ENV)
    sft_model = run_dir / "sft_model"
    warm_up(base, sft_model, env, sft_steps, log=log)
    t_sft = time.perf_counter() - start
    log(f"[demo] supervised warm-up done in {t_sft:.0f}s; GRPO (LoRA on every layer and the experts, R3) next")
    cfg = demo_config(run_dir, sft_model, rl_steps)
    summary = train(cfg, overwrite=overwrite)
    summary["seconds"] = time.perf_counter() - start
    summary["seconds_sft"] = t_sft
    before, after = (
        held_out_text({f"eval_accuracy{k}": summary[f"accuracy_{when}{k}"] for k in ("", "_low", "_high")}
                      | {"eval_problems": summary["eval_problems"]})
        for when in ("before", "after")
    )  # fmt: skip
    log(f"[demo] held-out accuracy (distinct problems never trained on, greedy): {before} before RL")
    log(f"[demo]                                            -> {after} after {rl_steps} GRPO steps")
    rewards = [r["reward_mean"] for r in read_metrics(cfg.run_dir) if r.get("reward_mean") is not None]
    if len(rewards) >= 40:
        first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
        log(f"[demo] training reward (sampled): {first:.1%} over the first 20 steps -> {last:.1%} over the last 20")
    log(f"[demo] {summary['seconds']:.0f}s in all; run directory {cfg.run_dir}: metrics.jsonl, tensorboard/, "
        "checkpoint/, adapter/, curves.png")  # fmt: skip
    kwargs = json.dumps(ENV)
    prompt = env.problems(1, seed=0, split="test")[0].prompt
    log("[demo] next:")
    log(f"  moerl generate {sft_model} --adapter {cfg.run_dir}/adapter --prompt '{prompt}'   # the trained adapter")
    log(f"  moerl eval {sft_model} --adapter {cfg.run_dir}/adapter --env arithmetic --env-kwargs '{kwargs}' "
        f"--max-tokens {cfg.rollout.max_tokens} --dtype float32   # the held-out accuracy again")  # fmt: skip
    log(f"  moerl serve {sft_model} --adapter {cfg.run_dir}/adapter   # the OpenAI API on 127.0.0.1:8000")
    log(f"  moerl plot {cfg.run_dir}                           # the reward and mismatch curves (curves.png)")
    log(f"  moerl demo --rl-steps 600 --overwrite --run-dir {run_dir}   # a longer run")
    return summary
