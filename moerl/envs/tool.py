"""A multi-turn calculator-tool environment.

Prompt ``"47*86=?\\n"``. Each turn the model writes a completion; the environment reads its lines in order and acts
on the first that starts with either

- ``ANSWER: <int>``: the episode ends, reward 1.0 if the integer equals the answer, else 0.0;
- ``CALC: <expr>``: the environment replies ``"= <value>\\n"`` (``"= error\\n"`` for an invalid expression), evaluated
  by the same bounded evaluator as countdown, and the model writes the next turn. Text after that line is ignored.

The episode also ends, with reward 0.0, on a completion with neither line or on a tool call at the ``max_turns``-th
completion. The conversation is the plain concatenation prompt + completion + reply + completion ...; a tool-calling
completion should therefore end its CALC line with a newline.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from moerl.envs.base import Problem, sample_problems
from moerl.envs.expr import ExprError, evaluate
from moerl.errors import ConfigError

_ACTION = re.compile(r"^[ \t]*(ANSWER|CALC):[ \t]*(.*)$", re.MULTILINE)
_INT = re.compile(r"-?[0-9]{1,32}(?![0-9])")
MAX_EXPR_LEN = 64


@dataclass(slots=True)
class ToolEpisode:
    """An episode in progress: its problem and the number of completions consumed so far."""

    problem: Problem
    turns: int = 0


class CalculatorToolEnv:
    """Products (or sums/differences, from ``ops``) of two operands in ``[min_operand, max_operand]``, large enough
    that a small model gains from the ``CALC:`` tool; at most ``max_turns`` completions per episode."""

    name = "calculator"

    def __init__(self, min_operand: int = 10, max_operand: int = 99, ops: str = "*", max_turns: int = 3) -> None:
        if not 0 <= min_operand <= max_operand:
            raise ConfigError(f"calculator: need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
        if not ops or set(ops) - set("+-*"):
            raise ConfigError(f"calculator: ops must be a non-empty subset of '+-*', got {ops!r}")
        if max_turns < 1:
            raise ConfigError(f"calculator: max_turns must be >= 1, got {max_turns}")
        self.min_operand, self.max_operand, self.ops, self.max_turns = min_operand, max_operand, ops, max_turns

    def _make(self, rng: random.Random) -> Problem:
        a, b = rng.randint(self.min_operand, self.max_operand), rng.randint(self.min_operand, self.max_operand)
        expr = f"{a}{rng.choice(self.ops)}{b}"
        return Problem(f"{expr}=?\n", evaluate(expr).value)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems, deterministic in ``(seed, split)``; train and test are disjoint by prompt hash."""
        return sample_problems(self.name, n, seed, split, self._make)

    def sft_examples(self, n: int, seed: int, eos: str = "<eos>") -> list[tuple[str, str]]:
        """Two ``(context, turn)`` pairs per train problem, the episode a tool user has: ``("47*86=?\n",
        "CALC: 47*86\n")``, then with the tool's reply in the context ``("47*86=?\nCALC: 47*86\n<eos>= 4042\n",
        "ANSWER: 4042")``. The engine keeps a turn's EOS in the conversation: ``eos`` is its text (moerl's char
        tokenizer reads ``<eos>`` as the token); the trainer appends EOS to each turn."""
        pairs = []
        for p in self.problems(n, seed, "train"):
            expr = p.prompt.removesuffix("=?\n")
            call = f"CALC: {expr}\n"
            pairs += [(p.prompt, call), (f"{p.prompt}{call}{eos}= {p.answer}\n", f"ANSWER: {p.answer}")]
        return pairs[:n]

    def start(self, problem: Problem) -> ToolEpisode:
        """A new episode for ``problem``."""
        return ToolEpisode(problem)

    def step(self, state: ToolEpisode, completion: str) -> tuple[str | None, float | None]:
        """Consume one completion: ``("= <value>\\n", None)`` after a tool call, ``(None, reward)`` at the end."""
        state.turns += 1
        action = _ACTION.search(completion)
        if action is None:
            return None, 0.0
        kind, arg = action.groups()
        if kind == "ANSWER":
            m = _INT.match(arg)
            return None, 1.0 if m is not None and int(m.group()) == state.problem.answer else 0.0
        if state.turns >= self.max_turns:
            return None, 0.0
        try:
            return f"= {evaluate(arg.strip(), max_len=MAX_EXPR_LEN).value}\n", None
        except ExprError:
            return "= error\n", None
