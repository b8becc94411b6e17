"""Integer arithmetic prompts (``"12+7="``) for a character-level model; the completion starts with the answer."""

from __future__ import annotations

import random
import re

from moerl.envs.base import Problem, sample_problems
from moerl.envs.expr import evaluate
from moerl.errors import ConfigError

_LEADING_INT = re.compile(r" *(-?[0-9]+)")  # ASCII digits only: int() would also take unicode digits
MAX_ANSWER_DIGITS = 32


def leading_int(text: str) -> int | None:
    """The integer ``text`` starts with (after optional spaces; a leading '-' allowed), read up to the first
    non-digit; None when ``text`` does not start with one or it has more than 32 digits."""
    m = _LEADING_INT.match(text)
    if m is None or len(m.group(1).lstrip("-")) > MAX_ANSWER_DIGITS:
        return None
    return int(m.group(1))


class ArithmeticEnv:
    """``num_terms`` operands in ``[0, max_operand]`` joined by operators drawn from ``ops`` (a subset of ``+-*``,
    usual precedence); prompt ``"12+7="``, answer the integer value. ``test_fraction`` of the problems (by prompt
    hash) are held out: never trained on, evaluated.

    Reward 1.0 when the completion starts with the answer (see :func:`leading_int`; ``" 19\\nfoo"`` counts), else 0.0.
    """

    name = "arithmetic"

    def __init__(self, max_operand: int = 20, ops: str = "+-", num_terms: int = 2, test_fraction: float = 0.1) -> None:
        if max_operand < 1:
            raise ConfigError(f"arithmetic: max_operand must be >= 1, got {max_operand}")
        if not ops or set(ops) - set("+-*"):
            raise ConfigError(f"arithmetic: ops must be a non-empty subset of '+-*', got {ops!r}")
        if num_terms < 2:
            raise ConfigError(f"arithmetic: num_terms must be >= 2, got {num_terms}")
        if not 0 < test_fraction < 1:
            raise ConfigError(f"arithmetic: test_fraction must lie in (0, 1), got {test_fraction}")
        self.max_operand, self.ops, self.num_terms, self.test_fraction = max_operand, ops, num_terms, test_fraction

    def _make(self, rng: random.Random) -> Problem:
        terms = [str(rng.randint(0, self.max_operand)) for _ in range(self.num_terms)]
        expr = terms[0] + "".join(rng.choice(self.ops) + t for t in terms[1:])
        return Problem(expr + "=", evaluate(expr, max_len=len(expr), max_abs=10**100).value)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems, deterministic in ``(seed, split)``; train and test are disjoint by prompt hash (a
        ``test_fraction`` of the problem space is test)."""
        return sample_problems(self.name, n, seed, split, self._make, test_fraction=self.test_fraction)

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the completion's leading integer equals the answer, else 0.0."""
        return 1.0 if leading_int(completion) == problem.answer else 0.0

    def sft_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``(prompt, target)`` pairs from the train split, e.g. ``("12+7=", "19")``: the target has no terminator,
        the trainer appends EOS (the stop convention in :mod:`moerl.envs.base`)."""
        return [(p.prompt, str(p.answer)) for p in self.problems(n, seed, "train")]
