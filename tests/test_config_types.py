"""Every key of the run config, given a value of a type it does not take, is refused naming the value's type and what
the key takes (every allowed value where it is a choice); every choice, given a value of its type that it does not
allow, is refused naming every allowed value. A sweep over all keys: no message leaves them out."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from moerl.config import config_key, load_config
from moerl.errors import ConfigError
from moerl.run_config import RunConfig

# one value of each kind a YAML override can carry
WRONG = {"3": 3, "2.5": 2.5, "text": "text", "true": True, "[1]": [1], "{a: 1}": {"a": 1}, "null": None}


def _leaves(cls, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], prefix + config_key(f.name)
        if dataclasses.is_dataclass(t):
            yield from _leaves(t, key + ".")
        else:
            yield key, t


KEYS = list(_leaves(RunConfig))


def _takes(t, value) -> bool:
    """Whether annotation ``t`` takes a value of ``value``'s type (the test's own reading of the annotations)."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return any(_takes(a, value) for a in typing.get_args(t))
    if origin is typing.Literal:
        return any(type(value) is type(a) for a in typing.get_args(t))
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin is dict or t is dict:
        return isinstance(value, dict)
    if t is type(None):
        return value is None
    if t is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return type(value) is t


def _choices(t) -> tuple:
    """The values a choice allows (a Literal, alone or in a union), else ()."""
    if typing.get_origin(t) is typing.Literal:
        return typing.get_args(t)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return tuple(c for a in typing.get_args(t) for c in _choices(a))
    return ()


def _refusal(key: str, text: str) -> str | None:
    try:
        load_config(RunConfig, None, [f"{key}={text}"])
    except ConfigError as e:
        return str(e)
    return None


def test_the_sweep_covers_every_kind_of_key():
    kinds = {typing.get_origin(t) or t for _, t in KEYS}
    assert len(KEYS) > 100 and {str, int, float, bool, dict, typing.Literal} <= kinds
    assert len([k for k, t in KEYS if _choices(t)]) >= 20


@pytest.mark.parametrize(("key", "t"), KEYS, ids=[k for k, _ in KEYS])
def test_a_value_of_another_type_is_refused_naming_its_type_and_what_the_key_takes(key, t):
    for text, value in WRONG.items():
        if _takes(t, value) or (t is float and text == "text"):
            continue
        message = _refusal(key, text)
        assert message is not None, f"{key}={text} was taken"
        assert f"'{key}'" in message and f"got {type(value).__name__} " in message, message
        for allowed in _choices(t):
            assert repr(allowed) in message, f"{key}={text}: {allowed!r} missing from: {message}"


CHOICES = [(k, t) for k, t in KEYS if _choices(t)]


@pytest.mark.parametrize(("key", "t"), CHOICES, ids=[k for k, _ in CHOICES])
def test_a_choice_refuses_a_value_it_does_not_allow_naming_every_one_it_does(key, t):
    message = _refusal(key, "banana")
    assert message is not None and key.rsplit(".", 1)[-1] in message and "'banana'" in message, message
    for allowed in _choices(t):
        assert str(allowed).lower() in message, f"{key}: {allowed!r} missing from: {message}"


def test_a_quoted_boolean_is_told_it_is_a_string():
    for key in ("policy.compile", "rollout.compile_decode"):
        with pytest.raises(ConfigError, match=r"got the string 'true': write it unquoted for the boolean"):
            load_config(RunConfig, None, [f'{key}="true"'])


def test_the_sweep_catches_a_message_without_its_allowed_values(monkeypatch):
    """Negative control: with the choice's values dropped from the type message, the sweep's check fails."""
    import moerl.config

    monkeypatch.setattr(moerl.config, "describe", lambda t: "str")
    with pytest.raises(AssertionError, match="missing from"):
        test_a_value_of_another_type_is_refused_naming_its_type_and_what_the_key_takes(
            "rollout.placement", KEYS_BY["rollout.placement"]
        )


KEYS_BY = dict(KEYS)
