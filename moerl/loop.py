"""The RL loop: prompts -> engine (n samples, routing capture) -> rewards -> advantages -> old / reference
logprobs (R3 replay) -> PPO epochs over mini-batches -> weight sync -> metrics -> checkpoint. ``train`` sets up the
ranks; ``_train_policy`` is the loop, read top to bottom; ``rl_step`` and ``push`` are one step. The algorithm is in
``moerl.algo``, what the run is built from in ``moerl.build``, what happens around the steps (evaluations,
checkpoints, auto-compile, results) in ``moerl.hooks``, the console in ``moerl.console``. Rollouts come from
``moerl.rollout``: generated in the step (synchronous) or ahead of it in a background thread (``algo.async``,
bounded staleness)."""

from __future__ import annotations

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

from moerl.algo import learn
from moerl.build import build_engine, build_generator, ensure_model
from moerl.config import to_dict
from moerl.console import Console, FlatRewards, resume_command, say_evaluation
from moerl.console import say as console_say
from moerl.cores import CoreShare
from moerl.envs import make_env
from moerl.errors import EngineError, MoerlError, Preempted, TrainingStopped
from moerl.hooks import AutoTune, Evaluations, Saves, results
from moerl.logs import library_logs
from moerl.metrics import MetricsLogger, optional, wandb_module
from moerl.parallel.world import World, broadcast_json, init_world, stalled
from moerl.preempt import CtrlC, Preemption, Quiet
from moerl.rollout.ahead import RolloutsAhead
from moerl.rollout.episode import drop_stale
from moerl.rollout.generator import Generator
from moerl.run_config import RunConfig
from moerl.rundir import CHECKPOINT, RunDir
from moerl.sync import sync_policy
from moerl.trainer import Policy
from moerl.trainer.checkpoint import rng_state
from moerl.trainer.driver import DistributedPolicy, serve
from moerl.trainer.losses import make_policy_loss


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
        cp=par.cp,
    )
    try:
        if not world.driver:  # a trainer rank: it trains on its shard of what rank 0 announces
            with Quiet():  # rank 0 answers a scheduler's signal for the run
                _serve(cfg, world)
            world.close()
            return None
        run = RunDir.open(cfg, resume=resume, overwrite=overwrite)
        refused = False  # bad input found before the run began: the directories made for it go again
        try:
            with library_logs(run.path):  # vLLM's, torchao's, ... log lines: the run's libraries.log
                summary = _train(cfg, run, world, engines)
        except MoerlError as e:
            refused = not isinstance(e, Preempted)
            raise
        finally:
            run.close(refused)
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
    with Preemption(cfg.train.preempt_grace_s) as preempt:
        model_path = _first_model(cfg, run, preempt)
        _seed(cfg.train.seed)
        if world.size == 1:
            policy = Policy(model_path, cfg.policy)
        else:
            broadcast_json(str(model_path))
            policy = DistributedPolicy(model_path, cfg.policy, world)
        try:
            with CtrlC() as ctrl_c:
                return _train_policy(cfg, run, env, model_path, policy, engines, preempt, ctrl_c)
        finally:
            policy.close()


def _first_model(cfg: RunConfig, run: RunDir, preempt: Preemption) -> Path:
    """The checkpoint the run starts from (``moerl.build.ensure_model``). A scheduler's signal during a warm-up stops
    the run before it has begun (nothing to save): it says how to go on."""
    try:
        return ensure_model(cfg, run.path, fresh=not run.resume, stopped=lambda: preempt.signal_name)
    except Preempted as e:
        # with --overwrite the previous run is still there (the run had not begun): only the same command starts anew
        again = shlex.join(["moerl", *sys.argv[1:]]) if run.overwrite else resume_command()
        raise Preempted(f"{e}. Continue with: {again}") from None


def _train_policy(
    cfg: RunConfig, run: RunDir, env, model_path: Path, policy: Policy, engines, preempt: Preemption, ctrl_c: CtrlC
) -> dict:
    engine = build_engine(cfg, model_path, engines)
    gen = build_generator(cfg, env, engine)
    metrics = ahead = None
    # torch threads follow the cores other processes leave (moerl.cores); not where ranks or Ray set them, nor where
    # reruns must compute bit for bit
    local = cfg.cluster.backend == "local" and policy.layout.ranks == 1 and not cfg.train.deterministic
    cores = CoreShare(enabled=local)
    try:
        if (room := gen.room()) is not None:  # refuses a context window no prompt fits; says what a short one cuts
            console_say(room)
        wandb_module(cfg.metrics.wandb)  # asked for and missing: refused before the run's records are written
        tensorboard, tensorboard_note = optional("tensorboard", cfg.metrics.tensorboard)  # refused here where asked
        plot, plot_note = optional("plot", cfg.metrics.plot)  # for and missing; auto goes without, and says so
        for line in (tensorboard_note, plot_note):
            if line is not None:
                console_say(line)
        if run.resume:
            policy.load(run.checkpoint)  # last: it restores the RNGs the steps go on with
        run.begin()  # everything that can refuse the run has passed: now its records are written
        start, total = run.start_step, cfg.train.steps
        saves = Saves(policy, run.path / CHECKPOINT, cfg.train.checkpoint_every, total, preempt)
        policy.stop_checkpoint_dir, policy.before_update = saves.directory, ctrl_c.hold
        _reached(policy, start)
        loss_fn = make_policy_loss(cfg.algo.loss)
        purge = start + 1 if run.resume else None  # one row per step, 0 first
        metrics = MetricsLogger(run.path, tensorboard, purge_step=purge, wandb=cfg.metrics.wandb, config=to_dict(cfg))
        sync = partial(sync_policy, bucket_bytes=cfg.rollout.sync_bucket_mb << 20)
        evals = Evaluations(gen, cfg.train.eval_every, total)
        try:
            sync(policy, engine, version=start)
            if start == 0:
                metrics.log(0, first := evals.first())
                say_evaluation(0, first)
            if cfg.algo.async_:  # rollouts of the next steps are generated while this one trains
                ahead = RolloutsAhead(gen, start, total, cfg.algo.max_staleness)
            console, flat = Console(start, total), FlatRewards()
            tune = AutoTune(cfg, engine, start, asynchronous=ahead is not None)
            t_prev = time.perf_counter()  # samples/s over wall time, step end to step end (evaluation included)
            for step in console.steps():
                ctrl_c.begin(step)  # Ctrl-C stops at once until the step's first optimizer step, then at its end
                console.say(cores.check())
                row = rl_step(cfg, gen, policy, loss_fn, step, ahead)
                console.say(*gen.scorer.failures.take())  # a reward function that failed, named once
                ctrl_c.hold()  # the step is in the state (a skipped one too): its row is written before a Ctrl-C stops
                console.say(flat.after(step, row))
                # the weights are this step's now, whether the engine takes them (the RNG streams: as they are)
                policy.stop_state, policy.stop_rng = {"step": step + 1}, None
                try:
                    row |= push(gen, policy, sync, step, ahead, row, t_prev)
                except EngineError:
                    metrics.log(step + 1, row)  # the step trained: its row is kept with the state saved below
                    raise
                if step + 1 == total:
                    console.final_evaluation()
                row |= evals.after(step)
                metrics.log(step + 1, row)
                console.say(*tune.after(policy, step, row))
                console.step_done(step, row)
                saves.after(step)
                _reached(policy, step + 1)
                ctrl_c.step_done()  # a Ctrl-C held since the step's training began stops here
                t_prev = time.perf_counter()
        except EngineError as e:  # an engine process died: stop with the trained state saved
            raise TrainingStopped(f"{e}{policy.save_stop_checkpoint()}") from e
        except KeyboardInterrupt:
            saves.interrupted(cut=ctrl_c.step + 1 if ctrl_c.mid_step else None)
            raise
    finally:
        cores.restore()
        if ahead is not None and not ahead.close(cfg.rollout.engine_timeout_s):
            print(f"moerl: rollouts ahead of the trainer were still being generated rollout.engine_timeout_s="
                  f"{cfg.rollout.engine_timeout_s:g} s after the loop ended; the engine is closed under them",
                  file=sys.stderr, flush=True)  # fmt: skip
        if metrics is not None:
            metrics.close()
        gen.close()
        engine.close()
    print("moerl: training done; exporting the results and drawing the curves", file=sys.stderr, flush=True)
    return results(cfg, run.path, policy, plot)


def _reached(policy: Policy, step: int) -> None:
    """The run has completed ``step`` steps: until the next step's optimizer steps begin, a stop saves this state, with
    the RNG streams as they are now (what the run goes on from), not as the step in progress has drawn them."""
    policy.stop_state, policy.stop_rng = {"step": step}, rng_state()


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
        "cut_frac": got.cut / max(1, got.samples),  # completions cut at max_tokens or at the context window
        "context_cut_frac": got.context_cut / max(1, got.samples),  # at the context window (rollout.max_model_len)
        "reward_generated": got.reward_generated,  # every sample's, dropped groups' too
        "informative_groups": float(got.informative_groups),
        "engine_restarts": float(gen.engine.restarts),  # Ray engine actors brought back, in all
        "requeued_requests": float(gen.engine.requeued),
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
