"""Module swaps: how a mode (LoRA, MXFP8) replaces a plain module of the model from outside, as gpt-fast swaps
``nn.Linear`` for its quantized linear. The new module takes over the old one's parameters, buffers, submodules and
settings as they are (shared, not copied), so names, values and devices stay. A class that stands in for a plain
one from outside the model (a hardware backend's, ``moerl.cpu``) names that class as ``stands_for``: a mode's swap
takes over from it as from the plain class, and the backend installs its own class for the mode's afterwards. And
``state_of``: a module's state as it
is now, where ``state_dict()`` would change it."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def plain_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` is to the model and its modes: its own, or the plain class a backend's stands for."""
    return getattr(type(module), "stands_for", type(module))


def swapped(module: nn.Module, cls: type[M]) -> M:
    """A new ``cls`` module (a subclass of ``module``'s class, or of the class it stands for) holding ``module``'s
    state."""
    if not issubclass(cls, plain_class(module)):
        raise TypeError(f"{cls.__name__} does not extend {type(module).__name__}: it cannot take over its state")
    new = cls.__new__(cls)
    new.__dict__.update({k: v.copy() if isinstance(v, dict) else v for k, v in module.__dict__.items()})
    return new


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path`` (a dotted module name) of ``model``, counted in its ``swaps`` (what an engine's bound
    decode step, ``moerl.cpu.direct``, checks before each step)."""
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)
    model.swaps = getattr(model, "swaps", 0) + 1


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()``'s names and tensors (parameters, persistent buffers) without its hooks: FSDP2's
    pre-hook puts the sharded parameters back, which inside ``moerl.parallel.fsdp.gathered`` would make the whole
    weights sharded again on one rank (and every op on them a collective the other ranks never join)."""
    out = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        out |= {f"{dot}{n}": p for n, p in m._parameters.items() if p is not None}
        out |= {
            f"{dot}{n}": b for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set
        }
    return out
