"""Checks the token mixers' tests share (recurrent states, indexers): packed rows keep their sequences apart, the
engine's samples against full forwards, a knob moved off its loaded value."""

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


def assert_matches_transformers(model, hf, ids) -> torch.Tensor:
    """moerl's logits for ``ids`` within fp32 1e-4 of transformers' model ``hf``, every MoE layer's experts equal
    (R3's rows); returns transformers' logits."""
    from hf_models import hf_router_choices

    want, choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        out = model(ids, capture=True)
    assert (out.logits - want).abs().max() <= FP32_TOL
    for j, choice in enumerate(choices):
        ours = out.routed[:, :, j].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values), f"MoE layer {j} chose other experts"
    return want


def worst_sample(engine, outs, temperature: float = 0.8) -> tuple[float, bool]:
    """The largest k3 of any sample of ``outs`` against a full forward of its tokens, and whether every sample's
    routed experts equal that forward's."""
    from test_engine import full_forward_check

    checks = [
        full_forward_check(engine.model, type(out)(out.request_id, out.prompt_token_ids, [c], 0), temperature)
        for out in outs
        for c in out.outputs
    ]
    return max(kl for kl, _ in checks), all(ok for _, ok in checks)


def moved(model, ids, want, change) -> float:
    """How far ``model``'s logits for ``ids`` move from ``want`` with ``change()`` applied to its parameters (they
    are restored after)."""
    with torch.no_grad():
        saved = {n: p.clone() for n, p in model.named_parameters()}
        change()
        off = model(ids).logits
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return float((off - want).abs().max())
