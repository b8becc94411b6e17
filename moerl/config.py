"""Run configuration: nested dataclasses loaded from YAML plus dotted ``key.sub=value`` overrides, validated.

An unknown key is an error that names it and the closest valid keys; a value of the wrong type names the key,
the expected type and the value. The resolved config is written to the run directory.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import keyword
import math
import os
import types
import typing
from pathlib import Path

import yaml

from moerl.errors import ConfigError


def require(key: str, rules) -> None:
    """The one way a config checks its values, in its ``__post_init__``: ``rules`` are ``(field, value, ok, rule)``;
    the first whose ``ok`` is false raises a ConfigError naming the field as the user writes it (``key`` with ``{}``
    for the field: ``optim.{}``, ``EngineConfig.{}``, ``config key 'rollout.{}'``), its value and the rule."""
    for name, value, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{key.format(name)}={value!r}: {rule}")


def finite(x) -> bool:
    """A finite real number (not a bool's stand-in for one: bools are ints, and pass)."""
    return isinstance(x, int | float) and math.isfinite(x)


def describe(t) -> str:
    """What a config value of annotation ``t`` may be, in words: its type, or every value a choice allows."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(t))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
    if t is type(None):
        return "null"
    if t is bool:
        return "bool (true or false)"
    if origin in (list, tuple):
        return "a list"
    if origin is dict or t is dict or dataclasses.is_dataclass(t):
        return "a mapping"
    return getattr(t, "__name__", str(t))


def quoted(value) -> str:
    """For a rule's message: the value's type where a string stands for a boolean or a number (quoted in YAML)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
        return f" (got the string {value!r}: write it unquoted for the boolean)"
    return f" (got {type(value).__name__} {value!r})" if not isinstance(value, str) else ""


def _wrong_type(key: str, value, t) -> ConfigError:
    """The one message of a value of the wrong type: the key, what it may be, the value and its type."""
    return ConfigError(f"config key {key!r} must be {describe(t)}, got {type(value).__name__} {value!r}")


def coerce(key: str, value, t):
    """``value`` as type ``t`` (a dataclass, a builtin, a list/dict annotation, a Literal choice, or a Union of
    those). A value of another type is refused naming its type and what the key takes (every value of a choice); a
    choice's value of the right type but not allowed is left to its section's rule, which names the allowed ones."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(key, value, a)
            except ConfigError as e:
                if dataclasses.is_dataclass(a) and isinstance(value, dict):
                    raise e  # the mapping's own key or value is wrong: that is the message
        raise _wrong_type(key, value, t)
    if origin is typing.Literal:
        if any(type(value) is type(a) for a in typing.get_args(t)):
            return value
        raise _wrong_type(key, value, t)
    if dataclasses.is_dataclass(t):
        if isinstance(value, t):
            return value
        if not isinstance(value, dict):
            raise _wrong_type(key, value, t)
        return from_dict(t, value, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(key, value, t)
        (inner,) = typing.get_args(t)[:1] or (typing.Any,)
        return [v if inner is typing.Any else coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if origin is dict or t is dict:
        if not isinstance(value, dict):
            raise _wrong_type(key, value, t)
        return dict(value)
    if t is typing.Any:
        return value
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is float and isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if t in (int, float) and isinstance(value, bool) or not isinstance(value, t):
        raise _wrong_type(key, value, t)
    return value


def config_key(field_name: str) -> str:
    """The config key of a dataclass field: a Python keyword is spelt with a trailing ``_`` in code only
    (``async_`` is ``algo.async`` in a config file)."""
    bare = field_name.removesuffix("_")
    return bare if bare != field_name and keyword.iskeyword(bare) else field_name


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict, checking keys and types; missing keys keep their defaults."""
    hints = typing.get_type_hints(cls)
    fields = {config_key(f.name): f.name for f in dataclasses.fields(cls)}
    names = list(fields)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown config key {prefix + key!r}{hint} (valid here: {', '.join(names)})")
        kwargs[fields[key]] = coerce(prefix + key, value, hints[fields[key]])
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own range check: say where the section sits in the file
        if not prefix:
            raise
        raise ConfigError(f"{e} (config section {prefix.rstrip('.')!r})") from None


def to_dict(obj) -> dict:
    """The config as nested dicts under its config keys (what ``from_dict`` reads back)."""
    return {config_key(f.name): _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _plain(value):
    """A config value as YAML writes it: sections (in lists too, as ``env.rewards``) as dicts."""
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def set_dotted(data: dict, dotted: str, value) -> None:
    node = data
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[last] = value


def load_config(cls, path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()):
    """``cls`` from a YAML file (optional) and ``key.sub=value`` overrides (values parsed as YAML scalars)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} is not a file")
        data = _yaml(path.read_text(errors="replace"), f"config file {str(path)!r}") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping, got {type(data).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        set_dotted(data, key.strip(), _yaml(raw, f"override {item!r}"))
    return from_dict(cls, data)


def _yaml(text: str, what: str):
    """``text`` parsed as YAML; ConfigError naming ``what`` and the line and column of a syntax error."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{what} is not valid YAML{where}: {problem}") from None


def save_config(obj, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
