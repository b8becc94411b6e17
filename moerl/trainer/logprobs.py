"""Per-token logprobs (and entropies) from a model's logits: of a batch as it is, or computed on its packed rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerl.trainer.batch import Batch
from moerl.trainer.packing import Packing


def next_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor, temperature: float, entropy: bool
):
    """fp32 logprobs [B, T] of ``input_ids``' tokens given the ones before them in ``logits`` [B, T, V] (the first
    place 0), times ``keep`` [B, T]; with ``entropy`` also each place's entropy (times ``keep``)."""
    logp_all = (logits[:, :-1].float() / temperature).log_softmax(-1)
    lp = F.pad(logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0)) * keep
    ent = None
    if entropy:
        ent = F.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0)) * keep
    return lp, ent


def token_logprobs(logits: torch.Tensor, mb: Batch, temperature: float, entropy: bool):
    """fp32 logprobs [B, T] of ``mb``'s tokens from ``logits`` [B, T, V] (0 at position 0 and on padding), and the
    entropy of each position's distribution when ``entropy``."""
    return next_token_logprobs(logits, mb.input_ids, mb.attention_mask, temperature, entropy)


def packed_logprobs(model, mb: Batch, pk: Packing, replay: bool, adapters, temperature: float, entropy: bool):
    """``token_logprobs`` of ``mb`` computed on its packed rows ``pk`` (see ``moerl.trainer.packing``)."""
    b, t = mb.input_ids.shape
    routed = None
    if replay and mb.replay is not None:  # checked in the batch's own shape, then packed with the tokens
        routed = pk.pack(model.check_replay(mb.replay, b, t), -1)
    if isinstance(adapters, torch.Tensor):  # a slot per sequence -> per token; padding takes any slot (dropped)
        adapters = pk.pack(adapters[:, None].expand(b, t), int(adapters[0]))
    ids = pk.pack(mb.input_ids, 0)
    out = model(ids, positions=pk.positions, attention_mask=pk.segment, replay=routed, adapters=adapters)
    seg = pk.segment
    # a place continues its sequence: its logprob is the next token's under the same sequence
    keep = F.pad((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), (1, 0))
    lp, ent = next_token_logprobs(out.logits, ids, keep, temperature, entropy)
    return pk.unpack(lp, (b, t)), (pk.unpack(ent, (b, t)) if entropy else None)
