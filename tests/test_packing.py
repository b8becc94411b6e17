"""Sequence packing in the trainer's forwards: the packed rows give the padded rows' logprobs, entropies and
gradients (fp32), for every architecture's attention (GQA, sliding windows, sinks, MLA), with R3 replay and per-row
adapter slots; a negative control shows the tolerance catches sequences that see each other."""

import pytest
import torch
from hf_models import ARCHS
from run_helpers import stepped_grads
from tolerances import logprobs_agree

from moerl.errors import ReplayError
from moerl.model.lora import LoraConfig
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.logprobs import LogprobHead
from moerl.trainer.losses import sft_loss
from moerl.trainer.packing import plan_packing


def ragged_batch(b=10, t=20, seed=0, vocab=100, replay_of=None):
    """Right-padded rows of lengths 3..t (the first full), a 3-token prompt, and (``replay_of`` a model) random
    replayed experts unlike its router's."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = torch.randint(4, vocab, (b, t), generator=g) * mask
    loss_mask = mask.clone()
    loss_mask[:, :3] = 0
    replay = None
    if replay_of is not None:
        cfg = replay_of.config
        n_moe = len(replay_of.moe_layer_ids)
        perms = [torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k] for _ in range(b * (t - 1) * n_moe)]
        replay = torch.stack(perms).view(b, t - 1, n_moe, cfg.top_k)
    return Batch(ids, mask, loss_mask, replay)


def test_plan_places_every_token_once_in_fewer_rows():
    mask = ragged_batch(b=16, t=24).attention_mask
    pk = plan_packing(mask)
    b, t = mask.shape
    real = mask.flatten().bool()
    rows, width = pk.segment.shape
    assert rows * width < b * t
    # src and dst are inverse on the real tokens; padding places point at the extra slot
    placed = pk.src.flatten()
    assert sorted(placed[placed < b * t].tolist()) == real.nonzero().squeeze(1).tolist()
    assert torch.equal(placed[pk.dst[real]], real.nonzero().squeeze(1))
    assert (pk.dst[~real] == rows * width).all()
    # each sequence sits contiguously with positions 0..n-1 under one segment number
    for i in range(b):
        n = int(mask[i].sum())
        at = pk.dst[i * t : i * t + n]
        assert torch.equal(at, torch.arange(int(at[0]), int(at[0]) + n))
        assert torch.equal(pk.positions.flatten()[at], torch.arange(n))
        assert len(set(pk.segment.flatten()[at].tolist())) == 1 and int(pk.segment.flatten()[at[0]]) > 0
    assert ((pk.segment == 0) == (pk.src == b * t)).all()


def test_plan_declines_full_rows_and_left_padding():
    assert plan_packing(torch.ones(4, 8, dtype=torch.long)) is None  # nothing to save
    left = torch.zeros(4, 8, dtype=torch.long)
    left[:, 5:] = 1
    assert plan_packing(left) is None  # not right-padded: not rearranged


# tolerances.py: fp32 1e-5; bf16 two logit rounding steps, mean 2e-3 (measured on AVX-512: max 2.8e-3, mean 4.3e-5;
# the leaky negative control: max 0.40, mean 0.07)


@pytest.mark.parametrize(("arch", "dtype"), [(a, "float32") for a in ARCHS] + [("Qwen3MoeForCausalLM", "bfloat16")])
def test_packed_forward_equals_the_padded_forward(arch, dtype, hf_checkpoints):
    """Logprobs and entropies with R3 replay, packed vs padded within the dtype's tolerance (fp32: 1e-5); the same
    packed rows with one attention mask over the whole row (sequences see their neighbours) differ by far more."""
    ckpt = hf_checkpoints[arch][0]
    padded, packed = (
        Policy(ckpt, PolicyConfig(mode="full", dtype=dtype, micro_batch_size=16, packing=p)) for p in (0, 1)
    )
    batch = ragged_batch(replay_of=padded.model)
    assert plan_packing(batch.attention_mask) is not None
    for replay in (True, False):
        want_lp, want_ent = padded.forward_logprobs(batch, replay=replay, temperature=0.7, entropy=True)
        got_lp, got_ent = packed.forward_logprobs(batch, replay=replay, temperature=0.7, entropy=True)
        assert logprobs_agree(got_lp, want_lp, dtype), (got_lp - want_lp).abs().max()
        assert logprobs_agree(got_ent, want_ent, dtype), (got_ent - want_ent).abs().max()
    # negative control: the packed rows without the per-sequence mask
    pk = plan_packing(batch.attention_mask)
    with torch.no_grad():
        ids = pk.pack(batch.input_ids, 0)
        keep = torch.nn.functional.pad((pk.segment[:, 1:] == pk.segment[:, :-1]) & (pk.segment[:, 1:] > 0), (1, 0))
        head = LogprobHead(ids, keep, 1.0, False)
        out = packed.model(ids, positions=pk.positions, attention_mask=(pk.segment > 0).long(), head=head)
        leaky = pk.unpack(out.head[0], batch.input_ids.shape)
    want = padded.forward_logprobs(batch, replay=False)[0]
    assert not logprobs_agree(leaky, want, dtype)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_packed_train_step_equals_the_padded_step(mode, hf_checkpoints):
    """One optimizer step with R3 replay: loss, gradient norm and every trained tensor packed vs padded (fp32,
    1e-6); LoRA also with a slot per row (adapters off on some rows, as the batched reference forward does)."""
    ckpt = hf_checkpoints["Qwen3MoeForCausalLM"][0]
    pols = [
        Policy(
            ckpt,
            PolicyConfig(
                mode=mode,
                dtype="float32",
                micro_batch_size=5,
                packing=p,
                lora=LoraConfig(rank=4),
                optim=OptimConfig(lr=1e-2),
            ),
        )
        for p in (False, True)
    ]
    with torch.no_grad():  # the same random adapter init (LoRA's A) on both sides
        for name, t in pols[0].trainable.items():
            pols[1].trainable[name].copy_(t)
    batch = ragged_batch(replay_of=pols[0].model)
    grads = [stepped_grads(pol) for pol in pols]
    stats = [pol.train_step(batch, sft_loss, temperature=0.7) for pol in pols]
    assert abs(stats[0]["loss"] - stats[1]["loss"]) < 1e-6
    assert abs(stats[0]["grad_norm"] - stats[1]["grad_norm"]) < 1e-5 * stats[0]["grad_norm"]
    # the gradients the optimizer stepped with (AdamW's first step is about lr * sign(g): its result would flip
    # on gradients that are rounding noise)
    assert grads[0].keys() == grads[1].keys() == pols[0].trained.keys()
    for want, got in zip(*(g.values() for g in grads), strict=True):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    if mode == "lora":  # trained adapters (B != 0 now), on alternate rows only
        batch.extras["adapter_slots"] = torch.tensor([0, -1] * (len(batch) // 2))
        want, got = (pol.forward_logprobs(batch)[0] for pol in pols)
        assert torch.allclose(got, want, atol=1e-5)
        assert (got - pols[1].forward_logprobs(batch, reference=True)[0]).abs()[::2].max() > 1e-3


def test_a_bad_replay_is_named_in_the_batchs_own_shape_when_packed(hf_checkpoints):
    """The replay is checked before it is packed: one row too many (which packing would otherwise lay out wrongly)
    and an expert out of range are refused naming the batch's [B, T], not the packed rows'."""
    cfg = PolicyConfig(mode="full", dtype="float32", micro_batch_size=16)  # one micro-batch: its shape is the batch's
    pol = Policy(hf_checkpoints["Qwen3MoeForCausalLM"][0], cfg)
    batch = ragged_batch(replay_of=pol.model)
    assert plan_packing(batch.attention_mask) is not None
    b, t = batch.input_ids.shape
    good = batch.replay
    batch.replay = torch.cat([good, good[:, :2]], dim=1)  # T + 1 rows
    with pytest.raises(ReplayError, match=rf"replay has shape \({b}, {t + 1}, .*needs \[B={b}, T={t} or T-1"):
        pol.forward_logprobs(batch)
    batch.replay = good.clone()
    batch.replay[3, 1, 0, 0] = 99
    with pytest.raises(ReplayError, match=r"model layer 0\) holds expert 99"):
        pol.forward_logprobs(batch)
