"""Requests, the sequences they sample, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moerl.engine.config import SamplingParams
from moerl.engine.sampler import SeededDraws


@dataclass(slots=True)
class Request:
    """One prompt (token ids, or text with the checkpoint's tokenizer), how to sample it, and an optional adapter."""

    prompt: list[int] | str
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    request_id: str | None = None


@dataclass(slots=True)
class Completion:
    """One sample of a request."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: torch.Tensor | None  # [G] fp32, sampled-token logprob after temperature
    # stop | length (max_tokens) | context (the context window, max_model_len, cut it before max_tokens) | error (its
    # request failed: RequestOutput.error)
    finish_reason: str
    routed_experts: torch.Tensor | None  # [T-1, L_moe, k] uint8 (int16 when E > 256), prompt rows included


@dataclass(slots=True)
class RequestOutput:
    """What one request produced. ``error`` says why it failed (None: it did not), naming the request;
    ``error_kind`` is "rejected" (it never ran: the prompt is empty or does not fit the context window or the cache) or
    "non_finite" (its logits went NaN / inf while it ran: its completions so far come back, ending in "error")."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    weight_version: int
    error: str | None = None
    error_kind: str | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample in flight: its tokens (prompt + generated), cache blocks and what it has produced."""

    group: Group
    index: int
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1  # its linear-attention states' slot (LinearStates), for a model with such layers
    num_cached: int = 0  # tokens whose keys/values are in the cache
    logprobs: list[float] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)  # [L_moe, k] per generated token that ran (numpy views)
    generator: SeededDraws | None = None  # its seeded uniforms (SamplingParams.seed), else the engine's
    finish_reason: str | None = None
    text: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.group.prompt)


@dataclass(slots=True, eq=False)
class Group:
    """A request in flight: its prompt is prefilled once (by ``seqs[0]``), then its n samples share it."""

    order: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    adapter_slot: int  # -1: base model
    max_tokens: int  # params.max_tokens clipped to the context window
    seqs: list[Sequence] = field(default_factory=list)
    prompt_routed: list[torch.Tensor] = field(default_factory=list)  # [chunk, L_moe, k] per prefill chunk
    weight_version: int = 0
    adapter: str | None = None
    error: str | None = None  # set when the group failed while running (see RequestOutput)
    error_kind: str | None = None

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)
