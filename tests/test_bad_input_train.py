"""Training never ends in a raw crash: config ranges are checked at load, non-finite numbers stop the run with its
last good checkpoint on disk (and never reach the engine), a hanging environment step is bounded."""

import json
import math

import pytest
import torch
from run_helpers import metric_rows, run_cfg, tree_hash

from moerl.cli import main
from moerl.config import load_config
from moerl.errors import ConfigError, TrainingStopped
from moerl.loop import train
from moerl.rollout.episode import Episode, drop_failed_groups
from moerl.run_config import RunConfig

BAD_CONFIGS = [
    ("policy.optim.lr=0", r"optim.lr=0.0: must lie in \(0, 1\] \(config section 'policy.optim'\)"),
    ("policy.optim.lr=.nan", r"optim.lr=nan: must lie in \(0, 1\]"),
    ("policy.optim.lr=-1e-3", r"optim.lr=-0.001: must lie in \(0, 1\]"),
    ("policy.optim.lr=1e39", r"optim.lr=1e\+39: must lie in \(0, 1\]"),
    ("policy.optim.schedule=linear", r"optim.schedule='linear': allowed: constant, cosine"),
    ("policy.lora.rank=0", r"lora.rank=0: must be >= 1"),
    ("policy.lora.layout=fused", r"lora.layout='fused': allowed: per_expert, shared_outer"),
    ("policy.mx_scale_mode=ceil", r"PolicyConfig.mx_scale_mode='ceil': allowed: floor, rceil"),
    ("train.steps=0", r"'train.steps'=0: must be >= 1"),
    ("train.checkpoint_every=-1", r"'train.checkpoint_every'=-1: must be >= 0"),
    ("train.preempt_grace_s=0", r"'train.preempt_grace_s'=0.0: must be > 0 \(seconds\)"),
    ("train.preempt_grace_s=.inf", r"'train.preempt_grace_s'=inf: must be > 0 \(seconds\)"),
    ("rollout.prompts_per_step=0", r"'rollout.prompts_per_step'=0: must be >= 1"),
    ("rollout.temperature=-1", r"'rollout.temperature'=-1.0: must be >= 0"),
    ("rollout.top_p=0", r"'rollout.top_p'=0.0: must lie in \(0, 1\]"),
    ("rollout.max_tokens=0", r"'rollout.max_tokens'=0: must be >= 1"),
    ("rollout.engine=sglang", r"'rollout.engine'='sglang': allowed: native, vllm"),
    ("rollout.vllm_args={enforce_eager: true}", r"'rollout.vllm_args'=\{'enforce_eager': True\}: only with engine"),
    ("rollout.num_engines=0", r"'rollout.num_engines'=0: must be >= 1"),
    ("rollout.dtype=float16", r"'rollout.dtype'='float16': allowed: auto, bfloat16, float32"),
    ("rollout.compile_decode=maybe", r"config key 'rollout.compile_decode'='maybe': allowed: auto, true, false"),
    ("policy.compile=sometimes", r"policy.compile='sometimes': allowed: auto, true, false"),
    ("policy.dtype=fp32", r"PolicyConfig.dtype='fp32': allowed: auto, bfloat16, float32"),
    ("parallel.dp=0", r"'parallel.dp'=0: must be >= 1"),
    ("parallel.ep=0", r"'parallel.ep'=0: must be >= 1"),
    ("parallel.pp=0", r"'parallel.pp'=0: must be >= 1"),
    ("parallel.schedule=zb", r"'parallel.schedule'='zb': allowed: 1f1b, gpipe, interleaved_1f1b"),
    ("algo.mini_batches=0", r"'algo.mini_batches'=0: must be >= 1"),
    ("algo.mini_batches=200", r"'algo.mini_batches'=200: must be <= the batch of .* = 128 sequences"),
    ("algo.ppo_epochs=0", r"'algo.ppo_epochs'=0: must be >= 1"),
    ("algo.advantage=ppo", r"'algo.advantage'='ppo': allowed: grpo, rloo, reinforce_pp"),
    ("algo.reward_timeout_s=0", r"'algo.reward_timeout_s'=0.0: must be a positive number of seconds"),
    ("rollout.group_size=1", r"'rollout.group_size'=1 with algo.advantage='grpo': .*no learning signal"),
    ("env.kwargs={max_operand: many}", r"config key 'env.kwargs.max_operand' must be int, got str 'many'"),
    ("env.kwargs={max_operands: 5}", r"environment 'arithmetic' \(env.kwargs\): got an unexpected keyword"),
    ("env.name=chess", r"'env.name'='chess': allowed: arithmetic, countdown, math, calculator"),
    ("env.eval_problems=-1", r"'env.eval_problems'=-1: must be >= 0"),
]


@pytest.mark.parametrize(("override", "pattern"), BAD_CONFIGS)
def test_config_ranges_are_checked_at_load(override, pattern, tmp_path, capsys):
    with pytest.raises(ConfigError, match=pattern):
        load_config(RunConfig, None, [override])
    assert main(["train", f"run_dir={tmp_path / 'run'}", override]) == 2  # refused before anything is written
    assert "moerl: error:" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_group_size_one_is_allowed_where_it_carries_signal():
    cfg = load_config(RunConfig, None, ["rollout.group_size=1", "algo.advantage=reinforce_pp"])
    assert cfg.rollout.group_size == 1
    assert load_config(RunConfig, None, ["env.kwargs={max_operand: 5}"]).env.kwargs == {"max_operand": 5}


@pytest.fixture
def two_steps(warm_model, tmp_path):
    """A full-mode run of 2 steps (checkpoint at step 2)."""
    run = tmp_path / "run"
    train(run_cfg(run, warm_model, "full", steps=2, **{"env.eval_problems": 4}))
    return run


def test_weights_made_non_finite_stop_the_run_and_the_good_checkpoint_stays(two_steps, warm_model, monkeypatch):
    """An optimizer step that leaves a weight non-finite (injected: AdamW runs, then one element overflows, as a
    step of a diverging run would) stops the run at once; the broken state is neither saved nor synced."""
    real = torch.optim.AdamW.step
    calls = {"n": 0}

    def overflowing(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    run = two_steps
    ckpt_before = tree_hash(run / "checkpoint")
    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)
    with pytest.raises(
        TrainingStopped, match=r"optimizer step 3 made weight '.*' non-finite.*nothing saved \(last good"
    ):
        train(
            run_cfg(run, warm_model, "full", steps=4, **{"env.eval_problems": 4, "policy.optim.lr": 1e-3}), resume=True
        )
    assert tree_hash(run / "checkpoint") == ckpt_before  # never overwritten by the broken state
    assert [r["step"] for r in metric_rows(run)] == [0, 1, 2]
    # the run continues from its last good checkpoint
    monkeypatch.setattr(torch.optim.AdamW, "step", real)
    train(run_cfg(run, warm_model, "full", steps=3, **{"env.eval_problems": 4}), resume=True)
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and math.isfinite(rows[3]["loss"])


def test_non_finite_logprobs_stop_the_run_after_saving_the_last_good_state(warm_model, tmp_path, monkeypatch):
    """Off-policy steps (two mini-batches) compute the old logprobs in a forward of their own: non-finite ones stop
    the run with the state after the last complete step saved."""
    from moerl.trainer import Policy

    run = tmp_path / "run"
    over = {"env.eval_problems": 4, "algo.mini_batches": 2}
    train(run_cfg(run, warm_model, "full", steps=2, **over))
    real = Policy.forward_logprobs
    calls = {"n": 0}

    def poisoned(self, batch, *args, **kwargs):
        lp, ent = real(self, batch, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:  # step 4's old-logprob forward (one per step; the R3-off metric only every 10 steps)
            lp = lp * float("nan")
        return lp, ent

    monkeypatch.setattr(Policy, "forward_logprobs", poisoned)
    cfg = run_cfg(run, warm_model, "full", steps=5, **over)
    cfg.train.checkpoint_every = 10
    with pytest.raises(TrainingStopped, match=r"step 4: the trainer's logprobs .* non-finite; checkpoint of the last"):
        train(cfg, resume=True)
    meta = json.loads((run / "checkpoint" / "checkpoint.json").read_text())
    assert meta["state"] == {"step": 3}  # step 3 trained and logged, saved on the way out
    assert [r["step"] for r in metric_rows(run)] == [0, 1, 2, 3]


def test_non_finite_weights_are_never_pushed_to_the_engine(warm_model):
    from moerl.engine import EngineConfig, LLMEngine
    from moerl.sync import sync_policy
    from moerl.trainer import Policy, PolicyConfig

    for mode in ("full", "lora"):
        policy = Policy(warm_model, PolicyConfig(mode=mode, dtype="float32"))
        engine = LLMEngine(warm_model, EngineConfig(max_num_seqs=2, max_model_len=16, max_loras=int(mode == "lora")))
        sync_policy(policy, engine, version=1)
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        name, t = next((n, t) for n, t in policy.trainable_state().items() if "lora" in n or mode == "full")
        t.view(-1)[0] = float("inf")
        with pytest.raises(
            TrainingStopped, match=r"tensor '.*' holds non-finite values; not pushed .* keeps version 1"
        ):
            sync_policy(policy, engine, version=2)
        assert engine.weight_version == 1
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items()), name


def _rollout(group: int, finish: str) -> Episode:
    return Episode(group, [1, 2], 1, [0, 1], [0.0, -1.0], None, 0.0, finish, "boom" if finish == "error" else None)


def test_groups_the_engine_failed_are_dropped_and_counted_and_all_failing_stops():
    kept, failed = drop_failed_groups([_rollout(0, "stop"), _rollout(1, "error"), _rollout(0, "length")], step=0)
    assert failed == 1 and [r.group for r in kept] == [0, 0]
    with pytest.raises(TrainingStopped, match=r"step 3: the engine failed every request \(2\); first: boom"):
        drop_failed_groups([_rollout(0, "error"), _rollout(1, "error")], step=2)


def test_a_hanging_or_raising_environment_step_ends_its_episode_and_the_run_goes_on(warm_model, tmp_path, monkeypatch):
    from hostile_env import HostileToolEnv

    from moerl.envs import ENVS

    monkeypatch.setitem(ENVS, "hostile_tool", HostileToolEnv)
    over = {
        "env.name": "hostile_tool",
        "env.kwargs": "{}",
        "env.eval_problems": 0,
        "algo.reward_timeout_s": 0.3,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
    }
    train(run_cfg(tmp_path / "run", warm_model, "lora", steps=1, **over))
    (row,) = [r for r in metric_rows(tmp_path / "run") if r["step"] == 1]
    assert row["reward_timeouts"] == 2 and row["reward_errors"] == 2 and row["reward_mean"] == 0.0
