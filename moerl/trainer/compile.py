"""The trainer's forward and backward compiled by decoder block (``policy.compile``): each attention layer whole
(norms, projections with their LoRA slots, RoPE, attention, the router in fp32, R3 replay, the expert grouped GEMMs
as ``moerl::group_mm`` with its registered backward, the shared expert, the residuals) through one
``torch.compile`` graph shared by every layer of the model (their parameters are the graph's inputs), its backward
through the graph AOTAutograd derives. Shapes are symbolic (``dynamic=True``, without duck sizing), so the packed
rows' changing lengths reuse the one graph instead of compiling again. Linear-attention layers (their
packed-sequence split is data-dependent) stay eager, and so does mode mxfp8 (refused: ``check``). Eager stays the
reference (``tests/test_trainer_compile.py``).

``auto`` (the default, ``AutoCompile``): the loop times its first training steps and compiles when the steps left
repay the compilation, ``steps_left * GAIN * seconds_train >= cost``; it times the compiled steps after and goes
back to eager where they are not faster. ``cost`` is what the same graph's first call took when it last compiled
here (``moerl.dynamo.price``: inductor's cache makes it cheaper the second time), else ``COMPILE_SECONDS``.
"""

from __future__ import annotations

import torch

from moerl.config import quoted
from moerl.dynamo import unducked
from moerl.errors import ConfigError
from moerl.model.mixers import is_recurrent

# GAIN: the share of a training step the compiled blocks are taken to save, below what a model large enough to gain
# saves (a tiny fp32 model loses: the trial after compiling catches it, and goes back to eager). COMPILE_SECONDS: what
# a compilation from a cold cache is taken to cost on a small host, for blocks never compiled here; those that were
# are priced at their last first call (moerl.dynamo's ledger)
GAIN = 0.15
COMPILE_SECONDS = 30.0
BLOCKS = "the trainer's decoder blocks"  # what the console calls them


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each of ``model``'s attention layers for training; returns how many."""
    n = 0
    for layer in model.layers:
        if layer.compiled is None and not is_recurrent(model.config.layer_types[layer.layer]):
            layer.compiled = unducked(torch.compile(layer.block, dynamic=True))
            n += 1
    return n


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Back to the eager layers."""
    for layer in model.layers:
        layer.compiled = None


class AutoCompile:
    """``policy.compile: auto`` over a run, fed each step's metrics row (``after``). Only steps that trained count
    (a step whose groups were all uninformative skips training and has no time). The second and third such steps
    train eager and are timed (training tokens/s); after the third the blocks compile if the steps left repay
    ``COMPILE_SECONDS`` at ``GAIN`` (``pays``). The two trained steps after the compiling one are timed as well,
    and the compiled blocks stay only if they trained faster (the best of two against the best of two: a busy
    moment slows one step, not both); where they did not (a model so small that launches outweigh the fused
    work), the run goes back to eager."""

    __slots__ = ("steps", "eager", "compiled", "trained", "trying")

    def __init__(self, steps: int):
        self.steps = steps
        self.eager: list[float] = []
        self.compiled: list[float] = []
        self.trained = 0  # steps that trained, since the run (or its resumption) started
        self.trying = False  # compiled here, not decided yet

    def after(self, policy, step: int, row: dict) -> str | None:
        """Act on step ``step``'s ``row``; returns what to tell the user, if anything."""
        rate = row.get("train_tokens_per_s")
        if rate is None:
            return None
        self.trained += 1
        k = self.trained
        if k in (2, 3):
            self.eager.append(rate)
        if k == 3:
            left, seconds = self.steps - step - 1, row["seconds_train"]
            self.trying = policy.compile_if_it_pays(left, seconds)
            if self.trying:  # priced as it decided: the record changes only when the compiling step ends
                return (
                    f"moerl: compiling {BLOCKS} (policy.compile: auto; {left} steps left at "
                    f"{seconds:.2f} s of training each repay {policy.compile_price()[1]})"
                )
        if self.trying and k in (5, 6):  # the 4th compiles
            self.compiled.append(rate)
        if self.trying and k == 6:
            self.trying = False
            ratio = max(self.compiled) / max(self.eager)
            if ratio > 1.0:
                return f"moerl: the compiled decoder blocks train {ratio:.2f}x as fast as eager: kept"
            policy.drop_compiled()
            return f"moerl: the compiled decoder blocks trained {ratio:.2f}x as fast as eager: back to eager"
        return None


def pays(steps_left: int, seconds_train: float, cost: float = COMPILE_SECONDS) -> bool:
    """Whether compiling now saves more time over ``steps_left`` steps of ``seconds_train`` each than its ``cost``
    (seconds)."""
    return steps_left * GAIN * seconds_train >= cost


def check(setting, ranks: int, mode, key: str = "policy.compile") -> None:
    """Refuse a ``policy.compile`` value that is not auto / true / false, and ``true`` on a parallel layout or in a
    mode (``moerl.modes.Mode``) whose training forward does not trace."""
    if not (isinstance(setting, bool) or setting == "auto"):  # not ``in``: 1 and 0 compare equal to True / False
        raise ConfigError(f"{key}={setting!r}: allowed: auto, true, false{quoted(setting)}")
    if setting is True and mode.untraced:
        raise ConfigError(
            f"{key}=true with policy.mode={mode.name}: {mode.untraced}, so {mode.name} trains eager; set it to auto "
            "or false"
        )
    if setting is True and ranks > 1:
        raise ConfigError(
            f"{key}=true with {ranks} ranks: the compiled blocks are built for one process (FSDP / EP / PP layouts "
            "train eager); set it to auto or false"
        )
