"""The RL loop end to end: every mode learns an easy task, resume continues with the same numbers, configs."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from run_helpers import EASY, metric_rows, run_cfg

from moerl.cli import main
from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.loop import RunConfig, train
from moerl.rollout.episode import Episode, drop_stale, keep_informative, to_batch
from moerl.trainer.losses import PolicyLossConfig

# (mode, learning rate, extra overrides, required rise): measured on this machine, fp32, seeded, deterministic:
# full 0.62 -> 0.89, mxfp8 0.63 -> 0.86 (first 3 steps -> last 5), lora 0.65 -> 0.76 (first 3 -> second half)
MODES = [
    ("full", 1e-3, {}, 0.15),
    ("mxfp8", 1e-3, {}, 0.15),
    ("lora", 3e-3, {"algo.ppo_epochs": 2, "algo.mini_batches": 2}, 0.06),
]


@pytest.mark.parametrize(("mode", "lr", "extra", "rise"), MODES)
def test_each_mode_raises_the_mean_reward(mode, lr, extra, rise, warm_model, four_problems, tmp_path):
    cfg = run_cfg(
        tmp_path / mode, warm_model, mode, steps=15, **{"policy.optim.lr": lr, "rollout.prompts_per_step": 4, **extra}
    )
    train(cfg)
    rows = [r for r in metric_rows(tmp_path / mode) if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == 15
    first = sum(rewards[:3]) / 3
    late = rewards[-5:] if mode != "lora" else rewards[7:]
    assert sum(late) / len(late) > first + rise, rewards
    assert rows[0]["mismatch_k3_r3"] is not None and rows[0]["weight_version"] == 1.0
    assert rows[-1]["mismatch_k3_r3"] < 1e-3  # engine and trainer agree on the synced weights
    assert (tmp_path / mode / "curves.png").exists() and (tmp_path / mode / "checkpoint" / "checkpoint.json").exists()
    assert (tmp_path / mode / "config.yaml").exists()
    if mode == "lora":
        assert (tmp_path / mode / "adapter" / "adapter_config.json").exists()


def test_resume_continues_with_the_same_numbers(warm_model, tmp_path):
    keys = ("reward_mean", "loss", "grad_norm", "mismatch_k3_r3", "lr")
    full = train(run_cfg(tmp_path / "a", warm_model, "lora", steps=4))  # checkpoints after steps 2 and 4
    assert full["accuracy_after"] >= 0
    straight = {r["step"]: r for r in metric_rows(tmp_path / "a") if "loss" in r}
    # the same run killed after step 2: its checkpoint is what step 2 left behind
    train(run_cfg(tmp_path / "b", warm_model, "lora", steps=2))
    shutil.copytree(tmp_path / "b" / "checkpoint", tmp_path / "b" / "kept")
    train(run_cfg(tmp_path / "b", warm_model, "lora", steps=4), resume=True)
    resumed = {r["step"]: r for r in metric_rows(tmp_path / "b") if "loss" in r}
    for step in (3, 4):
        for k in keys:
            assert resumed[step][k] == straight[step][k], (step, k)


def test_dynamic_sampling_and_overlong_filter(warm_model, tmp_path):
    cfg = run_cfg(
        tmp_path / "dapo",
        warm_model,
        "lora",
        steps=2,
        **{"algo.dynamic_sampling": "true", "algo.overlong_filter": "true", "algo.advantage": "rloo"},
    )
    train(cfg)
    rows = [r for r in metric_rows(tmp_path / "dapo") if "loss" in r]
    assert all("dropped_groups" in r for r in rows)


def test_keep_informative_and_build_batch():
    def ro(group, reward, finish="stop", version=0):
        return Episode(
            group,
            [1, 2, 3, 4],
            2,
            [0, 0, 1, 1],
            [0.0, 0.0, -0.5, -0.25],
            torch.zeros(3, 2, 2, dtype=torch.uint8),
            reward,
            finish,
            None,
            version,
        )

    rollouts = [ro(0, 1.0), ro(0, 1.0), ro(1, 0.0), ro(1, 1.0, "length")]
    kept, dropped = keep_informative(rollouts)
    assert dropped == 1 and [r.group for r in kept] == [1, 1]
    batch = to_batch(kept, r3=True, overlong_filter=True)
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert batch.extras["rollout_logprobs"][0].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert batch.replay.shape == (2, 3, 2, 2)
    # a completion the context window cut is filtered as one max_tokens cut: the filter's control keeps both
    window = [ro(1, 0.0), ro(1, 1.0, "context")]
    assert to_batch(window, r3=True, overlong_filter=True).loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert to_batch(window, r3=True, overlong_filter=False).loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    # asynchronous RL's bound: at trainer version 5 with max_staleness 2, a group with a sample of version 2 goes whole
    mixed = [ro(0, 1.0, version=3), ro(0, 0.0, version=2), ro(1, 1.0, version=4), ro(1, 0.0, version=3)]
    kept, dropped = drop_stale(mixed, version=5, max_staleness=2)
    assert dropped == 2 and [(e.group, e.version) for e in kept] == [(1, 4), (1, 3)]
    assert drop_stale(mixed, version=5, max_staleness=3) == (mixed, 0)


def test_build_batch_pads_sequences_of_different_lengths():
    """Episodes of 3, 6 and 4 tokens (one without routing, one cut by max_tokens): each row right-padded, field by
    field as written out here, routing -1 past each sequence and for the one without; routing for the wrong number
    of tokens is a named error."""
    torch.manual_seed(0)
    lens, finish = [3, 6, 4], ["stop", "length", "stop"]
    eps = []
    for i, n in enumerate(lens):
        routed = None if i == 2 else torch.randint(0, 8, (n - 1, 2, 2), dtype=torch.uint8)
        tokens, lp = list(range(10 * i, 10 * i + n)), [-0.1 * (j + 1) for j in range(n)]
        eps.append(Episode(i, tokens, 1, [0] + [1] * (n - 1), lp, routed, 0.0, finish[i], None, 0))
    for overlong in (True, False):
        batch = to_batch(eps, r3=True, overlong_filter=overlong)
        assert batch.input_ids.shape == batch.loss_mask.shape == (3, 6) and batch.replay.shape == (3, 5, 2, 2)
        for i, (e, n) in enumerate(zip(eps, lens, strict=True)):
            assert batch.input_ids[i].tolist() == e.tokens + [0] * (6 - n)
            assert batch.attention_mask[i].tolist() == [1] * n + [0] * (6 - n)
            cut = overlong and e.finish_reason == "length"
            assert batch.loss_mask[i].tolist() == ([0] * 6 if cut else e.loss_mask + [0] * (6 - n))
            want_lp = torch.tensor(e.rollout_logprobs + [0.0] * (6 - n))
            assert torch.equal(batch.extras["rollout_logprobs"][i], want_lp)
            want = torch.full((5, 2, 2), -1, dtype=torch.long)
            if e.routed is not None:
                want[: n - 1] = e.routed.long()
            assert torch.equal(batch.replay[i], want)
    eps[1].routed = eps[1].routed[:3]
    with pytest.raises(ValueError, match="episode 1: routing for 3 tokens, 5 expected"):
        to_batch(eps, r3=True, overlong_filter=True)


def test_config_files_overrides_and_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_dir: runs/x\npolicy:\n  mode: full\n  optim:\n    lr: 0.001\nalgo:\n  loss:\n    kind: gspo\n")
    cfg = load_config(RunConfig, path, ["policy.optim.lr=2e-4", "rollout.group_size=4", "algo.loss.clip_high=0.28"])
    assert cfg.policy.mode == "full" and cfg.policy.optim.lr == 2e-4 and cfg.rollout.group_size == 4
    assert isinstance(cfg.algo.loss, PolicyLossConfig) and cfg.algo.loss.kind == "gspo"
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.group_sise'; did you mean rollout.group_size"):
        load_config(RunConfig, None, ["rollout.group_sise=4"])
    with pytest.raises(ConfigError, match=r"config key 'train.steps' must be int, got str 'many'"):
        load_config(RunConfig, None, ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"PolicyConfig.mode='qlora': allowed"):
        load_config(RunConfig, None, ["policy.mode=qlora"])
    with pytest.raises(ConfigError, match=r"config file '.*nope.yaml' does not exist"):
        load_config(RunConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"override 'steps' must look like key.sub=value"):
        load_config(RunConfig, None, ["steps"])


def test_cli_train_and_plot(warm_model, tmp_path, capsys):
    run = tmp_path / "cli"
    args = [
        f"run_dir={run}",
        f"model.path={warm_model}",
        "train.steps=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_tokens=2",
        "env.eval_problems=4",
        "policy.dtype=float32",
    ]
    assert main(["train", *args]) == 0
    assert "accuracy_after=" in capsys.readouterr().out
    assert (run / "config.yaml").read_text().count("prompts_per_step: 2") == 1
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert main(["train", "rollout.group_sise=2"]) == 2


def test_every_example_config_loads():
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
    assert len(examples) >= 6
    modes, envs = set(), set()
    for path in examples:
        cfg = load_config(RunConfig, path)
        modes.add(cfg.policy.mode)
        envs.add(cfg.env.name)
    assert modes == {"lora", "full", "mxfp8"}
    assert envs == {"arithmetic", "countdown", "math", "calculator", "reasoning_gym"}


def test_reward_errors_and_timeouts_score_zero_are_counted_and_the_run_goes_on(warm_model, tmp_path, monkeypatch):
    from hostile_env import HostileEnv

    from moerl.envs import ENVS

    monkeypatch.setitem(ENVS, "hostile", HostileEnv)
    cfg = run_cfg(
        tmp_path / "hostile",
        warm_model,
        "lora",
        steps=2,
        **{"env.name": "hostile", "algo.reward_timeout_s": 0.3, "env.eval_problems": 0},
    )
    train(cfg)
    rows = [r for r in metric_rows(tmp_path / "hostile") if "reward_mean" in r]
    assert len(rows) == 2  # both steps ran
    assert sum(r["reward_errors"] for r in rows) > 0 and sum(r["reward_timeouts"] for r in rows) > 0


def test_on_policy_steps_take_the_old_logprobs_from_the_training_forward(warm_model, tmp_path, monkeypatch):
    """One epoch, one mini-batch: no forward for the old logprobs (the ratio is 1 exactly, the engine-vs-trainer
    mismatch comes from the training forward and is small after syncs), and the R3-off metric's forward runs every
    ``algo.mismatch_metric_every`` steps only; a step at rollout temperature 0.7 gives the same mismatch (logprobs
    at the engine's temperature on both sides)."""
    from moerl.trainer import Policy

    real, calls = Policy.forward_logprobs, []

    def counted(self, batch, *args, **kwargs):
        calls.append(kwargs.get("replay", True))
        return real(self, batch, *args, **kwargs)

    monkeypatch.setattr(Policy, "forward_logprobs", counted)
    for temperature in (1.0, 0.7):
        calls.clear()
        run = tmp_path / f"t{temperature}"
        over = {"algo.mismatch_metric_every": 2, "env.eval_problems": 0, "rollout.temperature": temperature}
        train(run_cfg(run, warm_model, "full", steps=4, **over))
        rows = [r for r in metric_rows(run) if "loss" in r]
        assert calls == [False, False]  # steps 1 and 3: the R3-off metric; nothing else
        assert [("mismatch_k3_no_r3" in r) for r in rows] == [True, False, True, False]
        assert all(r["ratio_mean"] == 1.0 for r in rows)
        assert all(r["mismatch_k3_r3"] < 1e-3 for r in rows), [r["mismatch_k3_r3"] for r in rows]
    with pytest.raises(ConfigError, match=r"'algo.mismatch_metric_every'=-1: must be >= 0"):
        run_cfg(tmp_path / "x", warm_model, **{"algo.mismatch_metric_every": -1})


def test_a_deterministic_run_computes_what_the_default_run_does_on_the_cpu(warm_model, tmp_path, monkeypatch):
    # train.deterministic turns torch's deterministic algorithms on for the run (what bit-exact reruns on CUDA need);
    # the CPU kernels already are: the same numbers, and the process's setting is back after the run
    import moerl.loop

    keys = ("reward_mean", "loss", "grad_norm", "mismatch_k3_r3")
    train(run_cfg(tmp_path / "default", warm_model, "full", steps=2))
    seen, step = [], moerl.loop.rl_step

    def watched(*args, **kwargs):  # the step itself, noting the setting it runs under
        seen.append(torch.are_deterministic_algorithms_enabled())
        return step(*args, **kwargs)

    monkeypatch.setattr(moerl.loop, "rl_step", watched)
    train(run_cfg(tmp_path / "det", warm_model, "full", steps=2, **{"train.deterministic": "true"}))
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()
    default = [r for r in metric_rows(tmp_path / "default") if "loss" in r]
    det = [r for r in metric_rows(tmp_path / "det") if "loss" in r]
    assert [[r[k] for k in keys] for r in det] == [[r[k] for k in keys] for r in default]


def test_a_run_writes_a_progress_line_per_step_when_not_on_a_terminal(warm_model, tmp_path, capsys):
    """Output to a file or pipe (pytest's capture is one): one readable line per step with the step, reward, s/step
    and time left, the held-out accuracy where evaluated, and the final phase said in words."""
    train(run_cfg(tmp_path / "run", warm_model, "lora", steps=3, **{"train.eval_every": 2}))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("moerl: ")]
    steps = [x for x in lines if x.startswith("moerl: step ")]
    assert [x.split()[2] for x in steps] == ["1/3", "2/3", "3/3"]
    assert all(" reward " in x and " s/step, " in x and "s left" in x for x in steps)
    assert "held-out accuracy" in steps[1] and "held-out accuracy" in steps[2] and "held-out" not in steps[0]
    # the accuracy with its interval and the number of distinct problems (the run's env.eval_problems)
    assert re.search(r"held-out accuracy \d+\.\d% \(95% CI \d+\.\d%-\d+\.\d%, \d+ problems\)", steps[2])
    assert lines[0].startswith("moerl: held-out accuracy before training: ")
    assert "moerl: final evaluation on the held-out problems" in lines
    assert lines[-2] == "moerl: training done; exporting the results and drawing the curves"
    assert (
        lines[-1]
        == f"moerl: wrote the trained LoRA adapter (PEFT: peft loads it onto the base) to {tmp_path}/run/adapter"
    )


def test_ctrl_c_saves_the_last_complete_step_and_the_run_resumes_from_it(warm_model, tmp_path, capsys, monkeypatch):
    """Ctrl-C during step 3 of a run that checkpoints every 2 steps: the state after step 2 is saved (it says where),
    and --resume goes on with step 3 as the uninterrupted run did (same loss and reward)."""
    from moerl import loop

    train(run_cfg(tmp_path / "a", warm_model, steps=3))
    straight = {r["step"]: r for r in metric_rows(tmp_path / "a") if "loss" in r}
    real = loop.rl_step

    def interrupted(cfg, gen, policy, loss_fn, step, ahead=None):
        if step == 2:
            raise KeyboardInterrupt
        return real(cfg, gen, policy, loss_fn, step, ahead)

    monkeypatch.setattr(loop, "rl_step", interrupted)
    cfg = run_cfg(tmp_path / "b", warm_model, steps=3, **{"train.checkpoint_every": 0})  # no periodic checkpoint
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    err = capsys.readouterr().err
    assert "moerl: interrupted after step 2" in err
    assert f"checkpoint of the last good state saved to {tmp_path / 'b' / 'checkpoint'}; continue with --resume" in err
    monkeypatch.setattr(loop, "rl_step", real)
    train(cfg, resume=True)
    resumed = {r["step"]: r for r in metric_rows(tmp_path / "b") if "loss" in r}
    assert resumed[3]["loss"] == straight[3]["loss"] and resumed[3]["reward_mean"] == straight[3]["reward_mean"]


def test_a_second_ctrl_c_stops_the_save_and_the_last_checkpoint_stays(warm_model, tmp_path, capsys, monkeypatch):
    """Ctrl-C during step 3 (checkpoints every 2 steps), then Ctrl-C again while the state is being written (its
    tensors are on disk, its metadata not): the save stops saying so, the step-2 checkpoint is intact, and --resume
    continues from step 2 as the uninterrupted run did."""
    from moerl import loop
    from moerl.trainer import checkpoint

    train(run_cfg(tmp_path / "a", warm_model, steps=4))
    straight = {r["step"]: r for r in metric_rows(tmp_path / "a") if "loss" in r}
    real = loop.rl_step

    def interrupted(cfg, gen, policy, loss_fn, step, ahead=None):
        if step == 2:
            monkeypatch.setattr(checkpoint, "_crash_point", second_ctrl_c)  # the stop save is interrupted too
            raise KeyboardInterrupt
        return real(cfg, gen, policy, loss_fn, step, ahead)

    def second_ctrl_c(name):
        if name == "tensors written":
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "rl_step", interrupted)
    cfg = run_cfg(tmp_path / "b", warm_model, steps=4)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    err = capsys.readouterr().err
    assert "moerl: interrupted after step 2; saving it (Ctrl-C again: stop the save" in err
    assert (
        f"moerl: save stopped by a second Ctrl-C; the last checkpoint ({tmp_path / 'b' / 'checkpoint'}) is kept" in err
    )
    assert json.loads((tmp_path / "b" / "checkpoint" / "checkpoint.json").read_text())["state"]["step"] == 2
    monkeypatch.setattr(loop, "rl_step", real)
    monkeypatch.setattr(checkpoint, "_crash_point", lambda name: None)
    train(cfg, resume=True)
    resumed = {r["step"]: r for r in metric_rows(tmp_path / "b") if "loss" in r}
    assert [resumed[s]["loss"] for s in (3, 4)] == [straight[s]["loss"] for s in (3, 4)]


def test_a_run_that_learns_nothing_for_three_steps_says_why(tmp_path, capsys):
    """A random model on two-digit sums gets every sample wrong: after three such steps the run warns, naming the
    cause (every sample wrong) and the fix (a warmed model); the warm model's run, whose groups differ, does not."""
    from moerl.console import FLAT_STEPS, flat_warning

    hard = json.dumps({"max_operand": 99, "ops": "+"})
    cfg = run_cfg(tmp_path / "run", None, "full", steps=FLAT_STEPS, **{"env.kwargs": hard, "model.path": "null"})
    train(cfg)
    err = capsys.readouterr().err
    rows = [r for r in metric_rows(tmp_path / "run") if "informative_groups" in r]
    assert [r["informative_groups"] for r in rows] == [0.0] * FLAT_STEPS and rows[-1]["reward_generated"] == 0.0
    warnings = [x for x in err.splitlines() if x.startswith("moerl: warning: ")]
    assert warnings == [flat_warning(FLAT_STEPS, 0.0)]
    assert f"steps 1-{FLAT_STEPS} learned nothing" in warnings[0] and "every sample was wrong" in warnings[0]
    assert "model.sft_steps" in warnings[0]
    assert "too easy" in flat_warning(5, 1.0) and "mean reward 0.500" in flat_warning(5, 0.5)


def test_library_log_lines_go_to_the_runs_file_and_everything_is_restored(tmp_path):
    """In a fresh process (pytest's own log handlers would hide the console behaviour): a library's warning
    (torchao's 'Failed to load ...' is one) while a run lasts goes to its libraries.log, not the console; vLLM
    processes get a logging config naming that file; afterwards the same warning reaches stderr again (control) and
    the environment is as it was."""

    script = f"""
import json, logging, os
from pathlib import Path
from moerl.logs import library_logs
with library_logs({str(tmp_path)!r}) as path:
    logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so: not needed here")
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
print(config["handlers"]["file"]["filename"], "vllm" in config["loggers"], os.environ.get("VLLM_LOGGING_CONFIG_PATH"))
logging.getLogger("torchao").warning("after the run")
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_CONFIG_PATH"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "after the run\n"  # the warning inside the run is not there; the one after it is
    log = tmp_path / "libraries.log"
    assert " torchao WARNING Failed to load _C_mxfp8.so" in log.read_text()
    assert out.stdout.split() == [str(log.resolve()), "True", "None"]


def test_held_library_lines_reach_the_run_directory_or_else_their_own_handlers(tmp_path):
    """A Ray run's driver: its library's lines are held, then appended to the run's libraries.log when the run made
    its directory; when it did not (refused before), they go to the library's own handler after all, none lost."""
    import logging

    from moerl.logs import held_lines

    seen = []

    class Own(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lib = logging.getLogger("moerl-test-library")
    lib.handlers, lib.propagate = [Own()], False
    with held_lines("moerl-test-library", tmp_path / "run"):
        lib.warning("token authentication is enabled")
        (tmp_path / "run").mkdir()  # the run opened its directory meanwhile
    assert (
        seen == []
        and " moerl-test-library WARNING token authentication" in (tmp_path / "run" / "libraries.log").read_text()
    )
    with held_lines("moerl-test-library", tmp_path / "refused"):
        lib.warning("no directory")
    assert seen == ["no directory"] and not (tmp_path / "refused").exists() and isinstance(lib.handlers[0], Own)


def test_a_context_window_too_short_for_max_tokens_is_said_once_and_its_cuts_counted(warm_model, tmp_path, capfd):
    """rollout.max_model_len one token past a prompt of the task: the run says once, before it starts, how much room
    the longest prompt it sampled leaves of rollout.max_tokens; each step's metrics count the completions cut, at the
    context window too. A window no prompt fits is refused before the run writes anything."""
    from moerl.bridges.checkpoint import load_tokenizer
    from moerl.envs import make_env

    prompt = make_env("arithmetic", **EASY).problems(1, seed=0)[0].prompt
    length = len(load_tokenizer(warm_model)(prompt)["input_ids"])
    over = {"rollout.max_model_len": length + 1, "algo.overlong_filter": "true", "env.eval_problems": 0}
    train(run_cfg(tmp_path / "short", warm_model, "lora", steps=2, **over))
    err = capfd.readouterr().err
    said = re.findall(
        r"moerl: rollout.max_model_len=(\d+) leaves the longest of \d+ prompts sampled \((\d+) tokens\) room for "
        r"(\d+) of rollout.max_tokens=3: completions that reach it are cut at the context window",
        err,
    )
    assert len(said) == 1, err[-2000:]
    window, longest, room = map(int, said[0])
    assert window == length + 1 and longest >= length and room == window - longest
    rows = [r for r in metric_rows(tmp_path / "short") if "samples" in r]
    assert rows and all(r["context_cut_frac"] > 0 and r["cut_frac"] >= r["context_cut_frac"] for r in rows)
    assert all(r["context_cut_frac"] <= 1.0 for r in rows)
    # the window the longest prompt fills leaves no room: refused before the run's records are written
    with pytest.raises(ConfigError, match=rf"'rollout.max_model_len'={longest}: .* run to {longest} tokens"):
        train(run_cfg(tmp_path / "none", warm_model, "lora", steps=2, **(over | {"rollout.max_model_len": longest})))
    assert not (tmp_path / "none" / "metrics.jsonl").exists()
