"""Engine and sampling configuration, validated on construction with errors that name the field."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field

from moerl.config import require
from moerl.errors import ConfigError


@dataclass(slots=True)
class SamplingParams:
    """How one request is sampled. ``temperature`` 0 is greedy.

    Logprobs are of the sampled token under the model's distribution after temperature (fp32 log-softmax of
    logits / temperature; temperature 0 counts as 1), before top-k / top-p / min_tokens masking, so they are the
    numbers the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings; the text ends before them
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ConfigError:
            return ConfigError(f"SamplingParams.{name}={getattr(self, name)!r}: {rule}")

        # types first (int-valued numpy / torch scalars become ints), once per request: the decode loop trusts them
        for name in ("temperature", "top_p"):
            value = real_or_none(getattr(self, name))
            if value is None:
                raise bad(name, "must be a finite real number")
            setattr(self, name, value)
        for name in ("top_k", "max_tokens", "min_tokens", "n", "seed"):
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            value = int_or_none(value)
            if value is None:
                raise bad(name, "must be an int")
            setattr(self, name, value)
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")
        if not self.temperature >= 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must lie in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 = off)")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must lie in [0, max_tokens={self.max_tokens}]")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        # an empty stop string would match at once and end every completion empty
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", "must be non-empty strings (a str or a list of them)")
        self.stop = list(stops)
        ids = [int_or_none(t) for t in self.stop_token_ids] if isinstance(self.stop_token_ids, list | tuple) else [None]
        if None in ids:
            raise bad("stop_token_ids", "must be a list of int token ids")
        self.stop_token_ids = ids


def int_or_none(value) -> int | None:
    """``value`` as an int when it is one (int, numpy or torch integer scalar; not a bool), else None."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")).endswith("bool"):  # numpy / torch bools
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def real_or_none(value) -> float | None:
    """``value`` as a finite float when it is a real number (not a bool, str or None), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass(slots=True)
class EngineConfig:
    """KV cache, batching and adapter limits of the native engine.

    The KV cache is preallocated: ``num_blocks`` blocks of ``block_size`` tokens. By default it holds
    ``max_num_seqs`` sequences of ``max_model_len`` tokens; ``kv_cache_bytes`` caps it, and on a GPU without it
    ``kv_cache_memory`` (a fraction of the device memory free once the model is loaded) does (a budget that cannot
    hold one full-length sequence is refused).
    """

    max_num_seqs: int = 64
    max_model_len: int = 1024
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory: float = 0.9  # CUDA: the share of free device memory the KV cache may take (kv_cache_bytes unset)
    max_num_batched_tokens: int = 2048  # prefill tokens per step (longer prompts are prefilled in chunks)
    capture_routing: bool = True
    max_loras: int = 0  # adapter slots; 0 = LoRA off
    max_lora_rank: int = 16
    lora_layout: str = "per_expert"
    lora_targets: list[str] | None = None  # None: every linear layer and the experts
    fused_lora: bool = True  # False: the naive per-expert, per-adapter reference path
    # decode steps through one torch.compile graph (moerl.engine.compiled); "auto": eager until compile_decode()
    # (never where the eager step runs as bound kernel calls, moerl.cpu.direct: faster than the graph)
    compile_decode: bool | str = False
    # what one compiled graph covers: "step" the whole decode step, "layer" one decoder layer that every layer runs
    # (its compile does not grow with the depth; on CUDA the step is then captured as one CUDA graph a bucket);
    # "auto": "layer" on CUDA and past a few layers (moerl.engine.compiled.decode_scope), else "step"
    compile_scope: str = "auto"
    # the KV cache holds memory only inside generate(): a trainer on the same device gets it back between calls
    release_cache: bool = False
    seed: int = 0
    progress: bool | None = None  # tokens/s bar; None: on for long generations when stderr is a terminal

    def __post_init__(self) -> None:
        sizes = ("max_num_seqs", "max_model_len", "block_size", "max_num_batched_tokens", "max_lora_rank")
        compiled, memory, cache = self.compile_decode, self.kv_cache_memory, self.kv_cache_bytes
        rules = (
            *((name, getattr(self, name), getattr(self, name) >= 1, "must be >= 1") for name in sizes),
            ("max_loras", self.max_loras, self.max_loras >= 0, "must be >= 0"),
            (
                "compile_decode",
                compiled,
                isinstance(compiled, bool) or compiled == "auto",
                "allowed: True, False, 'auto'",
            ),
            (
                "compile_scope",
                self.compile_scope,
                self.compile_scope in ("auto", "step", "layer"),
                "allowed: 'auto', 'step', 'layer'",
            ),
            ("kv_cache_memory", memory, isinstance(memory, int | float) and 0 < memory <= 1, "must lie in (0, 1]"),
            ("release_cache", self.release_cache, isinstance(self.release_cache, bool), "must be True or False"),
            ("kv_cache_bytes", cache, cache is None or cache >= 1, "must be >= 1"),
        )
        require("EngineConfig.{}", rules)
        if self.release_cache and self.compile_decode is True:
            raise ConfigError(
                "EngineConfig.release_cache=True with compile_decode=True: not built (a captured decode graph holds "
                "the cache's addresses); set one of them False"
            )


def check_context(max_model_len: int, mcfg, key: str = "EngineConfig.max_model_len") -> None:
    """Refuse a context window longer than the model's (``max_position_embeddings`` of ModelConfig ``mcfg``): the
    native engine's rule at its start, which ``moerl plan`` applies to ``rollout.max_model_len`` as ``moerl train``
    meets it. ``key`` names the setting."""
    if max_model_len > mcfg.max_position_embeddings:
        raise ConfigError(
            f"{key}={max_model_len}: exceeds the model's max_position_embeddings={mcfg.max_position_embeddings}"
        )
