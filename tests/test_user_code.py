"""The user's code named in a config: an environment class from a file outside the package, a dataset environment
with weighted reward functions from such a file, names installed packages register; what fails is named."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from run_helpers import metric_rows, run_cfg

from moerl.cli import main
from moerl.config import load_config
from moerl.envs import make_env
from moerl.envs.rewards import RewardFn, Scorer
from moerl.envs.user import load_code
from moerl.errors import ConfigError
from moerl.loop import train
from moerl.run_config import RunConfig

# the user's environment: sums of two digits 0..4 (the warmed model's task), four of them trained on, so a rise in
# reward is learning, not luck
TASKS = '''
import random
from dataclasses import dataclass

from moerl.envs import Problem


@dataclass
class Tally:  # the episode state of a multi-turn environment, a class of this file
    problem: Problem
    turns: int = 0


class SumEnv:
    name = "sums"

    def __init__(self, train_problems: int = 4):
        self.train_problems = train_problems

    def problems(self, n, seed, split="train"):
        pool = [(a, b) for a in range(5) for b in range(5)]
        pool = pool[: self.train_problems] if split == "train" else pool[self.train_problems :]
        rng = random.Random(f"{split}:{seed}")
        return [Problem(f"{a}+{b}=", a + b) for a, b in (rng.choice(pool) for _ in range(n))]

    def reward(self, problem, completion):
        head = completion.strip().split("\\n")[0]
        return 1.0 if head == str(problem.answer) else 0.0


class AskTwice(SumEnv):
    """Multi-turn: the first answer gets "again:" back, the second is scored."""

    name = "ask_twice"
    max_turns = 2

    def start(self, problem):
        return Tally(problem)

    def step(self, state, completion):
        state.turns += 1
        if state.turns == 1:
            return "again:", None
        return None, self.reward(state.problem, completion)


class Strings(SumEnv):
    def problems(self, n, seed, split="train"):
        return ["1+1="] * n


def not_a_class():
    return 3
'''

REWARDS = """
import time


def correct(completion, answer, **fields):
    head = completion.strip().split("\\n")[0]
    return 1.0 if head == str(answer) else 0.0


def brief(completion, **fields):
    return 1.0 if len(completion) <= 2 else 0.0


def fields_seen(completion, **fields):
    return float(len(fields))


def boom(completion, answer, **fields):
    if answer == 3:
        raise ValueError("the grader broke")
    return 1.0


def text(completion, **fields):
    return "good"


def hangs(completion, answer, **fields):
    if answer == 3:
        time.sleep(60)
    return 1.0


def only_completion(completion):
    return 1.0


def not_a_function():
    pass


not_a_function = 7
lam = lambda completion, **fields: 1.0  # noqa: E731
"""

RECORDS = [{"prompt": f"{a}+{b}=", "answer": a + b, "level": "easy"} for a, b in [(0, 1), (1, 2), (2, 2), (4, 1)]]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory outside the package with the user's files; the working directory, as a user's would be."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "my_tasks.py").write_text(TASKS)
    (d / "my_rewards.py").write_text(REWARDS)
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    monkeypatch.chdir(d)
    return d


def _rise(run_dir) -> tuple[list[float], bool]:
    rewards = [r["reward_mean"] for r in metric_rows(run_dir) if "reward_mean" in r]
    return rewards, sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


def test_training_with_an_environment_class_from_a_file_raises_the_reward(user_dir, warm_model, tmp_path):
    cfg = run_cfg(tmp_path / "run", warm_model, "full", steps=8, **{
        "env.name": "my_tasks.py:SumEnv", "env.kwargs": "{}", "policy.optim.lr": 1e-3, "rollout.prompts_per_step": 4,
    })  # fmt: skip
    train(cfg)
    rewards, rose = _rise(tmp_path / "run")
    assert len(rewards) == 8 and rose, rewards
    saved = load_config(RunConfig, tmp_path / "run" / "config.yaml")
    assert saved.env.name == "my_tasks.py:SumEnv"  # the config names the file, as the user wrote it


def test_a_dataset_environment_with_two_weighted_reward_functions_from_a_file_learns(user_dir, warm_model, tmp_path):
    rewards = "[{fn: my_rewards.py:correct, weight: 1.0}, {fn: my_rewards.py:brief, weight: 0.5}]"
    cfg = run_cfg(tmp_path / "run", warm_model, "full", steps=8, **{
        "env.name": "dataset", "env.kwargs": '{"path": "data.jsonl", "test_fraction": 0}', "env.rewards": rewards,
        "env.eval_problems": 0, "policy.optim.lr": 1e-3, "rollout.prompts_per_step": 4,
    })  # fmt: skip
    train(cfg)
    got, rose = _rise(tmp_path / "run")
    assert len(got) == 8 and rose, got
    assert max(got) <= 1.5 and max(got) > 1.0  # the weighted sum: both functions count, by their weights


def test_reward_functions_are_summed_by_weight_and_get_the_records_fields(user_dir):
    env = make_env("dataset", path="data.jsonl", test_fraction=0)
    problem = next(p for p in env.problems(8, seed=0) if p.answer == 3)
    assert problem.where == "data.jsonl:2" and problem.meta == {"level": "easy"}  # the path as the config has it
    fns = [RewardFn(s, load_code(f"my_rewards.py:{s}", "t"), w) for s, w in [("correct", 1.0), ("brief", 0.25)]]
    scorer = Scorer(env, fns, timeout_s=30)
    got = scorer.score([(problem, "3"), (problem, "4"), (problem, "3\nso")])
    assert got == [(1.25, None), (0.25, None), (1.0, None)]
    seen = Scorer(env, [RewardFn("f", load_code("my_rewards.py:fields_seen", "t"), 1.0)], timeout_s=30)
    assert seen.score([(problem, "3")]) == [(2.0, None)]  # answer and level: the record's fields besides its prompt


def test_a_reward_that_raises_returns_text_or_hangs_is_named_with_its_record_and_the_others_still_count(user_dir):
    env = make_env("dataset", path="data.jsonl", test_fraction=0)
    by_answer = {p.answer: p for p in env.problems(16, seed=0)}
    three, one = by_answer[3], by_answer[1]
    for fn, kind, said in [
        ("boom", "error", "raised ValueError: the grader broke: adds 0 of weight 1"),
        ("text", "error", "returned 'good', not a finite number: adds 0 of weight 1"),
        ("hangs", "timeout", "took longer than algo.reward_timeout_s=0.5 s: adds 0 of weight 1"),
    ]:
        fns = [RewardFn(f"my_rewards.py:{fn}", load_code(f"my_rewards.py:{fn}", "t"), 1.0)]
        fns.append(RewardFn("my_rewards.py:correct", load_code("my_rewards.py:correct", "t"), 0.5))
        scorer = Scorer(env, fns, timeout_s=0.5)
        got = scorer.score([(three, "3"), (one, "1"), (three, "3")])
        ok = 0.0 if fn == "text" else 1.0
        assert got == [(0.5, kind), (ok + 0.5, None if fn != "text" else kind), (0.5, kind)], fn
        (line,) = scorer.failures.take()  # the first failure is said; the second is counted
        assert line.startswith(f"moerl: reward my_rewards.py:{fn} on record data.jsonl:2 {said}")
        assert scorer.score([(three, "3")]) == [(0.5, kind)] and scorer.failures.take() == []


def test_a_run_whose_reward_function_fails_says_so_once_counts_it_and_goes_on(user_dir, warm_model, tmp_path, capsys):
    cfg = run_cfg(tmp_path / "run", warm_model, "lora", steps=2, **{
        "env.name": "dataset", "env.kwargs": '{"path": "data.jsonl", "test_fraction": 0}',
        "env.rewards": "[{fn: my_rewards.py:boom}, {fn: my_rewards.py:correct}]", "env.eval_problems": 0,
    })  # fmt: skip
    train(cfg)
    rows = [r for r in metric_rows(tmp_path / "run") if "reward_mean" in r]
    assert len(rows) == 2 and sum(r["reward_errors"] for r in rows) > 1
    err = capsys.readouterr().err
    assert err.count("moerl: reward my_rewards.py:boom on record ") == 1 and "raised ValueError" in err


def test_a_multi_turn_environment_from_a_file_keeps_its_own_state_class_through_the_worker(user_dir):
    from moerl.envs.base import env_step, safe_call

    env = make_env("my_tasks.py:AskTwice")
    problem = env.problems(1, seed=0)[0]
    state = env.start(problem)
    assert type(state).__module__.startswith("moerl_user_files.")
    kind, (message, reward, state) = safe_call(env_step, env, state, "x", timeout_s=30)
    assert (kind, message, reward, state.turns) == ("ok", "again:", None, 1)  # the file's class, pickled both ways
    kind, (message, reward, state) = safe_call(env_step, env, state, str(problem.answer), timeout_s=30)
    assert (message, reward, state.turns) == (None, 1.0, 2)


def test_an_environment_installed_packages_register_is_found_by_name(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "sum_tasks"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(TASKS)
    info = tmp_path / "site" / "sum_tasks-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sum-tasks\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[moerl.envs]\nsums = sum_tasks:SumEnv\nbroken = sum_tasks:Nope\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    env = make_env("sums", train_problems=2)
    assert type(env).__module__ == "sum_tasks" and {p.prompt for p in env.problems(20, seed=0)} == {"0+0=", "0+1="}
    assert load_config(RunConfig, None, ["env.name=sums"]).env.name == "sums"
    with pytest.raises(ConfigError, match=r"'broken': the environment sum-tasks registers as 'sum_tasks:Nope'"):
        make_env("broken")
    with pytest.raises(ConfigError, match=r"unknown environment 'chess'; .*entry points moerl\.envs: broken, sums\)"):
        make_env("chess")


@pytest.mark.parametrize(
    "over,message",
    [
        (["env.name=nowhere.py:SumEnv"], r"config key 'env.name'='nowhere.py:SumEnv': no such file .*nowhere\.py"),
        (["env.name=my_tasks.py:Nope"], r"my_tasks\.py has no 'Nope' \(it defines: AskTwice, Problem, Strings, SumEnv"),
        (["env.name=no_such_package.tasks:Env"], r"no module named 'no_such_package'"),
        (["env.name=:Env"], r"'env.name'=':Env': must be file\.py:Name or package\.module:Name"),
        (["env.name=my_tasks.py"], r"'env.name'='my_tasks.py': allowed: arithmetic, countdown"),
        (["env.name=my_tasks.py:SumEnv", 'env.kwargs={"size": 3}'], r"'my_tasks.py:SumEnv' \(env.kwargs\).*'size'"),
        (["env.name=dataset", 'env.kwargs={"path": "data.jsonl"}'], r"'env.rewards': environment 'dataset' has no"),
        (
            ["env.name=my_tasks.py:AskTwice", "env.rewards=[{fn: my_rewards.py:correct}]"],
            r"'env.rewards': environment 'my_tasks.py:AskTwice' scores its own episodes",
        ),
        (["env.rewards=[{fn: my_rewards.py:nope}]"], r"'env.rewards\[0\].fn'='my_rewards.py:nope': my_rewards\.py has"),
        (["env.rewards=[{fn: my_rewards.py:not_a_function}]"], r"'env.rewards\[0\].fn'=.*names a int, not a func"),
        (["env.rewards=[{fn: my_rewards.py:lam}]"], r"must be a function defined at the top level of its module"),
        (
            ["env.rewards=[{fn: my_rewards.py:correct, weight: .nan}]"],
            r"'env.rewards\[0\].weight'=nan: must be finite",
        ),
        (["env.reasoning_tags=[<think>]"], r"'env.reasoning_tags'=\['<think>'\]: must be \[open, close\]"),
    ],
)
def test_bad_user_code_in_a_config_is_named(user_dir, over, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, over)


def test_a_file_that_fails_to_load_is_named_with_its_line_and_can_be_fixed(user_dir):
    (user_dir / "broken.py").write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"loading .*broken\.py failed: RuntimeError: no GPU here \(line 2\)"):
        load_config(RunConfig, None, ["env.name=broken.py:Env"])
    (user_dir / "broken.py").write_text("class Env(\n")
    with pytest.raises(ConfigError, match=r"broken\.py failed: SyntaxError: .*\(line 1\)"):
        load_config(RunConfig, None, ["env.name=broken.py:Env"])
    (user_dir / "broken.py").write_text(TASKS.replace("SumEnv", "Env"))
    assert load_config(RunConfig, None, ["env.name=broken.py:Env"]).env.name == "broken.py:Env"


def test_what_the_users_environment_gives_wrongly_is_named_before_a_run_writes(user_dir, warm_model, tmp_path, capsys):
    """moerl train: one line naming the environment / function / record, exit status 2, nothing in the run dir."""
    data = user_dir / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": 2}) + "\n")
    base = [f"model.path={warm_model}", "train.steps=1", "env.eval_problems=0"]
    cases = [
        (["env.name=my_tasks.py:Strings"], "environment 'sums': problems(n=16, split='train') returned str '1+1='"),
        (["env.name=my_tasks.py:not_a_class"], "environment 'my_tasks.py:not_a_class' has no problems method"),
        (
            ["env.name=dataset", f"env.kwargs.path={data}", "env.rewards=[{fn: my_rewards.py:brief}]"],
            f"record {data}:1: its prompt is a list of chat messages; set env.chat.template: true",
        ),
        (
            ["env.name=dataset", "env.kwargs.path=data.jsonl", "env.rewards=[{fn: my_rewards.py:only_completion}]"],
            "config key 'env.rewards[0].fn'='my_rewards.py:only_completion': cannot be called with the completion and "
            "the fields of record data.jsonl:",
        ),
    ]
    for i, (over, message) in enumerate(cases):
        run = tmp_path / f"run{i}"
        assert main(["train", f"run_dir={run}", *base, *over]) == 2, over
        err = capsys.readouterr().err
        assert err.startswith(f"moerl: error: {message}") and err.count("\n") == 1, err
        assert not run.exists() or not any(run.iterdir())


def test_dataset_records_are_checked_by_file_and_line(tmp_path):
    from moerl.envs.dataset import DatasetEnv

    bad = tmp_path / "bad.jsonl"
    for lines, message in [
        ([{"prompt": "1+1="}, {"question": "x"}], r"bad\.jsonl:2: missing field 'prompt'"),
        ([{"prompt": ""}], r"bad\.jsonl:1: 'prompt' is empty"),
        ([{"prompt": [{"role": "robot", "content": "hi"}]}], r"bad\.jsonl:1: prompt\[0\] must be a message"),
        ([{"prompt": 7}], r"bad\.jsonl:1: 'prompt' must be text or a non-empty list of chat messages"),
    ]:
        bad.write_text("".join(json.dumps(r) + "\n" for r in lines))
        with pytest.raises(ConfigError, match=message):
            DatasetEnv(bad)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"q": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(40)))
    env = DatasetEnv(good, test_fraction=0.5, prompt_field="q")
    train_set = {p.prompt for p in env.problems(100, seed=0)}
    test_set = {p.prompt for p in env.problems(100, seed=0, split="test")}
    assert train_set and test_set and not train_set & test_set and len(train_set | test_set) == 40
    held = tmp_path / "held.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "3+1=", "answer": 4, "tags": ["x"]}]), held)
    env = DatasetEnv(good, test_path=held, prompt_field="q")
    assert {p.prompt for p in env.problems(100, seed=0)} == {f"{i}+1=" for i in range(40)} - {"3+1="}
    (test,) = {p.prompt: p for p in env.problems(3, seed=0, split="test")}.values()
    assert (test.answer, test.meta, test.where) == (4, {"tags": ["x"]}, f"{held}: row 1")


def test_a_random_model_warms_up_on_the_users_environment_and_an_edited_file_is_another_recipe(user_dir, tmp_path):
    from moerl.warmup import warmed_base

    (user_dir / "taught.py").write_text(
        TASKS + "\n\nclass Taught(SumEnv):\n    def sft_examples(self, n, seed):\n"
        "        return [(p.prompt, str(p.answer)) for p in self.problems(n, seed)]\n"
    )
    over = [f"model.base_cache={tmp_path / 'bases'}", "model.sft_steps=2", "env.name=taught.py:Taught"]
    cfg = load_config(RunConfig, None, over)
    first = warmed_base(cfg, make_env("taught.py:Taught"), log=lambda line: None)
    assert first.parent == tmp_path / "bases" and "taught.py_Taught" in first.name and (first / "config.json").exists()
    assert warmed_base(cfg, make_env("taught.py:Taught")) == first  # the same file: the same recipe
    (user_dir / "taught.py").write_text((user_dir / "taught.py").read_text().replace("range(5)", "range(4)"))
    again = warmed_base(cfg, make_env("taught.py:Taught"), log=lambda line: None)
    assert again != first and again.parent == first.parent


def test_moerl_eval_and_sft_take_an_environment_by_path(user_dir, warm_model, tmp_path, capsys):
    assert main(["eval", str(warm_model), "--env", "my_tasks.py:SumEnv", "--problems", "8", "--dtype", "float32"]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert main(["sft", str(tmp_path / "out"), "--env", "my_tasks.py:SumEnv", "--steps", "1"]) == 2
    assert "environment 'sums' has no worked examples (sft_examples)" in capsys.readouterr().err
    data = user_dir / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}]}) + "\n")
    kwargs = json.dumps({"path": str(data), "test_fraction": 0.99})
    assert main(["eval", str(warm_model), "--env", "dataset", "--env-kwargs", kwargs, "--problems", "1"]) == 2
    assert f"record {data}:1: its prompt is a list of chat messages; moerl eval takes text" in capsys.readouterr().err
