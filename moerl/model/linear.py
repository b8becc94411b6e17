"""The model's projections: the linear layers a training mode may swap for its own (``moerl.model.lora``'s
``LoraLinear``, ``moerl.model.mx``'s ``MXLinear``). The head and the small gates are plain ``nn.Linear``: no mode
touches them."""

from torch import nn


class Linear(nn.Linear):
    """A projection of attention or of an MLP (``nn.Linear``; the class marks what modes and backends may swap)."""
