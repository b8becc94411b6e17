"""The shipped examples: each says what it shows, loads, and learns from the model it starts from (a random tiny
model warmed up on the task by ``model.sft_steps``) in a few steps on the tiny preset."""

from pathlib import Path

import pytest
from run_helpers import metric_rows

from moerl.config import load_config
from moerl.envs import ENVS
from moerl.loop import train
from moerl.run_config import RunConfig
from moerl.warmup import warmed_base

EXAMPLES = Path(__file__).parent.parent / "examples"
# the in-process native-engine recipes; the others run one of these recipes with engines in processes, on vLLM or
# on Ray, and learn in those backends' own tests (test_process_engines, test_vllm, test_ray)
LEARNING = [
    "lora_arithmetic",
    "full_arithmetic",
    "mxfp8_arithmetic",
    "hybrid_arithmetic",
    "countdown_gspo",
    "calculator_tool",
    "math_cispo",
    "reasoning_gym",
]
# measured (AVX512-BF16 host, fp32), first three steps -> last three: lora 0.30 -> 0.50, full 0.26 -> 0.50, mxfp8
# 0.33 -> 0.63, hybrid 0.16 -> 0.27 (40 warm-up steps: after 120 it rose 0.71 -> 0.82 on one host, 0.78 -> 0.81 on
# an AMD EPYC, near the reward's ceiling), countdown 0.11 -> 0.21, calculator 0.67 -> 0.88, math 0.16 -> 0.27 (40
# warm-up steps: its prompts are long), reasoning_gym 0.16 -> 0.30 (AMD EPYC)
STEPS = 8


def test_every_example_says_first_what_it_shows_and_loads():
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert len(paths) >= 14
    for path in paths:
        assert path.read_text().startswith("# Shows: "), path.name
        cfg = load_config(RunConfig, path)
        assert cfg.model.path is not None or cfg.model.sft_steps > 0, f"{path.name} starts from a random model"


@pytest.fixture(scope="session")
def bases(tmp_path_factory):
    """One warm-up cache for the session: examples with the same recipe share their warmed model, as users' do."""
    return tmp_path_factory.mktemp("bases")


@pytest.mark.parametrize("name", LEARNING)
def test_the_example_learns_from_its_warmed_model(name, bases, tmp_path, monkeypatch, capsys):
    """The example as shipped (fp32 pinned: the same numbers on every host), training drawn from four fixed problems
    of its task so a rise is learning, not luck: the reward of the last three steps beats the first three's."""
    path = EXAMPLES / f"{name}.yaml"
    over = [f"run_dir={tmp_path}/run", f"model.base_cache={bases}", f"train.steps={STEPS}", "env.eval_problems=0"]
    over += ["policy.dtype=float32", "rollout.dtype=float32", "train.checkpoint_every=0", "train.eval_every=0"]
    cfg = load_config(RunConfig, path, over)
    env_cls = ENVS[cfg.env.name]
    env = env_cls(**cfg.env.kwargs)
    warmed_base(cfg, env)  # the warm-up sees the task's whole train split, before training is narrowed to four
    fixed = env.problems(4, seed=3)
    real = env_cls.problems
    monkeypatch.setattr(
        env_cls,
        "problems",
        lambda self, n, seed, split="train": (fixed * n)[:n] if split == "train" else real(self, n, seed, split),
    )
    train(cfg)
    rewards = [r["reward_generated"] for r in metric_rows(tmp_path / "run") if "reward_generated" in r]
    assert len(rewards) == STEPS
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards


def test_moerl_sft_writes_a_model_that_solves_what_the_random_one_cannot(tmp_path, capsys):
    """``moerl sft`` warms a random tiny model up; ``moerl eval`` of it on held-out problems beats the random model
    (which solves none); the command's errors name the option."""
    from moerl.cli import main
    from moerl.presets import init_model

    kwargs = '{"max_operand": 9, "ops": "+", "num_terms": 3, "test_fraction": 0.2}'
    assert main(["sft", str(tmp_path / "warm"), "--env-kwargs", kwargs, "--steps", "60"]) == 0
    assert f"model.path={tmp_path / 'warm'}" in capsys.readouterr().out
    init_model("qwen3_moe", "tiny", tmp_path / "random", seed=0)
    accuracy = {}
    for name in ("warm", "random"):
        argv = ["eval", str(tmp_path / name), "--env-kwargs", kwargs, "--problems", "50", "--dtype", "float32"]
        assert main(argv) == 0
        accuracy[name] = float(capsys.readouterr().out.split()[2].rstrip("%"))
    assert accuracy["random"] == 0.0 and accuracy["warm"] >= 10.0, accuracy
    for argv, message in [
        (["--steps", "0"], "--steps 0: must be >= 1"),
        (["--env-kwargs", '{"max_op": 3}'], "'max_op'"),
        (["--env", "chess"], "unknown environment 'chess'"),
    ]:
        assert main(["sft", str(tmp_path / "other"), *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["sft", str(tmp_path / "warm")]) == 2  # holds the checkpoint written above
    assert "is not empty; pass --overwrite" in capsys.readouterr().err


def test_a_warmed_base_is_built_once_per_recipe_and_refused_beside_a_checkpoint(tmp_path, monkeypatch):
    import moerl.warmup
    from moerl.envs import make_env
    from moerl.errors import ConfigError

    over = [f"model.base_cache={tmp_path}", "model.sft_steps=5", 'env.kwargs={"max_operand": 4, "ops": "+"}']
    cfg = load_config(RunConfig, None, over)
    env = make_env("arithmetic", **cfg.env.kwargs)
    first = warmed_base(cfg, env, log=lambda line: None)
    assert (first / "config.json").exists() and [p.name for p in tmp_path.iterdir()] == [first.name]

    def no_build(*args, **kwargs):
        raise AssertionError("the cached base was built again")

    monkeypatch.setattr(moerl.warmup, "warm_up", no_build)
    assert warmed_base(cfg, env) == first  # the same recipe: reused
    other = load_config(RunConfig, None, [*over, "model.sft_steps=6"])
    with pytest.raises(AssertionError, match="built again"):  # another recipe is another base
        warmed_base(other, env)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # the failed build left nothing behind
    for bad, message in [
        (["model.path=/some/ckpt"], "config key 'model.sft_steps'=5: warms up the random model"),
        (["model.sft_steps=-1"], "config key 'model.sft_steps'=-1: must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(RunConfig, None, [*over, *bad])
