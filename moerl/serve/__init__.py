"""An OpenAI-compatible server over moerl's engine (``moerl serve``; a run's agent environments): FastAPI routes
(``app``), one thread driving the engine in batches (``batcher``), uvicorn on a socket (``run``)."""

from moerl.serve.app import OpenAIServer
from moerl.serve.batcher import Batcher
from moerl.serve.protocol import OpenAIError
from moerl.serve.run import LOOPBACK, Listening

__all__ = ["LOOPBACK", "Batcher", "Listening", "OpenAIError", "OpenAIServer"]
