"""Training modes, one handler each: what trains, how it is kept and sent to the engines, what a run exports.

A new mode is one file: copy ``full.py`` (or ``mxfp8.py``, a mode built on it), override what differs, and add an
instance to ``MODES``. Outside this package nothing asks a mode's name; it asks the handler (``Policy.mode``).
"""

from moerl.errors import ConfigError
from moerl.modes.base import Mode
from moerl.modes.full import Full
from moerl.modes.lora import LoRA
from moerl.modes.mxfp8 import MXFP8

MODES: dict[str, Mode] = {m.name: m for m in (LoRA(), Full(), MXFP8())}


def mode_of(name: str, key: str = "policy.mode") -> Mode:
    """The handler of mode ``name``; a ConfigError naming ``key`` for a mode moerl does not build."""
    if name not in MODES:
        raise ConfigError(f"{key}={name!r}: allowed: {', '.join(MODES)}")
    return MODES[name]


__all__ = ["MODES", "Mode", "mode_of"]
