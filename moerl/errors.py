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


class RequestError(MoerlError, ValueError):
    """A request cannot be served as given (empty prompt, unknown adapter, token outside the vocabulary)."""


class RunDirError(MoerlError, RuntimeError):
    """A run directory cannot be used as asked: it holds another run, another process owns it, or it is unwritable."""


class TrainingStopped(MoerlError, RuntimeError):
    """Training cannot go on (non-finite loss, logprobs or weights); the last good checkpoint is on disk."""


class OutOfMemory(MoerlError, MemoryError):
    """A trainer rank ran out of memory in a step; the message names the rank, the stage and the batch, and what to
    lower."""


class Preempted(MoerlError):
    """A scheduler's signal (SIGTERM, SIGUSR1) stopped the run after its last complete step was saved."""

    exit_code = 143


class EngineError(MoerlError, RuntimeError):
    """A rollout engine process failed: it died, did not start, or raised something unexpected."""


class SharedMemoryFull(EngineError):
    """The shared memory a transfer to engine processes needs is not there (e.g. a container's small /dev/shm)."""


class EngineDied(EngineError):
    """An engine its runtime restarts (a Ray actor) died while answering; the pool revives it."""
