"""reasoning-gym by name: its tasks and their own configs, a weighted mix, scored by reasoning-gym's own scorers (the
oracle), train and test apart; what is wrong in the config is named. (The example learns: tests/test_examples.py.)"""

import sys
from collections import Counter

import pytest
import reasoning_gym

from moerl.config import load_config
from moerl.envs import ReasoningGymEnv, make_env, safe_reward
from moerl.errors import ConfigError
from moerl.run_config import RunConfig

SUMS = {"min_terms": 3, "max_terms": 3, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}
MIX = [
    {"name": "basic_arithmetic", "weight": 3, "config": SUMS},
    {"name": "chain_sum", "weight": 1, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
]


def test_a_weighted_mix_of_tasks_with_their_own_configs():
    env = make_env("reasoning_gym", tasks=MIX, test_size=50)
    problems = env.problems(400, seed=0)
    sources = Counter(p.meta["entry"]["metadata"]["source_dataset"] for p in problems)
    assert set(sources) == {"basic_arithmetic", "chain_sum"} and 0.65 < sources["basic_arithmetic"] / 400 < 0.85
    for p in problems:
        meta = p.meta["entry"]["metadata"]
        if meta["source_dataset"] == "basic_arithmetic":  # the task's own config reached its items
            assert meta["num_terms"] == 3 and p.prompt.startswith("Calculate ") and "-" not in p.prompt
        assert p.answer == p.meta["entry"]["answer"] and p.prompt == p.meta["entry"]["question"]
    one = make_env("reasoning_gym", tasks="spell_backward")
    assert {p.meta["entry"]["metadata"]["source_dataset"] for p in one.problems(20, seed=0)} == {"spell_backward"}


def test_train_and_test_are_apart_and_each_is_deterministic():
    env = ReasoningGymEnv(MIX, test_size=100)
    test = {p.prompt for p in env.problems(400, seed=0, split="test")}
    train = [p.prompt for p in env.problems(2000, seed=0)]
    assert len(test) > 40 and len(set(train)) > 150 and not test & set(train)
    assert [p.prompt for p in env.problems(30, seed=1)] == [
        p.prompt for p in ReasoningGymEnv(MIX, 0, 100_000, 100).problems(30, seed=1)
    ]
    assert env.problems(30, seed=1) != env.problems(30, seed=2)
    other = ReasoningGymEnv(MIX, seed=7, test_size=100)  # another dataset seed: other items
    assert [p.prompt for p in other.problems(30, seed=1)] != [p.prompt for p in env.problems(30, seed=1)]
    with pytest.raises(ConfigError, match="could not draw 5 train problems that are not test problems"):
        tiny = [{"name": "chain_sum", "config": {"min_terms": 1, "max_terms": 1, "max_digits": 1}}]
        ReasoningGymEnv(tiny, test_size=500).problems(5, seed=0)  # ten questions, all of them test ones


@pytest.mark.parametrize("tag", [None, "answer"])
def test_the_reward_is_reasoning_gyms_own_score_of_the_answer(tag):
    env = ReasoningGymEnv(MIX + [{"name": "spell_backward"}], test_size=20, answer_tag=tag)
    for p in env.problems(30, seed=0):
        entry = p.meta["entry"]
        score = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])  # the oracle
        right = str(p.answer) if tag is None else f"<think>add</think><answer>{p.answer}</answer>"
        assert env.reward(p, right) == score(str(p.answer), entry) == 1.0
        wrong = f"{p.answer}7" if tag is None else f"<answer>{p.answer}7</answer>"
        assert env.reward(p, wrong) == score(f"{p.answer}7", entry)  # whatever the task's scorer makes of it
        assert entry["metadata"]["source_dataset"] == "spell_backward" or env.reward(p, wrong) < 1.0
        if tag is None:
            assert env.reward(p, f"{p.answer}\nand more") == 1.0  # read to its first line
        else:
            assert env.reward(p, str(p.answer)) == score(None, entry) == 0.0  # no tags: no answer
    problem = env.problems(1, seed=0)[0]
    right = str(problem.answer) if tag is None else f"<answer>{problem.answer}</answer>"
    assert safe_reward(env.reward, problem, right, timeout_s=60) == (1.0, None)  # the worker rebuilds it by config
    assert env.sft_examples(2, seed=0)[0] == (problem.prompt, right)


@pytest.mark.parametrize(
    "tasks,message",
    [
        (
            "basic_arithmetc",
            r"'env.kwargs.tasks': reasoning-gym has no task 'basic_arithmetc'; did you mean basic_arith",
        ),
        ([], r"'env.kwargs.tasks': must be a task name or a non-empty list"),
        (
            [{"name": "chain_sum", "wieght": 2}],
            r"'env.kwargs.tasks\[0\]': must be a task name or \{name, weight, config\}",
        ),
        ([{"name": "chain_sum", "weight": 0}], r"'env.kwargs.tasks\[0\].weight'=0: must be a number > 0"),
        (
            [{"name": "chain_sum", "config": {"max_termz": 2}}],
            r"'env.kwargs.tasks\[0\].config'=.*chain_sum refuses it: TypeError",
        ),
        (
            [{"name": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}],
            r"chain_sum refuses it: AssertionError: max_terms",
        ),
        ([{"name": "chain_sum", "config": {"seed": 3}}], r"without seed or size \(moerl sets them"),
        (["chain_sum", "chain_sum"], r"'env.kwargs.tasks\[1\]': task 'chain_sum' is named twice"),
    ],
)
def test_what_is_wrong_in_the_tasks_is_named(tasks, message):
    with pytest.raises(ConfigError, match=message):
        ReasoningGymEnv(tasks)


def test_the_config_names_it_and_a_missing_package_is_named(monkeypatch):
    cfg = load_config(RunConfig, None, ["env.name=reasoning_gym", "env.kwargs={tasks: chain_sum, test_size: 10}"])
    assert cfg.env.kwargs == {"tasks": "chain_sum", "test_size": 10}
    with pytest.raises(ConfigError, match=r"'reasoning_gym' \(env.kwargs\): missing a required argument: 'tasks'"):
        load_config(RunConfig, None, ["env.name=reasoning_gym", "env.kwargs={task: chain_sum}"])
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package: pip install 'moerl\[reasoning-gym\]'"):
        make_env("reasoning_gym", tasks="chain_sum")
