"""Environments: deterministic disjoint splits, rewards, the bounded evaluator against hostile text, safe_reward."""

import json
import math
import os
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moerl.envs import (
    ArithmeticEnv,
    CalculatorToolEnv,
    CountdownEnv,
    Environment,
    ExprError,
    MathEnv,
    MultiTurnEnvironment,
    Problem,
    evaluate,
    make_env,
    safe_reward,
    safe_rewards,
)
from moerl.errors import ConfigError

GENERATED = {"arithmetic": ArithmeticEnv, "countdown": CountdownEnv, "calculator": CalculatorToolEnv}


def _boom(x: int) -> float:
    raise RuntimeError(f"reward failed on {x}")


def _spin() -> float:
    while True:
        pass


def _by_kind(x) -> float:
    """A reward that returns, sleeps past any limit, kills its process or raises, by its input."""
    if x == "sleep":
        time.sleep(30)
    if x == "exit":
        os._exit(3)
    if x == "boom":
        raise RuntimeError("boom")
    return abs(x)


def _nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


# ---- splits and determinism ----


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_problems_deterministic_and_splits_disjoint(name):
    env = GENERATED[name]()
    assert env.problems(50, seed=3) == GENERATED[name]().problems(50, seed=3)
    assert env.problems(50, seed=3) != env.problems(50, seed=4)
    train = {p.prompt for p in env.problems(400, seed=0)} | {p.prompt for p in env.problems(400, seed=1)}
    test = {p.prompt for p in env.problems(100, seed=0, split="test")}
    assert len(test) > 20 and not train & test
    with pytest.raises(ConfigError, match="split"):
        env.problems(1, 0, split="valid")


def test_first_problems_are_stable_across_processes():
    # str-seeded random.Random is sha512-based, so these never change with PYTHONHASHSEED or the process
    assert [(p.prompt, p.answer) for p in ArithmeticEnv().problems(2, 0)] == [("3+17=", 20), ("4-3=", 1)]
    assert [(p.prompt, p.answer) for p in CalculatorToolEnv().problems(2, 0, "test")] == [
        ("88*13=?\n", 1144),
        ("41*54=?\n", 2214),
    ]


def test_envs_implement_the_protocols():
    for env in (ArithmeticEnv(), CountdownEnv()):
        assert isinstance(env, Environment)
    assert isinstance(CalculatorToolEnv(), MultiTurnEnvironment)


# ---- the evaluator ----


def test_evaluate_values_and_literals():
    assert evaluate("3*5+7") == (22, (3, 5, 7))
    assert evaluate(" (3 + 5) * -2 ") == (-16, (3, 5, 2))
    assert evaluate("2*3-4/2").value == 4
    assert evaluate("7-(2-1)").value == 6
    assert evaluate("7-2-1").value == 4
    assert evaluate("12/4/3").value == 1
    assert evaluate("1000000000000").value == 10**12


@pytest.mark.parametrize("text", ["7/2", "1/0", "", "  ", "1+", "((1)", "1)", "1 2", "2**3", "1000000000001", "3.0"])
def test_evaluate_rejects(text):
    with pytest.raises(ExprError):
        evaluate(text)


def test_evaluate_limits():
    assert evaluate("(" * 15 + "1" + ")" * 15, max_len=100).value == 1
    with pytest.raises(ExprError, match="nesting"):
        evaluate("(" * 16 + "1" + ")" * 16, max_len=100)
    with pytest.raises(ExprError, match="nesting"):
        evaluate("-" * 20 + "1", max_len=100)
    with pytest.raises(ExprError, match="magnitude"):
        evaluate("999999*999999*999999")
    with pytest.raises(ExprError, match="longer"):
        evaluate("1+" * 40 + "1")


# ---- arithmetic ----


def test_arithmetic_reward():
    env, p, neg = ArithmeticEnv(), Problem("12+7=", 19), Problem("3-5=", -2)
    for completion, want in [
        ("19", 1.0),
        (" 19\nmore text", 1.0),
        ("19abc", 1.0),
        ("019", 1.0),
        ("190", 0.0),
        ("-19", 0.0),
        ("x19", 0.0),
        ("", 0.0),
        ("\uff11\uff19", 0.0),  # fullwidth digits
        ("1" * 10_000, 0.0),
    ]:
        assert env.reward(p, completion) == want, completion[:20]
    assert env.reward(neg, "-2") == 1.0 and env.reward(neg, "2") == 0.0 and env.reward(neg, "- 2") == 0.0


def test_arithmetic_config_and_sft_examples():
    env = ArithmeticEnv(max_operand=9, ops="*", num_terms=3)
    for p in env.problems(30, seed=0):
        a, b, c = map(int, re.fullmatch(r"(\d)\*(\d)\*(\d)=", p.prompt).groups())
        assert p.answer == a * b * c
    mixed = ArithmeticEnv(max_operand=9, ops="+*", num_terms=3).problems(200, seed=0)
    for p in mixed:  # usual precedence
        x, o1, y, o2, z = re.fullmatch(r"(\d)([+*])(\d)([+*])(\d)=", p.prompt).groups()
        x, y, z = int(x), int(y), int(z)
        want = {("+", "+"): x + y + z, ("+", "*"): x + y * z, ("*", "+"): x * y + z, ("*", "*"): x * y * z}
        assert p.answer == want[(o1, o2)]
    pairs = ArithmeticEnv().sft_examples(5, seed=0)
    assert pairs[:2] == [("3+17=", "20"), ("4-3=", "1")]  # no terminator: the trainer appends EOS
    for bad in ({"ops": "/"}, {"ops": ""}, {"num_terms": 1}, {"max_operand": 0}, {"test_fraction": 1.0}):
        with pytest.raises(ConfigError):
            ArithmeticEnv(**bad)


def test_held_out_problems_are_distinct_and_the_whole_test_split_of_a_small_space():
    """The 100 problems a+b (a, b in 0..9): held_out asks for 64 and gets every test problem of that space once (the
    test split counted by brute force), not 64 draws with repeats; a larger test_fraction holds out more, disjoint
    from what training draws."""
    from moerl.envs.base import held_out, split_of

    space = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    for fraction in (0.1, 0.3):
        env = ArithmeticEnv(max_operand=9, ops="+", test_fraction=fraction)
        test = {q for q in space if split_of(q, fraction) == "test"}
        got = held_out(env, 64, seed=0)
        assert len({p.prompt for p in got}) == len(got) == len(test) and {p.prompt for p in got} == test
        assert not test & {p.prompt for p in env.problems(500, seed=0, split="train")}
    assert len(env.problems(64, seed=0, split="test")) == 64  # plain draws repeat: what evaluation used to score
    big = ArithmeticEnv(max_operand=99, ops="+")
    assert len({p.prompt for p in held_out(big, 200, seed=0)}) == 200  # a large space: exactly the count asked for
    assert [p.prompt for p in held_out(big, 50, seed=0)] == [p.prompt for p in held_out(big, 200, seed=0)][:50]


@pytest.mark.parametrize("correct,total", [(0, 10), (3, 10), (47, 100), (94, 200), (200, 200), (1, 1)])
def test_wilson_interval_is_the_set_of_rates_the_score_test_accepts(correct, total):
    """Oracle: the Wilson interval is every p whose score test |p_hat - p| <= 1.96 sqrt(p(1-p)/n) passes; found by
    scanning p on a 1e-5 grid (not the closed form under test)."""
    from moerl.envs.base import wilson_interval

    low, high = wilson_interval(correct, total)
    p_hat = correct / total
    grid = [i / 100_000 for i in range(100_001)]
    accepted = [p for p in grid if abs(p_hat - p) <= 1.96 * math.sqrt(p * (1 - p) / total) or p == p_hat]
    assert abs(low - min(accepted)) < 2e-5 and abs(high - max(accepted)) < 2e-5
    wrong = wilson_interval(correct, total, z=1.64)  # the 90% interval: a wrong knob is caught by the same check
    assert (high - low) - (wrong[1] - wrong[0]) > 1e-3
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


# ---- countdown ----

CD = Problem("nums 3 5 7 target 22:", {"numbers": [3, 5, 7], "target": 22})


@pytest.mark.parametrize(
    "completion, want",
    [
        ("3*5+7", 1.0),
        ("7+3*5\n", 1.0),
        ("(7 + (3*5))", 1.0),
        ("3*5+7=22", 1.0),
        ("3*5+7\nthe rest is ignored", 1.0),
        ("3*5+7 is it", 0.0),
        ("3*5+7+0", 0.0),  # 0 is not given
        ("3*5+7*1", 0.0),
        ("5*5-3", 0.0),  # 5 twice
        ("3*5+7-7+7", 0.0),  # 7 three times
        ("22", 0.0),
        ("(3+5)*7", 0.0),
        ("", 0.0),
        ("sure! 3*5+7", 0.0),
    ],
)
def test_countdown_reward(completion, want):
    assert CountdownEnv().reward(CD, completion) == want


def test_countdown_division_and_generated_solutions():
    p = Problem("nums 2 3 8 target 12:", {"numbers": [2, 3, 8], "target": 12})
    env = CountdownEnv()
    assert env.reward(p, "8/2*3") == 1.0 and env.reward(p, "3/2*8") == 0.0  # 3/2 is inexact
    for prob in env.problems(300, seed=0):
        nums, target = prob.answer["numbers"], prob.answer["target"]
        assert prob.prompt == f"nums {' '.join(map(str, nums))} target {target}:"
        assert len(nums) == 3 and all(1 <= x <= 20 for x in nums) and 1 <= target <= 200 and target not in nums
        assert env.reward(prob, prob.meta["solution"]) == 1.0
        assert sorted(evaluate(prob.meta["solution"]).literals) == nums  # every number used once


HOSTILE = [
    "9**9**9**9",
    "2**100000",
    "(" * 10000 + "1" + ")" * 10000,
    "-" * 10000 + "1",
    "__import__('os').system('ls')",
    "(1).__class__",
    "[1,2]",
    "lambda: 1",
    "(lambda: 3*5+7)()",
    "3" * 1_000_000,
    "3*5+" * 250_000 + "7",
    "\uff13*\uff15+\uff17",  # fullwidth digits
    "\u0663*\u0665+\u0667",  # Arabic-Indic digits
    "1/0",
    "22/0+0",
    "99999999*99999999*99999999",
    "3*5+7\x00",
    "3e1-8",
    "0x16",
    "22.0",
]


@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_countdown_hostile_inputs(completion):
    assert CountdownEnv().reward(CD, completion) == 0.0
    # and it neither raises nor hangs: under the reward guard it returns a score, not "error" / "timeout"
    assert safe_reward(CountdownEnv().reward, CD, completion, timeout_s=10) == (0.0, None)


# ---- safe_reward ----


def test_safe_reward_values_errors_and_timeouts():
    assert safe_reward(abs, -2.5, timeout_s=30) == (2.5, None)  # also starts the worker
    assert safe_reward(abs, -3, timeout_s=5) == (3.0, None)
    assert safe_reward(_boom, 7, timeout_s=5) == (0.0, "error")
    assert safe_reward(math.sqrt, -1.0, timeout_s=5) == (0.0, "error")
    for value in ("nan", "inf", "-inf"):
        assert safe_reward(float, value, timeout_s=5) == (0.0, "error")
    assert safe_reward(bool, 1, timeout_s=5) == (0.0, "error")
    assert safe_reward(str, 1, timeout_s=5) == (0.0, "error")
    for fn, args in [(time.sleep, (30,)), (_spin, ()), (pow, (9, 9**9))]:  # pow holds the GIL throughout
        assert safe_reward(fn, *args, timeout_s=0.5) == (0.0, "timeout")
        assert safe_reward(abs, -1, timeout_s=30) == (1.0, None)  # a fresh worker takes over


def test_safe_rewards_score_a_batch_in_order_through_timeouts_and_crashes():
    """A step's rewards in one round trip: each call keeps its own outcome and order; one that times out or kills
    the worker costs only itself (a fresh worker runs the calls after it)."""
    calls = [(-1,), ("sleep",), (-2,), ("exit",), (-3,), ("boom",), (-4,)]
    got = safe_rewards(_by_kind, calls, timeout_s=1.0)
    assert got == [(1.0, None), (0.0, "timeout"), (2.0, None), (0.0, "error"), (3.0, None), (0.0, "error"), (4.0, None)]
    assert safe_rewards(abs, [], timeout_s=1.0) == []


def test_safe_rewards_limit_each_call_not_the_batch():
    """Three calls of 0.4 s under a 0.7 s limit all finish (1.2 s in all: the limit is a call's, not the batch's);
    control: under a 0.2 s limit the same calls time out."""
    assert safe_rewards(_nap, [(0.4,)] * 3, timeout_s=0.7) == [(0.4, None)] * 3
    assert safe_rewards(_nap, [(0.4,)] * 2, timeout_s=0.2) == [(0.0, "timeout")] * 2
    with pytest.raises(ConfigError, match="pickle"):
        safe_rewards(abs, [(lambda: 1,)], timeout_s=1)


def test_safe_reward_runs_env_rewards_and_rejects_bad_calls():
    env = ArithmeticEnv()
    assert safe_reward(env.reward, Problem("12+7=", 19), "19", timeout_s=30) == (1.0, None)
    assert safe_reward(env.reward, Problem("12+7=", 19), "18", timeout_s=30) == (0.0, None)
    with pytest.raises(ConfigError, match="pickle"):
        safe_reward(lambda: 1.0, timeout_s=1)
    for bad in (0, -1, float("nan"), "1"):
        with pytest.raises(ConfigError, match="timeout_s"):
            safe_reward(abs, 1, timeout_s=bad)


# ---- math ----

RECORDS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?", "answer": "2*1000=2000\n#### 2,000"},
    {"question": "What is half of one?", "answer": "\\frac{1}{2}"},
]
INSTR = "\nPut the final answer in \\boxed{}."


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_math_env_formats_and_reward(tmp_path, fmt):
    write = _write_jsonl if fmt == "jsonl" else _write_parquet
    env = MathEnv(write(tmp_path / f"train.{fmt}", RECORDS), test_path=write(tmp_path / f"test.{fmt}", RECORDS[2:]))
    train = env.problems(2, seed=0)
    assert sorted((p.prompt, p.answer) for p in train) == [
        (RECORDS[1]["question"] + INSTR, "2000"),
        (RECORDS[0]["question"] + INSTR, "7"),
    ]
    assert [(p.prompt, p.answer) for p in env.problems(2, seed=0, split="test")] == [
        (RECORDS[2]["question"] + INSTR, "\\frac{1}{2}")
    ] * 2
    apples, pens, half = Problem("", "7"), Problem("", "2000"), Problem("", "\\frac{1}{2}")
    assert env.reward(apples, "3 plus 4 is 7, so the answer is \\boxed{7}.") == 1.0
    assert env.reward(apples, "7") == 1.0
    assert env.reward(apples, "The answer is \\boxed{8}.") == 0.0
    assert env.reward(apples, "") == 0.0
    assert env.reward(apples, "}}{{\\boxed{\\frac{") == 0.0
    assert env.reward(pens, "They sell 2,000 pens.") == 1.0
    assert env.reward(half, "\\boxed{0.5}") == 1.0 and env.reward(half, "\\boxed{1/3}") == 0.0
    assert safe_reward(env.reward, apples, "\\boxed{7}", timeout_s=60) == (1.0, None)  # pickles by path


def test_math_env_hash_split_and_sampling(tmp_path):
    records = [{"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"} for i in range(40)]
    env = MathEnv(_write_jsonl(tmp_path / "all.jsonl", records), test_fraction=0.5)
    train = {p.prompt for p in env.problems(100, seed=0)}
    test = {p.prompt for p in env.problems(100, seed=0, split="test")}
    assert train and test and not train & test and len(train | test) == 40  # n > pool: every record comes
    assert env.problems(10, seed=1) == env.problems(10, seed=1) != env.problems(10, seed=2)


def test_math_env_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        MathEnv(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n\n" + json.dumps({"question": "Why?"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:3: missing field 'answer'"):
        MathEnv(bad)
    bad.write_text(json.dumps(RECORDS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        MathEnv(bad)
    with pytest.raises(ConfigError, match="missing column"):
        MathEnv(_write_parquet(tmp_path / "q.parquet", [{"question": "Why?", "solution": "1"}]))
    with pytest.raises(ConfigError, match="row 2: missing field 'question'"):
        MathEnv(_write_parquet(tmp_path / "n.parquet", [RECORDS[0], {"question": None, "answer": "1"}]))
    (tmp_path / "x.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match=r"\.jsonl or \.parquet"):
        MathEnv(tmp_path / "x.csv")


def _hostile_jsonl(tmp_path) -> dict[str, tuple]:
    """Data files a good line opens and a hostile second line follows: name -> (file, the error naming it)."""
    good = json.dumps(RECORDS[0]).encode() + b"\n"
    latin1 = tmp_path / "latin1.jsonl"  # a Latin-1 "e acute" where UTF-8 was due
    latin1.write_bytes(good + b'{"question": "Caf\xe9?", "answer": "1"}\n')
    deep = tmp_path / "deep.jsonl"  # json's decoder recurses once per level: RecursionError
    deep.write_bytes(good + b"[" * 200_000 + b"]" * 200_000 + b"\n")
    return {
        "latin1": (latin1, f"{latin1}:2: not UTF-8 (byte 0xe9 at column 18)"),
        "deep": (deep, f"{deep}:2: JSON nested too deep to read (a record is an object of two strings)"),
    }


@pytest.mark.parametrize("case", ["latin1", "deep"])
def test_a_math_data_line_not_utf8_or_nested_too_deep_is_named_by_file_and_line(case, tmp_path, capsys):
    """The env itself, and ``moerl sft`` and ``moerl train`` on it: one line, exit 2, nothing written."""
    from moerl.cli import main

    path, message = _hostile_jsonl(tmp_path)[case]
    with pytest.raises(ConfigError) as e:
        MathEnv(path)
    assert str(e.value) == message
    out = tmp_path / "sft"
    assert main(["sft", str(out), "--env", "math", "--env-kwargs", json.dumps({"path": str(path)})]) == 2
    assert capsys.readouterr().err == f"moerl: error: {message}\n" and not out.exists()
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "env.name=math", f"env.kwargs.path={path}", "train.steps=1"]) == 2
    assert capsys.readouterr().err == f"moerl: error: {message}\n"
    assert not run.exists() or not any(run.iterdir())  # nothing written in the run directory


# ---- calculator tool ----


def test_calculator_episode_with_tool_calls():
    env = CalculatorToolEnv(max_turns=3)
    p = Problem("47*86=?\n", 4042)
    state = env.start(p)
    assert env.step(state, "I will use the tool.\nCALC: 47*86\n") == ("= 4042\n", None)
    assert env.step(state, "CALC: 4042/2\nignored: ANSWER: 1\n") == ("= 2021\n", None)
    assert env.step(state, "ANSWER: 4042") == (None, 1.0)

    state = env.start(p)
    assert env.step(state, "CALC: 47**86\n") == ("= error\n", None)
    assert env.step(state, "CALC: __import__('os').system('ls')\n") == ("= error\n", None)
    assert env.step(state, "CALC: 47*86\n") == (None, 0.0)  # a tool call on the last turn ends the episode

    for completion, want in [
        ("ANSWER: 4042", 1.0),  # answering directly
        ("ANSWER: 4042 is my answer\nCALC: 1+1\n", 1.0),
        ("ANSWER:4042\n", 1.0),
        ("ANSWER: 40420", 0.0),
        ("ANSWER: 4041", 0.0),
        ("ANSWER: many", 0.0),
        ("4042", 0.0),  # no action line
        ("", 0.0),
    ]:
        assert env.step(env.start(p), completion) == (None, want), completion


def test_calculator_problems_and_config():
    for p in CalculatorToolEnv().problems(50, seed=0):
        a, b = map(int, re.fullmatch(r"(\d\d)\*(\d\d)=\?\n", p.prompt).groups())
        assert p.answer == a * b
    with pytest.raises(ConfigError):
        CalculatorToolEnv(max_turns=0)


# ---- registry ----


def test_make_env(tmp_path):
    env = make_env("arithmetic", max_operand=5)
    assert isinstance(env, ArithmeticEnv) and env.max_operand == 5
    assert isinstance(make_env("countdown"), CountdownEnv) and isinstance(make_env("calculator"), CalculatorToolEnv)
    assert isinstance(make_env("math", path=_write_jsonl(tmp_path / "m.jsonl", RECORDS)), MathEnv)
    allowed = "allowed: arithmetic, countdown, math, calculator, dataset, reasoning_gym, verifiers, a file.py:Class"
    with pytest.raises(ConfigError, match=f"unknown environment 'gsm8k'; {allowed}"):
        make_env("gsm8k")
    with pytest.raises(ConfigError, match="'countdown'.*bogus"):
        make_env("countdown", bogus=1)
