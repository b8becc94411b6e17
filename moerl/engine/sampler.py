"""Sampling: temperature, top-k, top-p, min_tokens, per-sequence seeded generators, sampled-token logprobs."""

from __future__ import annotations

import torch

from moerl.device import to_device
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
    logits, device = logits.float(), logits.device
    # every host-made input first, so they reach the device in one copy: temperatures, top-k / top-p, the uniforms
    host = [torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])]
    top = any(p.top_k > 0 or p.top_p < 1 for p in params)
    if top:
        host += [torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params])]
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        # inverse-CDF sampling with one uniform per row from the row's own generator (or the engine's): one
        # batched search in place of a multinomial call per row (the sampler's cost at 100+ rows)
        seeded = [generators[i].next() if generators[i] is not None else 0.0 for i in drawn]
        u = torch.tensor(seeded, dtype=torch.float64)
        shared = [j for j, i in enumerate(drawn) if generators[i] is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=fallback, dtype=torch.float64)
        host += ([] if len(drawn) == len(params) else [torch.tensor(drawn)]) + [u]
    on_device = to_device(host, device)
    temps = on_device[0]
    z = logits / temps[:, None]
    logp = z.log_softmax(-1)
    masked = z
    for i, p in enumerate(params):  # min_tokens: no stop token yet
        if num_generated[i] < p.min_tokens:
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos or eos_id is None else [eos_id])
            if stops:
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
        cdf = masked[rows].softmax(-1).double().cumsum(-1)
        total = cdf[:, -1]
        # u < 1, so the point lies below the total mass (nextafter: never equal to it after rounding): the first
        # token whose cumulative mass exceeds it has a nonzero probability
        point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cdf, point[:, None], right=True).squeeze(1)
        if every:
            tokens = picked
        else:
            tokens[rows] = picked
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
