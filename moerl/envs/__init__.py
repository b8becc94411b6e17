"""RL environments: problems to prompt with and rewards for the completions.

``make_env(name, **kwargs)`` builds one by name: ``arithmetic``, ``countdown``, ``math``, ``calculator``.
"""

from __future__ import annotations

import inspect
from typing import Any

from moerl.envs.arithmetic import ArithmeticEnv
from moerl.envs.base import Environment, MultiTurnEnvironment, Problem, safe_reward
from moerl.envs.countdown import CountdownEnv
from moerl.envs.expr import Evaluated, ExprError, evaluate
from moerl.envs.math import MathEnv
from moerl.envs.tool import CalculatorToolEnv
from moerl.errors import ConfigError

ENVS: dict[str, type] = {
    "arithmetic": ArithmeticEnv,
    "countdown": CountdownEnv,
    "math": MathEnv,
    "calculator": CalculatorToolEnv,
}


def make_env(name: str, **kwargs: Any) -> Environment | MultiTurnEnvironment:
    """The environment registered as ``name``, built with ``kwargs``; ConfigError for an unknown name or argument."""
    cls = ENVS.get(name)
    if cls is None:
        raise ConfigError(f"unknown environment {name!r}; allowed: {', '.join(sorted(ENVS))}")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"environment {name!r}: {e}") from e
    return cls(**kwargs)


__all__ = [
    "ENVS",
    "ArithmeticEnv",
    "CalculatorToolEnv",
    "ConfigError",
    "CountdownEnv",
    "Environment",
    "Evaluated",
    "ExprError",
    "MathEnv",
    "MultiTurnEnvironment",
    "Problem",
    "evaluate",
    "make_env",
    "safe_reward",
]
