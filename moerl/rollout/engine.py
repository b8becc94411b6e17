"""The InferenceEngine protocol: what the loop, the generator and the weight sync ask of a rollout engine. The pool of
native engines (``moerl.rollout.pool``, in this process, in engine processes or Ray actors) and the vLLM engine
(``moerl.rollout.vllm``) implement all of it; a native ``LLMEngine`` its generation and weight part."""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

from moerl.engine import Request, RequestOutput


@runtime_checkable
class InferenceEngine(Protocol):
    """A rollout backend. Outputs carry sampled-token logprobs, routed experts and the weight version."""

    weight_version: int  # the version its outputs are produced under (the oldest of its engines')
    dense_weights: str | None  # None: it takes adapters and MX weights; else the dtype of the plain weights it takes
    restarts: int  # engines brought back after they died (Ray actors), in all
    requeued: int  # requests sent again to an engine brought back
    tokenizer: object  # the checkpoint's tokenizer (None: token ids only)

    def generate(self, requests: list[Request]) -> list[RequestOutput]: ...

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def discard_staged(self) -> None: ...

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def commit_weights(self, version: int) -> None: ...

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def add_adapter(self, name: str, source: str | os.PathLike | dict[str, torch.Tensor]) -> None: ...

    def decode_seconds(self) -> float: ...

    def decode_tokens(self) -> int: ...

    def decode_compile_seconds(self) -> float | None: ...

    def compile_decode(self, on: bool = True) -> bool: ...

    def close(self) -> None: ...
