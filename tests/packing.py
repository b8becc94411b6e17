"""Packed rows keep their sequences apart: a check shared by the mixers' tests (recurrent states, indexers)."""

import torch
from hf_models import VOCAB

FP32_TOL = 1e-4


def _ids(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


def assert_packed_sequences_stay_apart(model, first: int = 23, second: int = 14, pad: int = 5, left: int = 9) -> None:
    """Two sequences packed in one row (attention_mask 1, 1, ..., 2, 2, ..., 0 padding) give each sequence's own
    logits, as does a left-padded row (fp32 1e-4). Negative control: the same row without sequence numbers lets the
    second sequence see the first (one state through both, or keys chosen among both)."""
    a, b = _ids(first, 5), _ids(second, 6)
    n = first + second
    with torch.no_grad():
        alone = [model(x).logits[0] for x in (a, b)]
        row = torch.cat([a, b, torch.zeros(1, pad, dtype=torch.long)], 1)
        mask = torch.tensor([[1] * first + [2] * second + [0] * pad])
        pos = torch.cat([torch.arange(first), torch.arange(second), torch.zeros(pad, dtype=torch.long)])[None]
        packed = model(row, positions=pos, attention_mask=mask).logits[0]
        assert (packed[:first] - alone[0]).abs().max() <= FP32_TOL
        assert (packed[first:n] - alone[1]).abs().max() <= FP32_TOL
        padded = torch.cat([torch.zeros(1, left, dtype=torch.long), b], 1)
        lmask = torch.tensor([[0] * left + [1] * second])
        lpos = torch.cat([torch.zeros(left, dtype=torch.long), torch.arange(second)])[None]
        out = model(padded, positions=lpos, attention_mask=lmask).logits[0, left:]
        assert (out - alone[1]).abs().max() <= FP32_TOL
        joined = model(row[:, :n]).logits[0]
        assert (joined[first:n] - alone[1]).abs().max() > FP32_TOL
