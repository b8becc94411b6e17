"""The RL loop: prompts -> engine (n samples, routing capture) -> rewards -> advantages -> old / reference
logprobs (R3 replay) -> PPO epochs over mini-batches -> weight sync -> metrics -> checkpoint. Reads top to bottom;
``train`` is the whole loop, the helpers below it build its pieces. Rollouts come from ``moerl.rollout``: generated
in the step (synchronous) or ahead of it in a background thread (``algo.async``, bounded staleness)."""

from __future__ import annotations

import math
import os
import random
import shlex
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moerl.cores import CoreShare
from moerl.device import resolve_device
from moerl.engine import EngineConfig
from moerl.engine.compiled import COMPILE_SECONDS as DECODE_COMPILE_SECONDS
from moerl.engine.compiled import pays as pays_decode
from moerl.envs import make_env
from moerl.errors import EngineError, Preempted, TrainingStopped
from moerl.logs import library_logs
from moerl.metrics import MetricsLogger, plot_run, read_metrics
from moerl.modes import mode_of
from moerl.parallel.world import World, broadcast_json, init_world, stalled
from moerl.preempt import Preemption, Quiet
from moerl.rollout import make_engine
from moerl.rollout.ahead import RolloutsAhead
from moerl.rollout.episode import Episode, drop_stale, to_batch
from moerl.rollout.generator import Generator
from moerl.run_config import RunConfig
from moerl.rundir import CHECKPOINT, RunDir
from moerl.sync import sync_policy
from moerl.trainer import Batch, Policy
from moerl.trainer.advantages import compute_advantages
from moerl.trainer.checkpoint import recover_checkpoint, save_checkpoint
from moerl.trainer.compile import AutoCompile
from moerl.trainer.driver import DistributedPolicy, serve
from moerl.trainer.losses import kl_penalty, make_policy_loss
from moerl.trainer.mismatch import mismatch_metrics


def train(cfg: RunConfig, resume: bool = False, overwrite: bool = False, engines=None) -> dict | None:
    """Run the RL loop described by ``cfg`` in ``cfg.run_dir``; returns the final metrics (incl. held-out accuracy
    before / after).

    The run directory is owned for the run's lifetime (a second process is refused). A new run refuses a directory
    holding another run unless ``overwrite``; ``resume`` continues from the run's checkpoint, refusing config changes
    to fields that define the run. Every check runs before the run's records are written.

    With ``parallel`` ranks (under a torchrun launch, or as Ray actors), rank 0 runs the loop and returns; the
    others train and return None. ``engines``: where rank 0 starts Ray engine actors (``moerl.cluster``).
    """
    with _deterministic(cfg.train.deterministic):
        return _run(cfg, resume, overwrite, engines)


@contextmanager
def _deterministic(on: bool):
    """torch's deterministic algorithms for the run (``train.deterministic``), as they were after it."""
    before = torch.are_deterministic_algorithms_enabled()
    if on:  # before any CUDA work: cuBLAS reads its workspace setting once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _run(cfg: RunConfig, resume: bool, overwrite: bool, engines) -> dict | None:
    par = cfg.parallel
    world = init_world(
        par.dp,
        par.ep,
        par.pp,
        timeout_s=par.timeout_s,
        device=cfg.policy.device,
        schedule=par.schedule,
        microbatches=par.microbatches,
        stages=par.stages or None,
    )
    try:
        if not world.driver:  # a trainer rank: it trains on its shard of what rank 0 announces
            with Quiet():  # rank 0 answers a scheduler's signal for the run
                _serve(cfg, world)
            world.close()
            return None
        run = RunDir.open(cfg, resume=resume, overwrite=overwrite)
        try:
            with library_logs(run.path):  # vLLM's, torchao's, ... log lines: the run's libraries.log
                summary = _train(cfg, run, world, engines)
        finally:
            run.close()
    except Preempted:  # saved; the other ranks were told to stop: leave the group with them
        world.close()
        raise
    except RuntimeError as e:
        fault = stalled(e, par.timeout_s) if world.size > 1 else None
        if fault is None:
            raise
        raise fault from None
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


def _train(cfg: RunConfig, run: RunDir, world: World, engines) -> dict:
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    model_path = ensure_model(cfg, run.path, fresh=not run.resume)
    _seed(cfg.train.seed)
    if world.size == 1:
        policy = Policy(model_path, cfg.policy)
    else:
        broadcast_json(str(model_path))
        policy = DistributedPolicy(model_path, cfg.policy, world)
    try:
        with Preemption(cfg.train.preempt_grace_s) as preempt:
            return _train_policy(cfg, run, env, model_path, policy, engines, preempt)
    finally:
        policy.close()


def _train_policy(
    cfg: RunConfig, run: RunDir, env, model_path: Path, policy: Policy, engines, preempt: Preemption
) -> dict:
    engine = build_engine(cfg, model_path, engines)
    gen = build_generator(cfg, env, engine)
    metrics = ahead = None
    # torch threads follow the cores other processes leave (moerl.cores); not where ranks or Ray set them, nor where
    # reruns must compute bit for bit
    local = cfg.cluster.backend == "local" and policy.layout.ranks == 1 and not cfg.train.deterministic
    cores = CoreShare(enabled=local)
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
                row = gen.evaluate().metrics() | gen.evaluate(sampled=True).metrics("eval_accuracy_sampled")
                metrics.log(0, row)
                say_evaluation(0, row)
            if cfg.algo.async_:  # rollouts of the next steps are generated while this one trains
                ahead = RolloutsAhead(gen, start, cfg.train.steps, cfg.algo.max_staleness)
            tty = sys.stderr.isatty()  # a terminal gets a bar; a file or pipe one line per step
            bar = tqdm(range(start, cfg.train.steps), desc="rl", unit="step", disable=not tty)
            t_start = time.perf_counter()
            t_prev = time.perf_counter()  # samples/s over wall time, step end to step end (evaluation included)
            flat = 0  # steps in a row without an informative group
            r = cfg.rollout  # compile_decode auto: synchronous runs (async ones generate while the loop decides)
            auto = r.compile_decode == "auto" and r.engine == "native" and ahead is None and not cfg.train.deterministic
            decoding = [] if auto else None
            compiling = None if cfg.train.deterministic else AutoCompile(cfg.train.steps)
            for step in bar:
                policy.stop_state = {"step": step}  # a TrainingStopped saves the state after the last complete step
                if line := cores.check():
                    say(line, bar if tty else None)
                row = rl_step(cfg, gen, policy, loss_fn, step, ahead)
                flat = flat + 1 if row["informative_groups"] == 0 else 0
                if flat == FLAT_STEPS:
                    say(flat_warning(step + 1, row["reward_generated"]), bar if tty else None)
                policy.stop_state = {"step": step + 1}  # the weights are this step's now, whether the engine takes them
                try:
                    row |= push(gen, policy, sync, step, ahead, row, t_prev)
                except EngineError:
                    metrics.log(step + 1, row)  # the step trained: its row is kept with the state saved below
                    raise
                last = step + 1 == cfg.train.steps
                if last:  # what the last step's extra seconds are
                    bar.set_description("rl (final evaluation)")
                    if not tty:
                        say("moerl: final evaluation on the held-out problems")
                if last or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0):
                    row |= gen.evaluate().metrics()
                    if tty:  # a file or pipe has it in the step's line
                        say_evaluation(step + 1, row, bar)
                if last:
                    row |= gen.evaluate(sampled=True).metrics("eval_accuracy_sampled")
                metrics.log(step + 1, row)
                # compile where it pays (timings decide: not where reruns must be bit exact)
                if compiling is not None and (line := compiling.after(policy, step, row)):
                    say(line, bar if tty else None)
                if decoding is not None and step in (start + 1, start + 2):
                    decoding.append(engine.decode_seconds())
                    if len(decoding) == 2:  # the decode seconds of one warm step (its evaluation included)
                        _maybe_compile_decode(engine, cfg.train.steps - step - 1, decoding[1] - decoding[0])
                if "reward_mean" in row:
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", mismatch=f"{row['mismatch_k3_r3']:.1e}")
                if not tty:
                    done = step + 1 - start
                    say(progress_line(step + 1, cfg.train.steps, row, (time.perf_counter() - t_start) / done))
                every = cfg.train.checkpoint_every
                if last or (every and (step + 1) % every == 0) or preempt.signal_name:
                    save_checkpoint(ckpt_dir, policy, state={"step": step + 1})
                if preempt.signal_name and not last:  # a scheduler's signal: saved, stop (the last step just ends)
                    preempt.saved()
                    raise Preempted(
                        f"{preempt.signal_name} after step {step + 1} of {cfg.train.steps}; its state is saved in "
                        f"{ckpt_dir}. Continue with: {resume_command()}"
                    )
                t_prev = time.perf_counter()
        except EngineError as e:  # an engine process died: stop with the trained state saved
            raise TrainingStopped(f"{e}{policy.save_stop_checkpoint()}") from e
        except KeyboardInterrupt:  # Ctrl-C: keep the last complete step (a second Ctrl-C stops the save itself)
            if policy.layout.ranks == 1:  # several ranks would each need the others to save
                print(f"moerl: interrupted after step {policy.stop_state['step']}; saving it (Ctrl-C again: stop "
                      "the save, keep the last checkpoint)", file=sys.stderr, flush=True)  # fmt: skip
                try:
                    saved = policy.save_stop_checkpoint().removeprefix("; ")
                except KeyboardInterrupt:  # the save writes aside and renames: the last complete one is intact
                    found, _ = recover_checkpoint(ckpt_dir)
                    kept = f"the last checkpoint ({ckpt_dir}) is kept" if found else "there is no earlier checkpoint"
                    print(f"moerl: save stopped by a second Ctrl-C; {kept}", file=sys.stderr, flush=True)
                    raise
                print(f"moerl: {saved}; continue with --resume", file=sys.stderr, flush=True)
            raise
    finally:
        cores.restore()
        if ahead is not None and not ahead.close(cfg.rollout.engine_timeout_s):
            print(f"moerl: rollouts ahead of the trainer were still being generated rollout.engine_timeout_s="
                  f"{cfg.rollout.engine_timeout_s:g} s after the loop ended; the engine is closed under them",
                  file=sys.stderr, flush=True)  # fmt: skip
        if metrics is not None:
            metrics.close()
        engine.close()

    print("moerl: training done; exporting the results and drawing the curves", file=sys.stderr, flush=True)
    rows = read_metrics(run.path)
    summary = {"eval_problems": rows[-1].get("eval_problems", 0)}  # distinct held-out problems, never trained on
    for when, row in (("before", rows[0]), ("after", rows[-1])):
        for key in ("", "_low", "_high"):  # the greedy accuracy and its 95% interval
            summary[f"accuracy_{when}{key}"] = row.get(f"eval_accuracy{key}", math.nan)
        summary[f"accuracy_sampled_{when}"] = row.get("eval_accuracy_sampled", math.nan)
    return summary | finish(cfg, run.path, policy)


def resume_command() -> str:
    """This process's ``moerl`` command line with ``--resume`` (and without ``--overwrite``)."""
    args = [a for a in sys.argv[1:] if a not in ("--overwrite", "--resume")]
    return shlex.join(["moerl", *args, "--resume"])


def progress_line(step: int, total: int, row: dict, seconds_per_step: float) -> str:
    """One line for a step when the output is not a terminal: step / total, reward, held-out accuracy when it was
    evaluated, s/step and the time left (names a newcomer reads; the metrics file keeps the jargon ones)."""
    parts = [f"step {step}/{total}"]
    if "reward_mean" in row:
        parts.append(f"reward {row['reward_mean']:.3f}")
    elif row.get("skipped"):
        parts.append("skipped (every group had equal rewards: nothing to learn from)")
    if "eval_accuracy" in row:
        parts.append(f"held-out accuracy {held_out_text(row)}")
    if "mismatch_k3_r3" in row:
        parts.append(f"engine/trainer mismatch {row['mismatch_k3_r3']:.1e}")
    left = (total - step) * seconds_per_step
    parts.append(f"{seconds_per_step:.2f} s/step, {int(left // 60)}m{int(left % 60):02d}s left")
    return "moerl: " + " | ".join(parts)


def held_out_text(row: dict, prefix: str = "eval_accuracy") -> str:
    """``47.0% (95% CI 40.2-53.9%, 200 problems)``: an evaluation's accuracy with its interval and size."""
    acc, low, high = row.get(prefix), row.get(f"{prefix}_low"), row.get(f"{prefix}_high")
    if acc is None or (isinstance(acc, float) and math.isnan(acc)):
        return "n/a (env.eval_problems: 0)"
    if low is None or high is None:
        return f"{acc:.1%}"
    return f"{acc:.1%} (95% CI {low:.1%}-{high:.1%}, {row.get('eval_problems')} problems)"


def say(line: str, bar=None) -> None:
    """A line on the console (stderr; above the bar on a terminal)."""
    (bar.write if bar is not None else partial(print, flush=True))(line, file=sys.stderr)


def say_evaluation(step: int, row: dict, bar=None) -> None:
    """An evaluation on the console in words."""
    when = "before training" if step == 0 else f"after step {step}"
    say(f"moerl: held-out accuracy {when}: {held_out_text(row)}", bar)


FLAT_STEPS = 3  # this many steps in a row without a group whose rewards differ: the run is told why it learns nothing


def flat_warning(step: int, reward: float) -> str:
    """Why steps ``step - FLAT_STEPS + 1 .. step`` (1-based) learned nothing, and what to change."""
    if reward >= 1.0:
        why, fix = "every sample was right (the task is too easy for the model)", "make the task harder"
    elif reward <= 0.0:
        why = "every sample was wrong (the model solves none of these problems)"
        fix = "start from a model that solves some (model.sft_steps warms the random preset up, or model.path=DIR)"
    else:
        why, fix = f"each group's samples scored alike (mean reward {reward:.3f})", "raise rollout.temperature"
    return (
        f"moerl: warning: steps {step - FLAT_STEPS + 1}-{step} learned nothing: within every group of "
        f"samples the rewards were equal, so no sample was better than its group's baseline; {why}. To fix: {fix}, "
        "or raise rollout.group_size."
    )


def _maybe_compile_decode(engine, steps_left: int, decode_seconds: float) -> None:
    if pays_decode(steps_left, decode_seconds) and engine.compile_decode():
        print(
            f"moerl: compiling the engine's decode step (rollout.compile_decode: auto; {steps_left} steps left at "
            f"{decode_seconds:.2f} s of decoding each repay the ~{DECODE_COMPILE_SECONDS:.0f} s it takes)",
            file=sys.stderr,
        )


def rl_step(cfg: RunConfig, gen: Generator, policy: Policy, loss_fn, step: int, ahead=None) -> dict:
    """The rollouts of step ``step`` (generated now, or ahead by ``ahead``) and the training on them; returns the
    step's metrics row (``push`` completes it)."""
    if ahead is None:  # synchronous: the trainer waits while the engine generates, the engine while it trains
        got = gen.collect(step)
        row = {"seconds_trainer_idle": got.seconds}
    else:
        got, trainer_idle, engine_idle = ahead.get(step)
        row = {"seconds_trainer_idle": trainer_idle, "seconds_engine_idle": engine_idle}
    # a batch never holds samples more than max_staleness weight versions behind the trainer (version ``step``)
    episodes, stale = drop_stale(got.episodes, step, cfg.algo.max_staleness if ahead is not None else 0)
    row |= {
        "engine_errors": float(got.failed_groups),
        "dropped_groups": float(got.dropped_groups),
        "stale_dropped_frac": stale / max(1, got.samples),
        "gen_tokens_per_s": got.gen_tokens / max(got.seconds, 1e-9),
        "seconds_generate": got.seconds,
        "samples": float(len(episodes)),
        "reward_generated": got.reward_generated,  # every sample's, dropped groups' too
        "informative_groups": float(got.informative_groups),
        "engine_restarts": float(getattr(gen.engine, "restarts", 0)),  # Ray engine actors brought back, in all
        "requeued_requests": float(getattr(gen.engine, "requeued", 0)),
    }
    if not episodes:  # every group was uninformative (or too old): nothing to learn from this step
        return row | {"skipped": 1.0}
    behind = [step - e.version for e in episodes]
    t1 = time.perf_counter()
    row |= learn(cfg, policy, loss_fn, episodes, step)
    if ahead is None:
        row["seconds_engine_idle"] = time.perf_counter() - t1  # the engine had nothing to do while this trained
    return row | {"staleness_mean": sum(behind) / len(behind), "staleness_max": float(max(behind))}


def push(gen: Generator, policy: Policy, sync, step: int, ahead, row: dict, t_prev: float) -> dict:
    """The weights after step ``step`` to the engine as version ``step + 1`` (a skipped step's too, unchanged, so
    versions count steps), refused and kept out of the engine if any tensor is non-finite. Weights change between
    engine calls: the sync waits for the call in flight, then goes before the next. Returns the row's sync part and
    the step's wall time since the previous step ended (``t_prev``)."""
    t1 = time.perf_counter()
    with gen.turns.turn(priority=True):
        t2 = time.perf_counter()
        stats = sync(policy, gen.engine, version=step + 1)
    if ahead is not None:
        ahead.advanced(step + 1)
        row["seconds_trainer_idle"] += t2 - t1
    t3 = time.perf_counter()
    return {
        "seconds_sync": t3 - t2,
        "seconds_step": t3 - t_prev,
        "samples_per_s": row["samples"] / max(t3 - t_prev, 1e-9),
        "sync_bytes": float(stats.bytes),
        "weight_version": float(stats.version),
    }


def learn(cfg: RunConfig, policy: Policy, loss_fn, episodes: list[Episode], step: int) -> dict:
    """Old / reference logprobs (R3 replay), advantages per group, PPO epochs over mini-batches: the trainer's part
    of step ``step``; returns its metrics.

    On-policy steps (one epoch, one mini-batch, no KL shaping the rewards) run no separate old-logprob forward: the
    old logprobs are the training forward's own, detached (the loss's default), and the rollout-vs-trainer mismatch
    comes from that forward. The R3-off mismatch metric costs a forward of its own: every
    ``algo.mismatch_metric_every`` steps. Logprobs are at the rollout temperature (temperature 0 as 1, as the
    engine reports them)."""
    temperature = cfg.rollout.temperature or 1.0
    # 1. a training batch with the engine's routing and logprobs
    batch = to_batch(episodes, cfg.algo.r3, cfg.algo.overlong_filter)
    t1 = time.perf_counter()
    mm_on, mm_off = _trainer_logprobs(cfg, policy, batch, step, temperature)
    rewards = _rewards(cfg, episodes, batch)
    # 2. advantages per group
    batch.extras["advantages"] = _advantages(cfg, rewards)
    # 3. PPO epochs over mini-batches
    t2 = time.perf_counter()
    train_metrics = _ppo_epochs(cfg, policy, loss_fn, batch, step, temperature)
    t3 = time.perf_counter()
    trained_tokens = int(batch.loss_mask.sum()) * cfg.algo.ppo_epochs
    row = _episode_metrics(episodes, batch, rewards) | {
        "train_tokens_per_s": trained_tokens / max(t3 - t2, 1e-9),
        "seconds_logprobs": t2 - t1,
        "seconds_train": t3 - t2,
    }
    row |= {key: sum(m[key] for m in train_metrics) / len(train_metrics) for key in train_metrics[0]}
    return row | _mismatch_row(row, mm_on, mm_off)


def _on_policy(cfg: RunConfig) -> bool:
    """One epoch, one mini-batch, no KL shaping the rewards: the training forward's own logprobs are the old ones."""
    a, loss_cfg = cfg.algo, cfg.algo.loss
    return a.ppo_epochs == 1 and a.mini_batches == 1 and not (loss_cfg.kl_coef > 0 and loss_cfg.kl_in_reward)


def _old_and_reference(
    cfg: RunConfig, policy: Policy, batch: Batch, temperature: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The old and reference logprobs a step needs before training (None where it needs none): one forward for
    both where the policy can (LoRA: the reference is adapters off)."""
    a, kl = cfg.algo, cfg.algo.loss.kl_coef > 0
    if _on_policy(cfg):
        ref = policy.forward_logprobs(batch, reference=True, temperature=temperature)[0] if kl else None
        return None, ref
    if kl:
        return policy.logprobs_with_reference(batch, a.r3, temperature)
    return policy.forward_logprobs(batch, replay=a.r3, temperature=temperature)[0], None


def _trainer_logprobs(
    cfg: RunConfig, policy: Policy, batch: Batch, step: int, temperature: float
) -> tuple[dict | None, dict | None]:
    """Old / reference logprobs into ``batch.extras`` (a non-finite one stops the run, the state saved); returns the
    rollout-vs-trainer mismatch with R3 (None on-policy: the training forward gives it) and, every
    ``algo.mismatch_metric_every`` steps, without it (else None)."""
    a = cfg.algo
    mm_on = mm_off = None
    old, ref = _old_and_reference(cfg, policy, batch, temperature)
    if old is not None:
        if not bool(torch.isfinite(old[batch.loss_mask.bool()]).all()):
            raise TrainingStopped(
                f"step {step + 1}: the trainer's logprobs of the rollouts are non-finite{policy.save_stop_checkpoint()}"
            )
        mm_on = mismatch_metrics(old, batch.extras["rollout_logprobs"], batch.loss_mask)
        batch.extras["old_logprobs"] = old
    if ref is not None:
        batch.extras["ref_logprobs"] = ref
    if a.r3 and a.mismatch_metric_every and step % a.mismatch_metric_every == 0:  # the mismatch without replay
        no_r3 = policy.forward_logprobs(batch, replay=False, temperature=temperature)[0]
        mm_off = mismatch_metrics(no_r3, batch.extras["rollout_logprobs"], batch.loss_mask)
    return mm_on, mm_off


def _rewards(cfg: RunConfig, episodes: list[Episode], batch: Batch) -> torch.Tensor:
    """The episodes' rewards, less ``kl_coef`` times each sequence's KL to the reference with ``kl_in_reward``."""
    loss_cfg = cfg.algo.loss
    rewards = torch.tensor([e.reward for e in episodes])
    if loss_cfg.kl_coef > 0 and loss_cfg.kl_in_reward:
        old, ref = batch.extras.get("old_logprobs"), batch.extras.get("ref_logprobs")
        rewards = rewards - loss_cfg.kl_coef * (kl_penalty(old, ref, loss_cfg.kl_estimator) * batch.loss_mask).sum(1)
    return rewards


def _advantages(cfg: RunConfig, rewards: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages of ``algo.advantage``, each group of ``rollout.group_size`` samples against itself."""
    grouped = rewards.view(-1, cfg.rollout.group_size)
    kwargs = {"std_normalize": cfg.algo.std_normalize} if cfg.algo.advantage == "grpo" else {}
    return compute_advantages(grouped, cfg.algo.advantage, **kwargs).reshape(-1)


def _ppo_epochs(cfg: RunConfig, policy: Policy, loss_fn, batch: Batch, step: int, temperature: float) -> list[dict]:
    """``algo.ppo_epochs`` passes over ``batch``, each shuffled (a function of the run's seed and ``step``) into
    ``algo.mini_batches`` optimizer steps; returns each step's metrics."""
    a = cfg.algo
    train_metrics: list[dict] = []
    gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
    for _ in range(a.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen)
        for idx in order.chunk(a.mini_batches):
            mb = _mini_batch(batch, idx)
            train_metrics.append(policy.train_step(mb, loss_fn, replay=a.r3, entropy=True, temperature=temperature))
    return train_metrics


def _mini_batch(batch: Batch, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` of ``batch`` as a batch of their own: its totals are the mini-batch's (one optimizer step)."""
    return Batch(
        batch.input_ids[idx],
        batch.attention_mask[idx],
        batch.loss_mask[idx],
        None if batch.replay is None else batch.replay[idx],
        {k: v[idx] for k, v in batch.extras.items()},
    )


def _episode_metrics(episodes: list[Episode], batch: Batch, rewards: torch.Tensor) -> dict:
    """What the step's episodes scored: rewards (KL-shaped ones included), accuracy, lengths, reward failures."""
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": sum(e.reward >= 1.0 for e in episodes) / len(episodes),
        "response_length": float(batch.loss_mask.sum(1).float().mean()),
        "reward_errors": float(sum(e.reward_error == "error" for e in episodes)),
        "reward_timeouts": float(sum(e.reward_error == "timeout" for e in episodes)),
    }


def _mismatch_row(row: dict, mm_on: dict | None, mm_off: dict | None) -> dict:
    """The rollout-vs-trainer mismatch with R3 (on-policy: the training forward's own, in ``row``; exact with one
    micro-batch, else the rows-weighted mean of the micro-batches' token means) and without it, when measured."""
    if mm_on is None:
        mm_on = {"k3": row["mismatch_k3"], "frac_large_diff": row["mismatch_frac_large_diff"]}
    out = {"mismatch_k3_r3": mm_on["k3"], "mismatch_frac_r3": mm_on["frac_large_diff"]}
    if mm_off is not None:
        out |= {"mismatch_k3_no_r3": mm_off["k3"], "mismatch_frac_no_r3": mm_off["frac_large_diff"]}
    return out


# -- the pieces -------------------------------------------------------------------------------------------------


def ensure_model(cfg: RunConfig, run_dir: Path, fresh: bool) -> Path:
    """The checkpoint to start from: ``model.path``; a random model of ``model.arch`` / ``preset`` / ``seed``
    warmed up for ``model.sft_steps`` (from ``model.base_cache``, built there on first use); or that random model
    itself in the run directory, written by a ``fresh`` run (a resume reuses it, or writes the same one again)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    if cfg.model.sft_steps:  # a warmed-up random model, shared by the runs of this recipe
        from moerl.warmup import warmed_base

        return warmed_base(cfg, make_env(cfg.env.name, **cfg.env.kwargs))
    path = run_dir / "base_model"
    if fresh or not (path / "config.json").exists():
        from moerl.presets import init_model

        init_model(cfg.model.arch, cfg.model.preset, path, seed=cfg.model.seed)
    return path


def build_generator(cfg: RunConfig, env, engine) -> Generator:
    """The run's Generator: ``env``'s problems on ``engine``, given the run's config sections it reads."""
    seed, held_out, lora = cfg.train.seed, cfg.env.eval_problems, mode_of(cfg.policy.mode).adapter_slot is not None
    return Generator(env, engine, cfg.rollout, cfg.algo, seed=seed, eval_problems=held_out, lora=lora)


def shares_the_trainers_gpu(cfg: RunConfig) -> bool:
    """Whether the rollout engine runs in the trainer's process on the trainer's GPU: then its KV cache holds memory
    only while it generates, and the trainer has it back while it trains (engine and trainer take turns)."""
    r = cfg.rollout
    if r.engine != "native" or r.placement != "inprocess" or r.compile_decode is True or cfg.cluster.backend != "local":
        return False
    trainer = resolve_device(cfg.policy.device, key="policy.device")
    return trainer.type == "cuda" and resolve_device(r.device, key="rollout.device") == trainer


def build_engine(cfg: RunConfig, model_path: Path, engines=None):
    """The rollout engines (``rollout.num_engines``, placed per ``rollout.placement``, or as Ray actors where
    ``engines`` says) on their own copy of the base weights, set up for the policy's mode."""
    mode, lcfg, r = mode_of(cfg.policy.mode), cfg.policy.lora, cfg.rollout
    ecfg = EngineConfig(
        max_num_seqs=r.max_num_seqs,
        max_model_len=r.max_model_len,
        max_loras=0 if mode.adapter_slot is None else 1,
        max_lora_rank=lcfg.rank,
        lora_layout=lcfg.layout,
        lora_targets=lcfg.targets,
        compile_decode=r.compile_decode,
        seed=cfg.train.seed,
        release_cache=shares_the_trainers_gpu(cfg),
    )
    mx = mode.engine_mx(cfg.policy)
    if engines is not None:
        from moerl.rollout.pool import EnginePool
        from moerl.rollout.ray_engine import start_engines
        from moerl.rollout.spec import EngineSpec

        c = cfg.cluster
        spec = EngineSpec(str(model_path), ecfg, r.dtype, r.device, mx_scale_mode=mx, threads=engines.engine_threads)
        spec.kind, spec.vllm_args = r.engine, r.vllm_args
        remote = start_engines(spec, r.num_engines, engines, r.weight_transport, c.engine_restarts, r.engine_timeout_s)
        return EnginePool(spec, "ray", r.num_engines, remote=remote, transport=r.weight_transport)
    threads = r.engine_threads or max(1, torch.get_num_threads() // r.num_engines)
    return make_engine(
        r.engine,
        model_path,
        ecfg,
        placement=r.placement,
        num_engines=r.num_engines,
        dtype=r.dtype,
        device=r.device,
        mx_scale_mode=mx,
        threads=threads if r.placement == "process" else 0,
        vllm_args=r.vllm_args,
        weight_transport=r.weight_transport,
        timeout_s=r.engine_timeout_s,
    )


def finish(cfg: RunConfig, run_dir: Path, policy: Policy) -> dict:
    """Export what the run made (PEFT adapter or merged weights) and the picture of its curves."""
    out = policy.mode.export(policy, run_dir) if cfg.train.export_adapter else {}
    out["plot"] = str(plot_run(run_dir))
    return out
