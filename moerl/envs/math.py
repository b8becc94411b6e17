"""Math word problems (GSM8K-style) from a local ``.jsonl`` or ``.parquet`` file, scored with ``math-verify``.

Each record has ``question`` and ``answer``. A GSM8K answer ends with ``#### <number>``: the gold is that number
(thousands commas dropped); any other answer string is the gold as it is (a number, a LaTeX expression).
"""

from __future__ import annotations

import os
import threading

from moerl.envs.base import Problem
from moerl.envs.records import read_records, shuffled_indices, split_pools
from moerl.errors import ConfigError

FIELDS = ("question", "answer")
INSTRUCTION = "\nPut the final answer in \\boxed{}."
PARSE_TIMEOUT_S = 5


def gold_answer(answer: str) -> str:
    """The final answer of a record's ``answer`` field: the text after the last ``####`` if any, else all of it."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.strip()


def _check_record(rec: object, where: str) -> tuple[str, str]:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected an object with fields {FIELDS}, got {type(rec).__name__}")
    for key in FIELDS:
        if rec.get(key) is None:
            raise ConfigError(f"{where}: missing field {key!r}")
    q, a = rec["question"], rec["answer"]
    if not isinstance(q, str) or not isinstance(a, str | int | float) or isinstance(a, bool):
        raise ConfigError(f"{where}: 'question' must be a string and 'answer' a string or number")
    return q, str(a)


def load_records(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs of a ``.jsonl`` or ``.parquet`` file; ConfigError naming the file and the line
    (jsonl, 1-based) or row (parquet, 1-based) of a bad record."""
    return [_check_record(rec, where) for where, rec in read_records(path, "math", "an object of two strings", FIELDS)]


class MathEnv:
    """Problems from ``path``; prompt = question + ``instruction``, answer = the gold string.

    Splits: with ``test_path`` the train split is ``path`` and the test split ``test_path`` (records of ``path`` whose
    question is also in ``test_path`` are dropped from train); without it one file is split by question hash, a
    ``test_fraction`` of it going to test. Reward: 1.0 if ``math_verify.verify(parse(gold), parse(completion))``.
    """

    name = "math"

    def __init__(
        self,
        path: str | os.PathLike,
        test_path: str | os.PathLike | None = None,
        instruction: str = INSTRUCTION,
        test_fraction: float = 0.1,
    ) -> None:
        self.path, self.test_path, self.instruction, self.test_fraction = path, test_path, instruction, test_fraction
        test = None if test_path is None else load_records(test_path)
        self.pools = split_pools(load_records(path), lambda r: r[0], test, test_fraction)

    def __reduce__(self) -> tuple:
        """Pickle as the config, not the records (``safe_reward`` sends the env to a worker process)."""
        return MathEnv, (self.path, self.test_path, self.instruction, self.test_fraction)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems of ``split`` in an order shuffled by ``seed``; the pool repeats (reshuffled) if ``n`` is
        larger than it."""
        pool = self.pools[split]
        return [
            Problem(pool[i][0] + self.instruction, gold_answer(pool[i][1]), {"index": i, "split": split})
            for i in shuffled_indices(pool, n, self.name, str(self.path), split, seed)
        ]

    def sft_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``(prompt, "\\boxed{gold}")`` pairs from the train split: the answer in the form the instruction asks for
        (the record's worked solution is not replayed: a small model learns the format and the arithmetic from it)."""
        return [(p.prompt, f"\\boxed{{{p.answer}}}") for p in self.problems(n, seed, "train")]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 if math-verify finds the completion's answer equal to the gold, else 0.0. math-verify's own time
        limits use SIGALRM and work only on the main thread; elsewhere run this under ``safe_reward``."""
        from math_verify import parse, verify

        limit = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = parse(str(problem.answer), parsing_timeout=limit)
        pred = parse(completion, parsing_timeout=limit)
        return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=limit) else 0.0
