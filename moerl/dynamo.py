"""What moerl's ``torch.compile`` graphs share (the trainer's blocks, the engine's decode step)."""

from __future__ import annotations

from torch.fx.experimental import _config as fx_config


def unducked(compiled):
    """``compiled`` traced without duck sizing: by default dynamo gives equal sizes one symbol, so a size that
    happens to equal another (a packed length equal to the hidden size; a decode bucket of 16 rows beside the KV
    cache's 16-token blocks) is pinned to it, and the next size compiles again."""

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args)

    return call
