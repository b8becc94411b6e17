"""Sampling: temperature, top-k, top-p, min_tokens, per-sequence seeded generators, sampled-token logprobs."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from moerl.cpu.kernels import KINDS, kernel
from moerl.device import host_tensor, to_device
from moerl.engine.config import SamplingParams


class SeededDraws:
    """The uniforms of one seeded sample: its own generator's float64 stream, drawn ``CHUNK`` at a time (the same
    numbers one draw a token would give: a CPU generator's ``rand(n)`` is ``n`` single draws in order), so a step
    reads a number per row instead of calling the generator per row."""

    __slots__ = ("generator", "drawn", "used")
    CHUNK = 32

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn: list[float] = []
        self.used = 0

    def next(self) -> float:
        """The stream's next uniform in [0, 1)."""
        if self.used == len(self.drawn):
            self.drawn = torch.rand(self.CHUNK, generator=self.generator, dtype=torch.float64).tolist()
            self.used = 0
        self.used += 1
        return self.drawn[self.used - 1]


def sequence_generator(seed: int | None, sample_index: int) -> SeededDraws | None:
    """The uniforms of sample ``sample_index`` of a request seeded with ``seed`` (None: the engine's generator)."""
    if seed is None:
        return None
    return SeededDraws(hash((seed, sample_index)) & (2**63 - 1))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[SeededDraws | None],
    num_generated: list[int],
    eos_id: int | None,
    fallback: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [M] and their logprobs [M] (fp32, log-softmax of logits / temperature) for logits [M, V], on the
    logits' device. The seeded draws are the host's: one uniform per sampled row comes from them."""
    device = logits.device
    # every host-made input first, so they reach the device in one copy: temperatures, top-k / top-p, the uniforms.
    # One request's rows (or requests sharing their params) ask their params once
    first = params[0] if params else None
    if first is not None and all(p is first for p in params):
        temps = torch.full((len(params),), first.temperature if first.temperature > 0 else 1.0)
        top = first.top_k > 0 or first.top_p < 1
        drawn = list(range(len(params))) if first.temperature > 0 else []
        stops = _stops(first, eos_id) if first.min_tokens > 0 else []
        masks = [(i, stops) for i, n in enumerate(num_generated) if n < first.min_tokens] if stops else []
    else:
        temps = host_tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], np.float32)
        top = any(p.top_k > 0 or p.top_p < 1 for p in params)
        drawn = [i for i, p in enumerate(params) if p.temperature > 0]
        # min_tokens: no stop token yet
        masks = [
            (i, stops) for i, p in enumerate(params) if num_generated[i] < p.min_tokens and (stops := _stops(p, eos_id))
        ]
    u = _uniforms(drawn, generators, fallback)
    if not top and not masks and device.type == "cpu" and logits.dtype in KINDS and kernel() is not None:
        return _one_call(logits, temps, drawn, u)
    host = [temps]
    if top:
        host += [host_tensor([p.top_k for p in params], np.int64), host_tensor([p.top_p for p in params], np.float32)]
    if drawn:
        host += ([] if len(drawn) == len(params) else [host_tensor(drawn, np.int64)]) + [u]
    on_device = to_device(host, device)
    z = logits.float() / on_device[0][:, None]
    logp = z.log_softmax(-1)
    masked = z
    for i, stops in masks:
        masked = masked.clone() if masked is z else masked
        masked[i, stops] = float("-inf")
    if top:
        top_k, top_p = on_device[1:3]
        ordered, order = masked.sort(dim=-1, descending=True)
        rank = torch.arange(ordered.shape[1], device=device)[None, :]
        drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        probs = ordered.softmax(-1)
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]  # keep the smallest prefix reaching top_p
        masked = torch.full_like(masked, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    every = len(drawn) == len(params)
    tokens = None if every else masked.argmax(-1)  # temperature 0: greedy (no row of a sampled batch needs it)
    if drawn:
        u, rows = on_device[-1], slice(None) if every else on_device[-2]
        picked = inverse_cdf(masked[rows].softmax(-1), u)
        if every:
            tokens = picked
        else:
            tokens[rows] = picked
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


BLOCK = 1024  # tokens a block of ``inverse_cdf``'s first level


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of ``probs`` [M, V] (fp32) the first token whose cumulative mass (in fp64) exceeds ``u`` [M]
    (float64 in [0, 1)) times the row's total. The rule of a float64 cumulative sum over the whole vocabulary, found
    in two levels so that no [M, V] float64 tensor is made or scanned: the mass of each block of ``BLOCK`` tokens
    (fp32 read, fp64 sums), their cumulative sum, the block the point falls in, then the cumulative sum inside it.
    The sums differ from one long scan's only by fp64 reassociation. A row that is not finite gets a token in range."""
    m, v = probs.shape
    full = v - v % BLOCK
    sums = probs[:, :full].view(m, -1, BLOCK).sum(-1, dtype=torch.float64)
    if full < v:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    ends = sums.cumsum(-1)  # [M, blocks]: the mass up to each block's end
    total = ends[:, -1]
    # u < 1, so the point lies below the total mass (nextafter: never equal to it after rounding): the first
    # token whose cumulative mass exceeds it has a nonzero probability
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))[:, None]
    block = torch.searchsorted(ends, point, right=True).clamp_(max=ends.shape[1] - 1)  # [M, 1]
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * BLOCK + torch.arange(BLOCK, device=probs.device)
    inside = probs.gather(1, cols.clamp(max=v - 1)).masked_fill_(cols >= v, 0)
    cdf = before + inside.double().cumsum(-1)
    inside_block = torch.searchsorted(cdf, point, right=True).clamp_(max=BLOCK - 1)
    return (block * BLOCK + inside_block).squeeze(1).clamp_(max=v - 1)


def _stops(p: SamplingParams, eos_id: int | None) -> list[int]:
    """The tokens ``min_tokens`` holds back: the request's stop tokens and the end of sequence (unless ignored)."""
    return list(p.stop_token_ids) + ([] if p.ignore_eos or eos_id is None else [eos_id])


def _uniforms(drawn: list[int], generators: list[SeededDraws | None], fallback: torch.Generator) -> torch.Tensor:
    """One float64 uniform per sampled row (``drawn``), from the row's own generator or the engine's: inverse-CDF
    sampling, one batched search in place of a multinomial call per row (the sampler's cost at 100+ rows)."""
    u = host_tensor([generators[i].next() if generators[i] is not None else 0.0 for i in drawn], np.float64)
    shared = [j for j, i in enumerate(drawn) if generators[i] is None]
    if shared:
        u[shared] = torch.rand(len(shared), generator=fallback, dtype=torch.float64)
    return u


def _one_call(
    logits: torch.Tensor, temps: torch.Tensor, drawn: list[int], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample``'s tokens and logprobs for CPU logits without top-k / top-p or held-back tokens, in one kernel call
    (``moerl_sample``: the same rule as the torch ops below, its sums in its own order: logprobs within fp32
    rounding of theirs) where those ops take a dozen calls a step."""
    n, v = logits.shape
    rows = logits.contiguous()  # kept while the kernel reads it
    every = u
    if len(drawn) < n:
        every = torch.full((n,), -1.0, dtype=torch.float64)  # -1: greedy
        every[torch.tensor(drawn, dtype=torch.int64)] = u
    tokens, logprobs, work = (
        torch.empty(n, dtype=torch.int64),
        torch.empty(n),
        torch.empty(torch.get_num_threads(), 3 * v),
    )
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    kernel().moerl_sample(
        ptr(rows.data_ptr()),
        i32(KINDS[rows.dtype]),
        i32(n),
        i32(v),
        *(ptr(t.data_ptr()) for t in (temps, every, tokens, logprobs, work)),
        i32(torch.get_num_threads()),
    )
    return tokens, logprobs
