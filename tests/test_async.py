"""Asynchronous RL (``algo.async``): rollouts generated ahead of the trainer with bounded staleness learn as well as
the synchronous loop on the same samples, never exceed the bound, and a bad bound is refused."""

import pytest
from run_helpers import metric_rows, run_cfg

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.loop import train
from moerl.run_config import RunConfig

STEPS = 30  # 15 left k=1 0.11 below sync on an AVX512-BF16 host (one trajectory's noise); 30 settles


def _rewards(run_dir) -> tuple[list[dict], float, float]:
    rows = [r for r in metric_rows(run_dir) if "loss" in r]
    rewards = [r["reward_mean"] for r in rows]
    return rows, sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5


def test_async_runs_learn_as_well_as_the_synchronous_run_within_their_staleness(warm_model, four_problems, tmp_path):
    """The measure: the mean reward of the last 5 of 30 steps (32 samples each, the same problems and seeds). Measured
    on an AVX512-BF16 host (full, fp32, lr 1e-3): sync 0.57 -> 0.98, k=1 0.53 -> 0.99, k=2 0.47 -> 0.96 (first 3
    steps -> last 5). Each async run must rise by 0.15 and end within 0.1 of the synchronous run."""
    over = {"policy.optim.lr": 1e-3, "rollout.prompts_per_step": 4, "env.eval_problems": 0}
    train(run_cfg(tmp_path / "sync", warm_model, "full", steps=STEPS, **over))
    sync_rows, _, sync_late = _rewards(tmp_path / "sync")
    assert all(r["staleness_max"] == 0 for r in sync_rows)
    for k in (1, 2):
        run = tmp_path / f"async{k}"
        train(run_cfg(run, warm_model, "full", steps=STEPS, **over, **{"algo.async": "true", "algo.max_staleness": k}))
        rows, first, late = _rewards(run)
        # within 0.1 includes 0.1: rewards are multiples of 1/160 (32 samples x 5 steps), so exactly 0.1 below occurs
        # (with AVX2-capped kernels: sync 0.956, k=1 0.856)
        assert len(rows) == STEPS and late > first + 0.15 and late >= sync_late - 0.1, (k, first, late, sync_late)
        assert all(r["staleness_max"] <= k and r["stale_dropped_frac"] == 0 for r in rows)
        # generation ran ahead: from step k on the rollouts were k versions behind on (nearly) every step
        assert sum(r["staleness_max"] == k for r in rows[k:]) >= (STEPS - k) // 2, [r["staleness_max"] for r in rows]
        assert rows[-1]["weight_version"] == STEPS and rows[-1]["mismatch_k3_r3"] < 5e-2
        for key in ("seconds_trainer_idle", "seconds_engine_idle", "samples_per_s", "staleness_mean"):
            assert rows[-1][key] >= 0, key


def test_a_staleness_bound_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"config key 'algo.max_staleness'=0: must be >= 1"):
        load_config(RunConfig, None, ["algo.async=true", "algo.max_staleness=0"])
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.asynch'; did you mean algo.async"):
        load_config(RunConfig, None, ["algo.asynch=true"])


def test_a_weight_sync_goes_between_engine_calls_never_inside_one(warm_model, tmp_path):
    """The chosen rule (weights change between requests): a sync asked for while a generation call runs waits for
    it, so that call's samples are all the old weights' (the same tokens as a call with no sync at all, tagged with
    the old version); the next call has the new weights (different tokens: the update is real)."""
    import threading
    import time

    import torch

    from moerl.build import build_engine, build_generator
    from moerl.envs import make_env

    cfg = run_cfg(tmp_path, warm_model, "full", **{"rollout.max_tokens": 8})
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    engine = build_engine(cfg, warm_model)
    try:
        gen = build_generator(cfg, env, engine)
        problems, params = env.problems(16, seed=1), gen.sampling(16, 1.0, 8, seed=5)
        reference = [e.tokens for e in gen.generate(problems, params)]
        head = engine.engines[0].model.lm_head.weight
        changed = {"lm_head.weight": head.detach() + 0.5 * torch.randn_like(head.detach())}
        result = {}
        during = threading.Thread(target=lambda: result.update(episodes=gen.generate(problems, params)))
        during.start()
        while not gen.turns._busy:  # the call holds the engine
            time.sleep(0.001)
        with gen.turns.turn(priority=True):  # the sync asks while the call runs
            engine.update_weights(changed, version=1)
        during.join()
        assert [e.tokens for e in result["episodes"]] == reference and {e.version for e in result["episodes"]} == {0}
        after = gen.generate(problems, params)
        assert {e.version for e in after} == {1} and [e.tokens for e in after] != reference
    finally:
        engine.close()
