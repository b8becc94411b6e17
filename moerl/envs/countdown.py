"""Countdown: combine the given numbers with ``+ - * /`` and parentheses to reach a target.

Prompt ``"nums 3 5 7 target 22:"``; the completion is an expression such as ``"3*5+7"``, read up to its first newline
or ``=`` (so ``"3*5+7=22"`` also counts), and evaluated by the bounded parser in :mod:`moerl.envs.expr` (never
``eval``). Reward 1.0 iff it uses only the given numbers, each at most once, and equals the target; 0.0 for anything
else, garbage and hostile text included, without raising.
"""

from __future__ import annotations

import random
from collections import Counter

from moerl.envs.base import Problem, sample_problems
from moerl.envs.expr import ExprError, evaluate
from moerl.errors import ConfigError

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def _combine(a: tuple[str, int, int], b: tuple[str, int, int], op: str) -> tuple[str, int, int] | None:
    """(text, value, precedence) of ``a op b`` with the parentheses precedence needs; None for inexact division."""
    (ta, va, pa), (tb, vb, pb), p = a, b, _PREC[op]
    if op == "/" and (vb == 0 or va % vb):
        return None
    value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va // vb if vb else 0}[op]
    ta = f"({ta})" if pa < p else ta
    tb = f"({tb})" if pb < p or (pb == p and op in "-/") else tb
    return f"{ta}{op}{tb}", value, p


class CountdownEnv:
    """``num_numbers`` numbers in ``[1, max_number]`` and a target in ``[1, max_target]`` that some expression over
    all of them (each once, operators from ``ops``) reaches; ``meta["solution"]`` holds that expression.

    ``answer`` is ``{"numbers": [...], "target": int}``; ``max_len`` bounds the completion's expression length.
    """

    name = "countdown"

    def __init__(
        self, num_numbers: int = 3, max_number: int = 20, max_target: int = 200, ops: str = "+-*/", max_len: int = 64
    ) -> None:
        if num_numbers < 2:
            raise ConfigError(f"countdown: num_numbers must be >= 2, got {num_numbers}")
        if max_number < 2 or max_target < 1:
            raise ConfigError(f"countdown: need max_number >= 2 and max_target >= 1, got {max_number}, {max_target}")
        if not ops or set(ops) - set(_PREC):
            raise ConfigError(f"countdown: ops must be a non-empty subset of '+-*/', got {ops!r}")
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.ops, self.max_len = ops, max_len

    def _make(self, rng: random.Random) -> Problem:
        for _ in range(1000):
            numbers = sorted(rng.randint(1, self.max_number) for _ in range(self.num_numbers))
            items = [(str(x), x, _ATOM) for x in numbers]
            rng.shuffle(items)
            while len(items) > 1:
                a, b = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
                combined = [c for op in rng.sample(self.ops, len(self.ops)) if (c := _combine(a, b, op))]
                if not combined:
                    break
                items.append(combined[0])
            solution, target, _ = items[0]
            if len(items) > 1 or not 1 <= target <= self.max_target or target in numbers:
                continue
            try:  # the solution must itself be a valid completion (length, magnitude)
                evaluate(solution, max_len=self.max_len)
            except ExprError:
                continue
            answer = {"numbers": numbers, "target": target}
            return Problem(f"nums {' '.join(map(str, numbers))} target {target}:", answer, {"solution": solution})
        raise ConfigError(f"countdown: no valid problem found in 1000 tries for {vars(self)}")

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems, deterministic in ``(seed, split)``; train and test are disjoint by prompt hash."""
        return sample_problems(self.name, n, seed, split, self._make)

    def sft_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``(prompt, solution)`` pairs from the train split, e.g. ``("nums 3 5 9 target 24:", "(9-5)*3+...")``: the
        expression the problem was built from (no terminator: the trainer appends EOS)."""
        return [(p.prompt, p.meta["solution"]) for p in self.problems(n, seed, "train")]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 iff the completion's expression uses only the given numbers (each at most once) and equals the
        target; 0.0 otherwise. Never raises; cost is bounded by ``max_len`` whatever the completion's length."""
        head = completion[: self.max_len + 1]  # longer text cannot hold a valid expression before its terminator
        expr = head.split("\n", 1)[0].split("=", 1)[0]
        try:
            value, used = evaluate(expr, max_len=self.max_len)
        except ExprError:
            return 0.0
        ok = value == problem.answer["target"] and not Counter(used) - Counter(problem.answer["numbers"])
        return 1.0 if ok else 0.0
