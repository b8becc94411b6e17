"""Errors moerl raises for bad input. Each message names the thing that is wrong."""


class MoerlError(Exception):
    """Base class of moerl's input errors."""


class ConfigError(MoerlError, ValueError):
    """A config key is missing, of the wrong type, or has a value outside what is allowed."""


class CheckpointError(MoerlError, ValueError):
    """A checkpoint directory or tensor cannot be used: missing, unexpected, mis-shaped or corrupt."""


class UnknownArchitectureError(MoerlError, KeyError):
    """No bridge serves this Hugging Face architecture."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class ReplayError(MoerlError, ValueError):
    """Replayed expert indices do not fit the forward: wrong shape or out of range."""
