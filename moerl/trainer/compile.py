"""The trainer's forward and backward compiled by region (``policy.compile``): each attention layer's attention half
(norms, projections with their LoRA slots, RoPE, attention, the residual) through one ``torch.compile`` graph
shared by every layer of the model (their parameters are the graph's inputs), its backward through the graph
AOTAutograd derives. The MoE half stays eager: its routing (R3 replay included) and grouped GEMMs depend on the
data, and its GEMMs already run near the machine's rate. Shapes are symbolic (``dynamic=True``), so the packed
rows' changing lengths reuse the graph instead of compiling again. Linear-attention layers (their packed-sequence
split is data-dependent) stay eager. Eager stays the reference (``tests/test_trainer_compile.py``).

``auto`` (the default): the loop times its first training steps and compiles when the steps left repay the
compilation: ``steps_left * GAIN * seconds_train >= COMPILE_SECONDS``.
"""

from __future__ import annotations

import torch
from torch.fx.experimental import _config as fx_config

from moerl.errors import ConfigError

# measured (BENCHMARKS.md, "Compiled training"): the share of a training step the compiled attention halves save
# (7% tiny fp32, 11% small bf16: 0.10 taken) and the compilation's cost on 2 cores from a cold cache (12-15 s)
GAIN = 0.10
COMPILE_SECONDS = 20.0


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each of ``model``'s attention layers for training; returns how many."""
    n = 0
    for layer in model.layers:
        if layer.compiled is None and model.config.layer_types[layer.self_attn.layer] != "linear":
            layer.compiled = _unducked(torch.compile(layer.block, dynamic=True))
            n += 1
    return n


def _unducked(compiled):
    """``compiled`` traced without duck sizing: by default dynamo gives equal sizes one symbol, so a packed length
    that happens to equal the hidden size (128 rows of a 128-wide model) would pin the length and compile again at
    the next one."""

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args)

    return call


def pays(steps_left: int, seconds_train: float) -> bool:
    """Whether compiling now saves more time over ``steps_left`` steps of ``seconds_train`` each than it costs."""
    return steps_left * GAIN * seconds_train >= COMPILE_SECONDS


def check(setting, ranks: int, mode: str, key: str = "policy.compile") -> None:
    """Refuse a ``policy.compile`` value that is not auto / true / false, and ``true`` on a parallel layout or in
    mode mxfp8."""
    if setting not in ("auto", True, False):
        raise ConfigError(f"{key}={setting!r}: allowed: auto, true, false")
    if setting is True and mode == "mxfp8":
        raise ConfigError(
            f"{key}=true with policy.mode=mxfp8: the MXFP8 projections' autograd functions (torchao's to_mx inside "
            "them) do not trace, so mxfp8 trains eager; set it to auto or false"
        )
    if setting is True and ranks > 1:
        raise ConfigError(
            f"{key}=true with {ranks} ranks: the compiled blocks are built for one process (FSDP / EP / PP layouts "
            "train eager); set it to auto or false"
        )
