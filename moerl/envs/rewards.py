"""Scoring single-turn completions: the environment's own ``reward``, or the weighted sum of the reward functions a
config names (``env.rewards``), each called as ``fn(completion, **fields)`` with the problem's other fields.

Every call runs in the reward worker under the reward timeout (``safe_calls``). One that raises, returns something
other than a finite number, or takes too long scores 0 for that function; the first such failure of each function
and kind is said in words naming the function and the record (``Failures``), every one is counted in the metrics,
and the run goes on.
"""

from __future__ import annotations

import inspect
import math
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass

from moerl.envs.base import Problem, safe_calls
from moerl.errors import ConfigError


@dataclass(slots=True)
class RewardFn:
    """One reward function: as the config names it (``spec``, at config key ``key``), the function, its weight."""

    spec: str
    fn: Callable[..., float]
    weight: float
    key: str = "env.rewards"


def fields_of(problem: Problem) -> dict:
    """What a reward function gets besides the completion: the record's other fields (``answer`` where the problem
    has one, and its metadata)."""
    return ({"answer": problem.answer} if problem.answer is not None else {}) | problem.meta


def call_reward(fn: Callable[..., float], completion: str, fields: dict) -> float:
    """``fn(completion, **fields)``: the call the reward worker makes (module level: it pickles)."""
    return fn(completion, **fields)


def answer_text(completion: str, tags: tuple[str, str] | None) -> str:
    """The completion without its reasoning block, ``tags`` = (open, close) e.g. ``("<think>", "</think>")``: the
    text after the last close; where there is none, the text before an open (a completion cut while it reasoned
    has no answer); the whole completion where it has neither (it did not reason)."""
    if not tags:
        return completion
    start, end = tags
    if end in completion:
        return completion.rsplit(end, 1)[1]
    return completion.split(start, 1)[0] if start in completion else completion


class Failures:
    """What failed, in words: the first failure of each function and kind says its function, its record and why;
    later ones are only counted (the metrics ``reward_errors``, ``reward_timeouts``)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s, self.said, self.lines = timeout_s, set(), []
        self._lock = threading.Lock()  # rollouts generated ahead add from their own thread

    def add(self, what: str, problem: Problem, kind: str, detail: object, outcome: str) -> None:
        """``what`` (a function) failed on ``problem`` with ``kind`` ("error" | "timeout") and ``detail``; ``outcome``
        says what becomes of the sample."""
        why = f"took longer than algo.reward_timeout_s={self.timeout_s:g} s" if kind == "timeout" else detail
        with self._lock:
            if (what, kind) in self.said:
                return
            self.said.add((what, kind))
            self.lines.append(
                f"moerl: {what} on {problem.name()} {why}: {outcome} (later failures of it are counted in the "
                f"metrics reward_{'timeouts' if kind == 'timeout' else 'errors'}, not said)"
            )

    def take(self) -> list[str]:
        """The lines not taken yet."""
        with self._lock:
            lines, self.lines = self.lines, []
        return lines


class Scorer:
    """Scores single-turn completions of ``env``'s problems: ``fns`` (weighted, summed) where given, else the
    environment's own ``reward``; ``reasoning``: the tags of a reasoning block the rewards do not see
    (:func:`answer_text`); every call bounded by ``timeout_s`` in the reward worker."""

    def __init__(self, env, fns: list[RewardFn], timeout_s: float, reasoning: tuple[str, str] | None = None) -> None:
        name = getattr(env, "name", type(env).__name__)
        if fns and hasattr(env, "start"):
            raise ConfigError(
                f"config key 'env.rewards': environment {name!r} is multi-turn (its step gives the reward); "
                "env.rewards scores single-turn completions"
            )
        if fns and hasattr(env, "run_episodes"):
            raise ConfigError(
                f"config key 'env.rewards': environment {name!r} runs agents whose rollouts its own rewards score"
            )
        agents = hasattr(env, "run_episodes")
        if not fns and not hasattr(env, "start") and not agents and not callable(getattr(env, "reward", None)):
            raise ConfigError(
                f"config key 'env.rewards': environment {name!r} has no reward of its own; name reward functions "
                "here ([{fn: my_rewards.py:correct, weight: 1.0}, ...])"
            )
        self.env, self.fns, self.timeout_s, self.reasoning = env, fns, timeout_s, reasoning
        self.failures = Failures(timeout_s)

    def check(self, problem: Problem) -> None:
        """Refuse, naming the function and the record, a reward function that cannot take ``problem``'s fields."""
        fields = fields_of(problem)
        for f in self.fns:
            try:
                inspect.signature(f.fn).bind("", **fields)
            except TypeError as e:
                raise ConfigError(
                    f"config key {f.key!r}={f.spec!r}: cannot be called with the completion and the fields of "
                    f"{problem.name()} ({', '.join(fields) or 'none'}): {e}; take **kwargs to ignore fields"
                ) from None
            except ValueError:  # no signature to read (a builtin): its calls will say
                pass

    def score(self, items: list[tuple[Problem, str]]) -> list[tuple[float, str | None]]:
        """``(reward, None)`` for each ``(problem, completion)``, or ``(reward, "error" | "timeout")`` where a function
        failed (it adds 0); all calls of one function in one round trip to the reward worker."""
        texts = [answer_text(c, self.reasoning) for _, c in items]
        if not self.fns:
            name = f"{getattr(self.env, 'name', type(self.env).__name__)}.reward"
            outcomes = safe_calls(self.env.reward, [(p, t) for (p, _), t in zip(items, texts, strict=True)],
                                  timeout_s=self.timeout_s, as_reward=True)  # fmt: skip
            return [self._taken(name, p, o) for (p, _), o in zip(items, outcomes, strict=True)]
        totals, errors = [0.0] * len(items), [None] * len(items)
        for f in self.fns:
            calls = [(f.fn, t, fields_of(p)) for (p, _), t in zip(items, texts, strict=True)]
            outcomes = safe_calls(call_reward, calls, timeout_s=self.timeout_s, as_reward=True)
            for i, ((p, _), o) in enumerate(zip(items, outcomes, strict=True)):
                value, err = self._taken(f"reward {f.spec}", p, o, f"adds 0 of weight {f.weight:g}")
                totals[i] += f.weight * value
                errors[i] = errors[i] or err
        return list(zip(totals, errors, strict=True))

    def _taken(self, what: str, problem: Problem, outcome: tuple, fate: str = "the sample scores 0"):
        kind, value = outcome
        if kind == "ok":
            return value, None
        self.failures.add(what, problem, kind, value, fate)
        return 0.0, kind


def reward_fns(specs: list, load: Callable[[str, str], object]) -> list[RewardFn]:
    """The config's ``env.rewards`` entries (``fn``, ``weight``) as RewardFns, each function loaded by ``load(spec,
    key)``; ConfigError naming the entry that is not callable or whose weight is not a finite number."""
    out = []
    for i, s in enumerate(specs):
        key = f"env.rewards[{i}].fn"
        fn = load(s.fn, key)
        if not callable(fn):
            raise ConfigError(f"config key {key!r}={s.fn!r}: names a {type(fn).__name__}, not a function")
        try:  # it runs in the reward worker, which gets it by name
            pickle.dumps(fn)
        except Exception:
            raise ConfigError(
                f"config key {key!r}={s.fn!r}: must be a function defined at the top level of its module (it runs in "
                "the reward worker process, which finds it by name; a lambda or a nested function cannot be)"
            ) from None
        if not math.isfinite(s.weight):
            raise ConfigError(f"config key 'env.rewards[{i}].weight'={s.weight!r}: must be finite")
        out.append(RewardFn(s.fn, fn, float(s.weight), key))
    return out
