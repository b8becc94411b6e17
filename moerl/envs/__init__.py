"""RL environments: problems to prompt with and rewards for the completions.

``make_env(name, **kwargs)`` builds one by name: ``arithmetic``, ``countdown``, ``math``, ``calculator``.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from moerl.envs.arithmetic import ArithmeticEnv
from moerl.envs.base import Environment, MultiTurnEnvironment, Problem, safe_reward, safe_rewards
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


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` checked against the constructor of environment ``name``: known names, required ones present, values
    of the annotated types (ints pass as floats). Returns them coerced; ConfigError names the key otherwise."""
    from moerl.config import coerce

    cls = ENVS.get(name)
    if cls is None:
        raise ConfigError(f"unknown environment {name!r}; allowed: {', '.join(sorted(ENVS))}")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"environment {name!r} (env.kwargs): {e}") from e
    hints = typing.get_type_hints(cls.__init__)
    return {k: coerce(f"env.kwargs.{k}", v, hints[k]) if k in hints else v for k, v in kwargs.items()}


def make_env(name: str, **kwargs: Any) -> Environment | MultiTurnEnvironment:
    """The environment registered as ``name``, built with ``kwargs``; ConfigError for an unknown name or argument."""
    kwargs = check_env_kwargs(name, kwargs)
    return ENVS[name](**kwargs)


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
    "check_env_kwargs",
    "evaluate",
    "make_env",
    "safe_reward",
    "safe_rewards",
]
