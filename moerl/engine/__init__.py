"""The native rollout engine: paged KV cache, continuous batching, routing capture, multi-adapter LoRA."""

from moerl.engine.config import EngineConfig, SamplingParams
from moerl.engine.engine import LLMEngine
from moerl.engine.sequence import Completion, Request, RequestOutput
from moerl.errors import RequestError

__all__ = ["Completion", "EngineConfig", "LLMEngine", "Request", "RequestError", "RequestOutput", "SamplingParams"]
