"""RL environments: problems to prompt with and rewards for the completions.

``make_env(name, **kwargs)`` builds one: a built-in by name (``arithmetic``, ``countdown``, ``math``, ``calculator``,
``dataset``, ``reasoning_gym``, ``verifiers``), the user's class by path (``my_tasks.py:MyEnv``,
``package.module:MyEnv``), or a name an installed package registers in the ``moerl.envs`` entry-point group.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from moerl.envs.arithmetic import ArithmeticEnv
from moerl.envs.base import Environment, MultiTurnEnvironment, Problem, safe_reward, safe_rewards
from moerl.envs.countdown import CountdownEnv
from moerl.envs.dataset import DatasetEnv
from moerl.envs.expr import Evaluated, ExprError, evaluate
from moerl.envs.math import MathEnv
from moerl.envs.reasoning_gym import ReasoningGymEnv
from moerl.envs.tool import CalculatorToolEnv
from moerl.envs.user import ENTRY_POINTS, installed_envs, is_code_path, load_code, load_installed
from moerl.envs.verifiers import VerifiersEnv
from moerl.errors import ConfigError

ENVS: dict[str, type] = {
    "arithmetic": ArithmeticEnv,
    "countdown": CountdownEnv,
    "math": MathEnv,
    "calculator": CalculatorToolEnv,
    "dataset": DatasetEnv,
    "reasoning_gym": ReasoningGymEnv,
    "verifiers": VerifiersEnv,
}


def env_class(name: str, key: str = "env.name") -> Any:
    """What builds environment ``name``: a built-in (ENVS), the class (or function) a ``file.py:Name`` /
    ``package.module:Name`` path names, or the one an installed package registers under ``name``; ConfigError naming
    what is missing otherwise (an unknown name as config key ``key``)."""
    if name in ENVS:
        return ENVS[name]
    if is_code_path(name):
        cls = load_code(name, key)
    else:
        installed = installed_envs()
        if name not in installed:
            raise ConfigError(f"config key {key!r}={name!r}: {_allowed(installed)}")
        cls = load_installed(installed[name], key)
    if not callable(cls):
        raise ConfigError(f"config key {key!r}={name!r}: names a {type(cls).__name__}, not a class")
    return cls


def _allowed(installed: dict) -> str:
    return (
        f"allowed: {', '.join(ENVS)}, a file.py:Class or package.module:Class path, or a name installed packages "
        f"register (entry points {ENTRY_POINTS}: {', '.join(sorted(installed)) or 'none installed'})"
    )


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` checked against the constructor of environment ``name``: known names, required ones present, values
    of the annotated types (ints pass as floats). Returns them coerced; ConfigError names the key otherwise."""
    from moerl.config import coerce

    cls = env_class(name)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"environment {name!r} (env.kwargs): {e}") from e
    except ValueError:  # no signature to read: the call says
        return kwargs
    try:
        hints = typing.get_type_hints(cls.__init__ if isinstance(cls, type) else cls)
    except Exception:  # the user's annotations do not resolve here: the values go as they are
        hints = {}
    return {k: coerce(f"env.kwargs.{k}", v, hints[k]) if k in hints else v for k, v in kwargs.items()}


def check_env(env: Any, name: str) -> None:
    """Refuse, by name, an object that is not an environment: one without ``problems``, a multi-turn one (with
    ``start``) without ``step`` or a ``max_turns`` >= 1."""
    needs = ("problems", "step") if hasattr(env, "start") else ("problems",)
    missing = [a for a in needs if not callable(getattr(env, a, None))]
    if missing:
        raise ConfigError(f"environment {name!r} has no {' or '.join(missing)} method (see moerl.envs.Environment)")
    turns = getattr(env, "max_turns", None) if hasattr(env, "start") else 1
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ConfigError(f"environment {name!r}: a multi-turn environment needs max_turns, an int >= 1, got {turns!r}")


def make_env(name: str, **kwargs: Any) -> Environment | MultiTurnEnvironment:
    """The environment ``name`` (see :func:`env_class`) built with ``kwargs``; ConfigError for an unknown name or
    argument, and naming the environment where the user's constructor raises or builds no environment."""
    if name not in ENVS and not is_code_path(name) and name not in (installed := installed_envs()):
        raise ConfigError(f"unknown environment {name!r}; {_allowed(installed)}")
    kwargs = check_env_kwargs(name, kwargs)
    cls = env_class(name)
    try:
        env = cls(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        if name in ENVS:
            raise
        raise ConfigError(f"environment {name!r}: building it raised {type(e).__name__}: {e}") from None
    check_env(env, name)
    return env


__all__ = [
    "ENVS",
    "ArithmeticEnv",
    "CalculatorToolEnv",
    "ConfigError",
    "CountdownEnv",
    "DatasetEnv",
    "Environment",
    "Evaluated",
    "ExprError",
    "MathEnv",
    "MultiTurnEnvironment",
    "Problem",
    "ReasoningGymEnv",
    "VerifiersEnv",
    "check_env",
    "check_env_kwargs",
    "env_class",
    "evaluate",
    "make_env",
    "safe_reward",
    "safe_rewards",
]
