"""Per-token logprobs (and entropies) of a batch as it is, or computed on its packed rows, from the model's final
hidden states through its head in chunks of tokens: the [tokens, vocab] logits are never whole (a 16k-token sequence
at a 152k vocabulary would hold 9.3 GiB of them in fp32, and as much again for their gradient)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from moerl.trainer.batch import Batch
from moerl.trainer.packing import Packing

# ``entropy`` as a value the loss reports, with no gradient (an entropy bonus needs ``entropy=True``)
ENTROPY_METRIC = "metric"


@dataclass(slots=True)
class LogprobHead:
    """What a forward asks of the model's final hidden states (``MoEModel.forward``'s ``head``): each next token's
    fp32 logprob [B, T] (0 at position 0, times ``keep``) and, with ``entropy``, each place's entropy (differentiable;
    ``ENTROPY_METRIC``: its value alone).

    The head's logits are made ``chunk`` tokens at a time (0: all at once), fp32 math inside each chunk; under
    autograd a chunk keeps only its inputs and is computed again in the backward (``torch.utils.checkpoint``), so at
    most one chunk's [chunk, V] logits exist in the forward or the backward."""

    ids: torch.Tensor  # [B, T] the tokens: each place's target is the next one
    keep: torch.Tensor  # [B, T] which places count
    temperature: float
    entropy: bool | str
    chunk: int = 0
    # ids and keep are each place's target and whether it counts, and the results are per place, unshifted (a part
    # of the rows' places: ``part``)
    targets: bool = False

    def part(self, start: int, stop: int) -> LogprobHead:
        """The head of places ``[start, stop)`` of the rows alone (context parallelism: one rank's part of the
        tokens): each place's result is its next token's, 0 past the rows' end. ``from_next`` of the parts' results
        laid side by side is this head's result."""
        width = stop - start
        ids, keep = self.ids[:, start + 1 : stop + 1], self.keep[:, start + 1 : stop + 1]
        ids, keep = (F.pad(z, (0, width - z.shape[1])) for z in (ids, keep))
        return LogprobHead(ids, keep, self.temperature, self.entropy, self.chunk, targets=True)

    @staticmethod
    def from_next(lp: torch.Tensor, ent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This head's results from every place's next-token results [B, T] (``part``'s, side by side)."""
        return F.pad(lp[:, :-1], (1, 0)), (F.pad(ent[:, :-1], (1, 0)) if ent is not None else None)

    def __call__(self, model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t, h = x.shape
        rows = (x if self.targets else x[:, :-1]).reshape(-1, h)
        targets = (self.ids if self.targets else self.ids[:, 1:]).reshape(-1)
        n = rows.shape[0]
        if not self.chunk or n <= self.chunk:
            lp, ent = _chunk(model, rows, targets, self.temperature, self.entropy)
        else:
            grad = torch.is_grad_enabled() and rows.requires_grad
            parts = []
            for i in range(0, n, self.chunk):
                args = (model, rows[i : i + self.chunk], targets[i : i + self.chunk], self.temperature, self.entropy)
                parts.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
            lp = torch.cat([p[0] for p in parts])
            ent = torch.cat([p[1] for p in parts]) if self.entropy else None
        if self.targets:
            return lp.view(b, t) * self.keep, (ent.view(b, t) * self.keep if ent is not None else None)
        lp = F.pad(lp.view(b, t - 1), (1, 0)) * self.keep
        return lp, (F.pad(ent.view(b, t - 1), (1, 0)) * self.keep if ent is not None else None)


def _chunk(model, rows: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool | str):
    """fp32 logprobs of ``targets`` [N] (and entropies) under the head's logits of ``rows`` [N, H]."""
    logp = (model.logits(rows).float() / temperature).log_softmax(-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    if not entropy:
        return lp, None
    if entropy == ENTROPY_METRIC:  # a value only: no graph keeping [N, V] tensors for a backward that never comes
        with torch.no_grad():
            return lp, -(logp.exp() * logp).sum(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def batch_head(mb: Batch, temperature: float, entropy: bool, chunk: int = 0) -> LogprobHead:
    """The head of ``mb``'s rows as they are (a pipeline's last stage takes it: ``LayoutConfig.head``)."""
    return LogprobHead(mb.input_ids, mb.attention_mask, temperature, entropy, chunk)


def token_logprobs(
    model, mb: Batch, replay: bool, adapters, temperature: float, entropy: bool, chunk: int = 0, causal: bool = False
):
    """fp32 logprobs [B, T] of ``mb``'s tokens (0 at position 0 and on padding) through ``model`` as the rows are,
    and each position's entropy when ``entropy``. ``causal``: the rows have no padding (the caller knows it on the
    host), so the model attends plainly causally and makes no [T, T] mask (1 GiB at 32k tokens, for every row in
    flight)."""
    head = batch_head(mb, temperature, entropy, chunk)
    replayed = mb.replay if replay else None
    mask = None if causal else mb.attention_mask
    return model(mb.input_ids, attention_mask=mask, replay=replayed, adapters=adapters, head=head).head


def packed_logprobs(
    model, mb: Batch, pk: Packing, replay: bool, adapters, temperature: float, entropy: bool, chunk: int = 0
):
    """``token_logprobs`` of ``mb`` computed on its packed rows ``pk`` (see ``moerl.trainer.packing``)."""
    b, t = mb.input_ids.shape
    routed = None
    if replay and mb.replay is not None:  # checked in the batch's own shape, then packed with the tokens
        routed = pk.pack(model.check_replay(mb.replay, b, t), -1)
    if isinstance(adapters, torch.Tensor):  # a slot per sequence -> per token; padding takes any slot (dropped)
        adapters = pk.pack(adapters[:, None].expand(b, t), int(adapters[0]))
    ids = pk.pack(mb.input_ids, 0)
    seg = pk.segment
    # a place continues its sequence: its logprob is the next token's under the same sequence
    keep = F.pad((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), (1, 0))
    head = LogprobHead(ids, keep, temperature, entropy, chunk)
    out = model(ids, positions=pk.positions, attention_mask=seg, replay=routed, adapters=adapters, head=head)
    lp, ent = out.head
    return pk.unpack(lp, (b, t)), (pk.unpack(ent, (b, t)) if entropy else None)
