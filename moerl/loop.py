"""The RL loop: prompts -> engine (n samples, routing capture) -> rewards -> advantages -> old / reference
logprobs (R3 replay) -> PPO epochs over mini-batches -> weight sync -> metrics -> checkpoint. Reads top to bottom;
``train`` is the whole loop, the helpers below it build its pieces."""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moerl.engine import EngineConfig, Request, SamplingParams
from moerl.envs import make_env
from moerl.envs.base import Problem, env_step, safe_call, safe_reward
from moerl.errors import ConfigError, EngineError, TrainingStopped
from moerl.metrics import MetricsLogger, plot_run, read_metrics
from moerl.parallel.driver import DistributedPolicy, serve
from moerl.parallel.world import World, broadcast_json, init_world
from moerl.rollout import make_engine
from moerl.run_config import RunConfig
from moerl.rundir import CHECKPOINT, RunDir
from moerl.sync import sync_policy
from moerl.sync.weights import ADAPTER
from moerl.trainer import Batch, Policy
from moerl.trainer.advantages import compute_advantages, dynamic_sampling_keep
from moerl.trainer.checkpoint import save_checkpoint
from moerl.trainer.losses import kl_penalty, make_policy_loss
from moerl.trainer.mismatch import mismatch_metrics


@dataclass(slots=True)
class Rollout:
    """One sampled sequence ready for training."""

    group: int
    tokens: list[int]  # prompt + completion
    num_prompt: int
    loss_mask: list[int]  # over tokens: 1 on the model's own tokens
    rollout_logprobs: list[float]  # over tokens (0 off the mask)
    routed: torch.Tensor | None  # [len(tokens) - 1, L_moe, k]
    reward: float
    finish_reason: str
    reward_error: str | None


def train(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> dict | None:
    """Run the RL loop described by ``cfg`` in ``cfg.run_dir``; returns the final metrics (incl. held-out accuracy
    before / after).

    The run directory is owned for the run's lifetime (a second process is refused). A new run refuses a directory
    holding another run unless ``overwrite``; ``resume`` continues from the run's checkpoint, refusing config changes
    to fields that define the run. Every check runs before the run's records are written.

    With ``parallel`` ranks (under a torchrun launch), rank 0 runs the loop and returns; the others train and
    return None.
    """
    par = cfg.parallel
    world = init_world(
        par.dp, par.ep, par.pp, schedule=par.schedule, microbatches=par.microbatches, stages=par.stages or None
    )
    if not world.driver:  # a trainer rank: it trains on its shard of what rank 0 announces
        _serve(cfg, world)
        world.close()
        return None
    run = RunDir.open(cfg, resume=resume, overwrite=overwrite)
    try:
        summary = _train(cfg, run, world)
    finally:
        run.close()
    world.close()
    return summary


def _serve(cfg: RunConfig, world: World) -> None:
    """Ranks other than 0: build the same policy (same seeds) and train on this rank's share until told to stop."""
    model_path = Path(broadcast_json(None))  # rank 0 names the checkpoint once it has written it
    _seed(cfg.train.seed)
    serve(Policy(model_path, cfg.policy, world), make_policy_loss(cfg.algo.loss))


def _seed(seed: int) -> None:
    random.seed(seed)  # adapter init, dropout, shuffles: a run is a function of its config
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train(cfg: RunConfig, run: RunDir, world: World) -> dict:
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    model_path = ensure_model(cfg, run.path, fresh=not run.resume)
    _seed(cfg.train.seed)
    if world.size == 1:
        policy = Policy(model_path, cfg.policy)
    else:
        broadcast_json(str(model_path))
        policy = DistributedPolicy(model_path, cfg.policy, world)
    try:
        return _train_policy(cfg, run, env, model_path, policy)
    finally:
        policy.close()


def _train_policy(cfg: RunConfig, run: RunDir, env, model_path: Path, policy: Policy) -> dict:
    engine = build_engine(cfg, model_path)
    if cfg.algo.r3 and not getattr(engine, "supports_routing", True):
        from moerl.rollout.vllm import warn_no_routing

        warn_no_routing(cfg.rollout.engine)
    metrics = None
    try:
        if run.resume:
            policy.load(run.checkpoint)  # last: it restores the RNGs the steps go on with
        run.begin()  # everything that can refuse the run has passed: now its records are written
        start = run.start_step
        ckpt_dir = run.path / CHECKPOINT
        policy.stop_checkpoint_dir, policy.stop_state = ckpt_dir, {"step": start}
        loss_fn = make_policy_loss(cfg.algo.loss)
        metrics = MetricsLogger(run.path, purge_step=start + 1 if run.resume else None)  # one row per step, 0 first
        sync = partial(sync_policy, bucket_bytes=cfg.rollout.sync_bucket_mb << 20)
        try:
            sync(policy, engine, version=start)
            if start == 0:
                metrics.log(
                    0,
                    {
                        "eval_accuracy": evaluate(cfg, env, engine),
                        "eval_accuracy_sampled": evaluate(cfg, env, engine, sampled=True),
                    },
                )
            bar = tqdm(range(start, cfg.train.steps), desc="rl", unit="step", disable=not sys.stderr.isatty())
            for step in bar:
                policy.stop_state = {"step": step}  # a TrainingStopped saves the state after the last complete step
                row = rl_step(cfg, env, engine, policy, loss_fn, step, sync)
                last = step + 1 == cfg.train.steps
                if last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0):
                    row["eval_accuracy"] = evaluate(cfg, env, engine)
                if last:
                    row["eval_accuracy_sampled"] = evaluate(cfg, env, engine, sampled=True)
                metrics.log(step + 1, row)
                if "reward_mean" in row:
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", k3=f"{row['mismatch_k3_r3']:.1e}")
                if last or (cfg.train.checkpoint_every and (step + 1) % cfg.train.checkpoint_every == 0):
                    save_checkpoint(ckpt_dir, policy, state={"step": step + 1})
        except EngineError as e:  # an engine process died: stop with the trained state saved
            raise TrainingStopped(f"{e}{policy.save_stop_checkpoint()}") from e
    finally:
        if metrics is not None:
            metrics.close()
        engine.close()

    rows = read_metrics(run.path)
    summary = {
        "accuracy_before": rows[0].get("eval_accuracy", math.nan),
        "accuracy_sampled_before": rows[0].get("eval_accuracy_sampled", math.nan),
        "accuracy_after": rows[-1].get("eval_accuracy", math.nan),
        "accuracy_sampled_after": rows[-1].get("eval_accuracy_sampled", math.nan),
    }
    return summary | finish(cfg, run.path, policy)


def rl_step(cfg: RunConfig, env, engine, policy: Policy, loss_fn, step: int, sync=sync_policy) -> dict:
    """One RL step (``step`` steps done before it); ``sync`` pushes the new weights; returns its metrics row."""
    t0 = time.perf_counter()
    # 1. prompts -> engine -> rewards (DAPO dynamic sampling refills groups that carry no signal)
    rollouts, gen_tokens, dropped, refills, failed = [], 0, 0, 0, 0
    seed = cfg.train.seed * 1_000_003 + step
    while len({r.group for r in rollouts}) < cfg.rollout.prompts_per_step:
        want = cfg.rollout.prompts_per_step - len({r.group for r in rollouts})
        problems = env.problems(want, seed=seed * 101 + refills, split="train")
        params = sampling_params(
            cfg, len(problems), cfg.rollout.temperature, cfg.rollout.group_size, seed=(seed * 101 + refills) * 7919
        )
        batch_rollouts = generate(
            cfg, env, engine, problems, params, first_group=len(rollouts) and max(r.group for r in rollouts) + 1
        )
        batch_rollouts, n_failed = drop_failed_groups(batch_rollouts, step)
        failed += n_failed
        gen_tokens += sum(sum(r.loss_mask) for r in batch_rollouts)
        if cfg.algo.dynamic_sampling:
            kept, n_dropped = keep_informative(batch_rollouts, cfg.rollout.group_size)
            dropped += n_dropped
            batch_rollouts = kept
        rollouts += batch_rollouts
        refills += 1
        if not cfg.algo.dynamic_sampling or refills > cfg.algo.max_refills:
            break
    t_gen = time.perf_counter() - t0
    if not rollouts:  # every group was uninformative: nothing to learn from this step
        return {"dropped_groups": float(dropped), "engine_errors": float(failed), "skipped": 1.0}

    # 2. a training batch with the engine's routing and logprobs
    batch = build_batch(rollouts, cfg)
    t1 = time.perf_counter()
    old_logprobs = policy.forward_logprobs(batch, replay=cfg.algo.r3)[0]
    if not bool(torch.isfinite(old_logprobs[batch.loss_mask.bool()]).all()):
        raise TrainingStopped(
            f"step {step + 1}: the trainer's logprobs of the rollouts are non-finite{policy.save_stop_checkpoint()}"
        )
    mm_on = mismatch_metrics(old_logprobs, batch.extras["rollout_logprobs"], batch.loss_mask)
    mm_off = mm_on
    if cfg.algo.r3:  # what the mismatch would be without routing replay
        mm_off = mismatch_metrics(
            policy.forward_logprobs(batch, replay=False)[0], batch.extras["rollout_logprobs"], batch.loss_mask
        )
    batch.extras["old_logprobs"] = old_logprobs
    rewards = torch.tensor([r.reward for r in rollouts])
    loss_cfg = cfg.algo.loss
    if loss_cfg.kl_coef > 0:
        batch.extras["ref_logprobs"] = policy.forward_logprobs(batch, reference=True)[0]
        if loss_cfg.kl_in_reward:
            kl = kl_penalty(old_logprobs, batch.extras["ref_logprobs"], loss_cfg.kl_estimator)
            rewards = rewards - loss_cfg.kl_coef * (kl * batch.loss_mask).sum(1)

    # 3. advantages per group
    n = cfg.rollout.group_size
    grouped = rewards.view(-1, n)
    kwargs = {"std_normalize": cfg.algo.std_normalize} if cfg.algo.advantage == "grpo" else {}
    batch.extras["advantages"] = compute_advantages(grouped, cfg.algo.advantage, **kwargs).reshape(-1)

    # 4. PPO epochs over mini-batches
    t2 = time.perf_counter()
    train_metrics: list[dict] = []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(cfg.algo.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen)
        for idx in order.chunk(cfg.algo.mini_batches):
            mb = Batch(
                batch.input_ids[idx],
                batch.attention_mask[idx],
                batch.loss_mask[idx],
                None if batch.replay is None else batch.replay[idx],
                {k: v[idx] for k, v in batch.extras.items()},
            )
            train_metrics.append(
                policy.train_step(mb, loss_fn, replay=cfg.algo.r3, entropy=True, temperature=cfg.rollout.temperature)
            )
    t3 = time.perf_counter()

    # 5. weight sync (refused, and the engine keeps its weights, if any tensor is non-finite)
    stats = sync(policy, engine, version=step + 1)
    t4 = time.perf_counter()
    trained_tokens = int(batch.loss_mask.sum()) * cfg.algo.ppo_epochs
    row = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": float((torch.tensor([r.reward for r in rollouts]) >= 1.0).float().mean()),
        "response_length": float(batch.loss_mask.sum(1).float().mean()),
        "reward_errors": float(sum(r.reward_error == "error" for r in rollouts)),
        "reward_timeouts": float(sum(r.reward_error == "timeout" for r in rollouts)),
        "engine_errors": float(failed),
        "dropped_groups": float(dropped),
        "mismatch_k3_r3": mm_on["k3"],
        "mismatch_frac_r3": mm_on["frac_large_diff"],
        "mismatch_k3_no_r3": mm_off["k3"],
        "mismatch_frac_no_r3": mm_off["frac_large_diff"],
        "gen_tokens_per_s": gen_tokens / max(t_gen, 1e-9),
        "train_tokens_per_s": trained_tokens / max(t3 - t2, 1e-9),
        "seconds_generate": t_gen,
        "seconds_logprobs": t2 - t1,
        "seconds_train": t3 - t2,
        "seconds_sync": t4 - t3,
        "sync_bytes": float(stats.bytes),
        "weight_version": float(stats.version),
    }
    for key in train_metrics[0]:
        row[key] = sum(m[key] for m in train_metrics) / len(train_metrics)
    return row


# -- the pieces -------------------------------------------------------------------------------------------------


def ensure_model(cfg: RunConfig, run_dir: Path, fresh: bool) -> Path:
    """The checkpoint to start from: ``model.path``, or a random model of ``model.arch`` / ``preset`` / ``seed`` in
    the run directory, written by a ``fresh`` run (a resume reuses it, or writes the same one again if it is gone)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    path = run_dir / "base_model"
    if fresh or not (path / "config.json").exists():
        from moerl.presets import init_model

        init_model(cfg.model.arch, cfg.model.preset, path, seed=cfg.model.seed)
    return path


def build_engine(cfg: RunConfig, model_path: Path):
    """The rollout engines (``rollout.num_engines``, placed per ``rollout.placement``) on their own copy of the base
    weights, set up for the policy's mode."""
    lora = cfg.policy.mode == "lora"
    lcfg, r = cfg.policy.lora, cfg.rollout
    ecfg = EngineConfig(
        max_num_seqs=r.max_num_seqs,
        max_model_len=r.max_model_len,
        max_loras=1 if lora else 0,
        max_lora_rank=lcfg.rank,
        lora_layout=lcfg.layout,
        lora_targets=lcfg.targets,
        seed=cfg.train.seed,
    )
    threads = r.engine_threads or max(1, torch.get_num_threads() // r.num_engines)
    return make_engine(
        r.engine,
        model_path,
        ecfg,
        placement=r.placement,
        num_engines=r.num_engines,
        mx_scale_mode=cfg.policy.mx_scale_mode if cfg.policy.mode == "mxfp8" else None,
        threads=threads if r.placement == "process" else 0,
        vllm_args=r.vllm_args,
    )


def sampling_params(cfg: RunConfig, count: int, temperature: float, n: int, seed: int) -> list[SamplingParams]:
    """One SamplingParams per problem (seeds ``seed``, ``seed + 1``, ...), the rest from ``cfg.rollout``."""
    r = cfg.rollout
    return [
        SamplingParams(temperature=temperature, top_p=r.top_p, max_tokens=r.max_tokens, n=n, seed=seed + i)
        for i in range(count)
    ]


def generate(
    cfg: RunConfig, env, engine, problems: list[Problem], params: list[SamplingParams], first_group: int = 0
) -> list[Rollout]:
    """``params[i].n`` samples of ``problems[i]``, scored. Multi-turn environments run their episodes turn by turn."""
    adapter = ADAPTER if cfg.policy.mode == "lora" else None
    if hasattr(env, "start"):
        return multi_turn(env, engine, problems, params, adapter, first_group, cfg.algo.reward_timeout_s)
    outs = engine.generate([Request(p.prompt, sp, adapter=adapter) for p, sp in zip(problems, params, strict=True)])
    rollouts = []
    for g, (problem, out) in enumerate(zip(problems, outs, strict=True)):
        if out.error_kind == "rejected":
            raise ConfigError(f"rollout of {problem.prompt!r} failed: {out.error} (raise rollout.max_model_len?)")
        if out.error is not None:  # failed while running (non-finite logits): training drops the group, counted
            failed = Rollout(first_group + g, [], 0, [], [], None, 0.0, "error", out.error)
            rollouts += [failed] * params[g].n  # evaluation counts each sample as wrong
            continue
        for c in out.outputs:
            reward, err = safe_reward(env.reward, problem, c.text, timeout_s=cfg.algo.reward_timeout_s)
            p = len(out.prompt_token_ids)
            tokens = out.prompt_token_ids + c.token_ids
            rollouts.append(
                Rollout(
                    first_group + g,
                    tokens,
                    p,
                    [0] * p + [1] * len(c.token_ids),
                    [0.0] * p + c.logprobs.tolist(),
                    c.routed_experts,
                    reward,
                    c.finish_reason,
                    err,
                )
            )
    return rollouts


def multi_turn(
    env,
    engine,
    problems: list[Problem],
    params: list[SamplingParams],
    adapter,
    first_group: int = 0,
    timeout_s: float = 5.0,
) -> list[Rollout]:
    """Episodes: the model speaks, the environment answers (its tokens are not trained on), until done."""
    tok = engine.tokenizer
    episodes = []
    for g, (problem, sp) in enumerate(zip(problems, params, strict=True)):
        for j in range(sp.n):
            ids = tok(problem.prompt)["input_ids"]
            episodes.append(
                {
                    "group": first_group + g,
                    "problem": problem,
                    "state": env.start(problem),
                    "tokens": ids,
                    "num_prompt": len(ids),
                    "mask": [0] * len(ids),
                    "lp": [0.0] * len(ids),
                    "routed": None,
                    "reward": None,
                    "finish": "stop",
                    "error": None,
                    "seed": sp.seed * 31 + j,
                    "params": sp,
                }
            )
    active = episodes
    for turn in range(env.max_turns):
        if not active:
            break
        reqs = [
            Request(
                e["tokens"],
                SamplingParams(
                    temperature=e["params"].temperature,
                    top_p=e["params"].top_p,
                    max_tokens=e["params"].max_tokens,
                    seed=e["seed"] + turn,
                ),
                adapter=adapter,
            )
            for e in active
        ]
        outs = engine.generate(reqs)
        still = []
        for e, out in zip(active, outs, strict=True):
            if out.error_kind == "rejected":  # the context filled up: the episode ends unfinished
                e["reward"], e["finish"] = 0.0, "length"
                continue
            if out.error is not None:  # failed while running: its group is dropped and counted
                e["reward"], e["finish"], e["error"] = 0.0, "error", out.error
                continue
            c = out.outputs[0]
            e["tokens"] = e["tokens"] + c.token_ids
            e["mask"] += [1] * len(c.token_ids)
            e["lp"] += c.logprobs.tolist()
            e["routed"] = c.routed_experts
            e["finish"] = c.finish_reason
            # the environment's step runs in the reward worker, bounded by the reward timeout: one that raises or
            # hangs ends the episode with reward 0, counted, and the run goes on
            kind, value = safe_call(env_step, env, e["state"], c.text, timeout_s=timeout_s)
            if kind == "ok":
                message, reward, e["state"] = value
            else:
                message, reward, e["error"] = None, 0.0, kind
            if message is None or turn == env.max_turns - 1:
                e["reward"] = float(reward or 0.0)
                continue
            extra = tok(message, add_special_tokens=False)["input_ids"]
            e["tokens"] = e["tokens"] + extra
            e["mask"] += [0] * len(extra)
            e["lp"] += [0.0] * len(extra)
            e["routed"] = None  # covered again by the next turn's request
            still.append(e)
        active = still
    rollouts = []
    for e in episodes:
        routed = e["routed"]
        if routed is not None and routed.shape[0] != len(e["tokens"]) - 1:
            routed = None  # the last turn did not cover the whole sequence: train without replay rows for it
        rollouts.append(
            Rollout(
                e["group"],
                e["tokens"],
                e["num_prompt"],
                e["mask"],
                e["lp"],
                routed,
                float(e["reward"] or 0.0),
                e["finish"],
                e["error"],
            )
        )
    return rollouts


def drop_failed_groups(rollouts: list[Rollout], step: int) -> tuple[list[Rollout], int]:
    """The rollouts without the groups the engine failed (finish reason ``error``) and how many groups those were;
    TrainingStopped when it failed them all (the engine cannot serve this policy)."""
    failed = {r.group for r in rollouts if r.finish_reason == "error"}
    if failed and len(failed) == len({r.group for r in rollouts}):
        first = next(r.reward_error for r in rollouts if r.finish_reason == "error")
        raise TrainingStopped(f"step {step + 1}: the engine failed every request ({len(failed)}); first: {first}")
    return [r for r in rollouts if r.group not in failed], len(failed)


def keep_informative(rollouts: list[Rollout], group_size: int) -> tuple[list[Rollout], int]:
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    groups: dict[int, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r)
    rewards = torch.tensor([[r.reward for r in g] for g in groups.values()])
    keep = dynamic_sampling_keep(rewards)
    kept = [r for k, g in zip(keep.tolist(), groups.values(), strict=True) if k for r in g]
    return kept, int((~keep).sum())


def build_batch(rollouts: list[Rollout], cfg: RunConfig) -> Batch:
    """Right-padded rows with the loss mask, the engine's logprobs and (R3) its routing per token."""
    t = max(len(r.tokens) for r in rollouts)
    b = len(rollouts)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    rollout_lp = torch.zeros(b, t)
    replay = None
    shape = next((r.routed.shape[1:] for r in rollouts if r.routed is not None), None)
    if cfg.algo.r3 and shape is not None:
        replay = torch.full((b, t - 1, *shape), -1, dtype=torch.long)  # -1: route yourself (padding)
    for i, r in enumerate(rollouts):
        n = len(r.tokens)
        ids[i, :n] = torch.tensor(r.tokens)
        mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(r.loss_mask)
        rollout_lp[i, :n] = torch.tensor(r.rollout_logprobs)
        if replay is not None and r.routed is not None:
            replay[i, : n - 1] = r.routed.long()
        if cfg.algo.overlong_filter and r.finish_reason == "length":
            loss_mask[i] = 0
    batch = Batch(
        ids,
        mask,
        loss_mask,
        replay,
        {"rollout_logprobs": rollout_lp},
        total_tokens=max(1, int(loss_mask.sum())),
        total_seqs=max(1, int((loss_mask.sum(1) > 0).sum())),
    )
    return batch


def evaluate(cfg: RunConfig, env, engine, sampled: bool = False) -> float:
    """Held-out accuracy on ``env.eval_problems`` test-split problems: greedy answers, or (``sampled``) the mean
    over 4 samples each at the rollout temperature."""
    if cfg.env.eval_problems <= 0:
        return math.nan
    problems = env.problems(cfg.env.eval_problems, seed=cfg.train.seed, split="test")
    temperature, n = (cfg.rollout.temperature, 4) if sampled else (0.0, 1)
    rollouts = generate(cfg, env, engine, problems, sampling_params(cfg, len(problems), temperature, n, seed=10_007))
    return sum(r.reward >= 1.0 for r in rollouts) / len(rollouts)


def finish(cfg: RunConfig, run_dir: Path, policy: Policy) -> dict:
    """Export what the run made (PEFT adapter or merged weights) and the picture of its curves."""
    out = {}
    if cfg.policy.mode == "lora" and cfg.train.export_adapter:
        from moerl.bridges.peft import write_peft_adapter
        from moerl.errors import CheckpointError

        with policy.gathered() as model:  # a sharded policy's adapters, whole
            try:
                write_peft_adapter(model, run_dir / "adapter")
                out["adapter"] = str(run_dir / "adapter")
            except CheckpointError as e:  # adapters PEFT cannot express: merged weights instead
                from moerl.bridges import export_model
                from moerl.model.lora import merged_state_dict

                export_model(model, run_dir / "merged", state_dict=merged_state_dict(model))
                out["merged"], out["adapter_note"] = str(run_dir / "merged"), str(e)
    out["plot"] = str(plot_run(run_dir))
    return out
