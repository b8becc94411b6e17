"""Logits never whole (``policy.logits_chunk``, ``moerl.trainer.logprobs.LogprobHead``): the head, log-softmax,
logprob and entropy in chunks of tokens, recomputed in the backward, against the whole logits at once: logprobs,
entropies and the gradients at the head within 1e-6 in fp32, the layers' within 1e-5 (negative control: another
temperature misses it by far); a training
step's loss, gradient norm and weights the same; the peak of live tensors O(chunk x vocab), not O(tokens x vocab)."""

import pytest
import torch
from run_helpers import stepped_grads

from moerl.plan.memory import Memory
from moerl.presets import init_model
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.logprobs import LogprobHead
from moerl.trainer.losses import sft_loss

TOL = 1e-6  # fp32, relative to the values' size: the same ops on the same rows; the head's GEMM sees other row counts


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


WIDE = {"num_hidden_layers": 2, "vocab_size": 4096}  # a vocabulary wide enough that the logits weigh


def _rows(b: int, t: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    keep = (torch.arange(t)[None] < torch.randint(t // 2, t + 1, (b, 1), generator=g)).long()
    return ids * keep, keep


class _Seen(LogprobHead):
    """The head, keeping the hidden states it was given (their gradient: what the head sends back)."""

    def __call__(self, model, x):
        x.retain_grad()
        self.x = x
        return LogprobHead.__call__(self, model, x)


def _logprobs_and_grads(model, ids, keep, chunk: int, temperature: float = 1.0):
    """(logprobs, entropies, the gradient of a random mix of both w.r.t. every parameter and, as "hidden", w.r.t.
    the final hidden states the head read)."""
    model.zero_grad(set_to_none=True)
    head = _Seen(ids, keep, temperature, True, chunk)
    lp, ent = model(ids, attention_mask=keep, head=head).head
    g = torch.Generator().manual_seed(1)
    (lp * torch.randn(lp.shape, generator=g)).sum().add((ent * torch.randn(ent.shape, generator=g)).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads | {"hidden": head.x.grad}


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_logprobs_entropies_and_gradients_equal_the_whole_logits(chunk):
    model = init_model("qwen3_moe", "tiny", overrides=WIDE, dtype=torch.float32).train()
    ids, keep = _rows(3, 40, 4096)
    want_lp, want_ent, want_grads = _logprobs_and_grads(model, ids, keep, 0)
    lp, ent, grads = _logprobs_and_grads(model, ids, keep, chunk)
    assert _off(lp, want_lp) <= TOL and _off(ent, want_ent) <= TOL, (_off(lp, want_lp), _off(ent, want_ent))
    assert grads.keys() == want_grads.keys() and "lm_head.weight" in grads and "layers.0.mlp.router.weight" in grads
    head = max(_off(grads[n], want_grads[n]) for n in ("hidden", "lm_head.weight"))
    assert head <= TOL, head
    # the layers' gradients carry the head's rounding back through attention and the experts: 1e-5
    worst = max(_off(grads[n], want_grads[n]) for n in grads)
    assert worst <= 10 * TOL, worst
    # the control: the chunked head at another temperature misses the tolerance
    hotter, _, hot_grads = _logprobs_and_grads(model, ids, keep, chunk, temperature=1.01)
    assert _off(hotter, want_lp) > 100 * TOL and _off(hot_grads["hidden"], want_grads["hidden"]) > 100 * TOL


def test_a_training_step_in_chunks_is_the_whole_logits_step(tmp_path):
    """Two policies, one with the logits whole and one in chunks of 5 tokens (packed rows, R3-free): the same loss,
    gradient norm and gradients the optimizer steps with (not the weights after the step: AdamW's first step is
    g / (|g| + 1e-8), which turns the last bits of a gradient near zero into a visible move)."""
    init_model("qwen3_moe", "tiny", tmp_path / "m", overrides=WIDE)
    ids, keep = _rows(6, 24, 4096, seed=2)
    batch = Batch(ids, keep, keep)
    out = {}
    for chunk in (0, 5):
        optim = OptimConfig(lr=1e-3)
        cfg = PolicyConfig(mode="full", dtype="float32", micro_batch_size=3, logits_chunk=chunk, optim=optim)
        pol = Policy(tmp_path / "m", cfg)
        grads = stepped_grads(pol)
        metrics = pol.train_step(batch, sft_loss)
        out[chunk] = metrics, grads
    (m0, g0), (m5, g5) = out[0], out[5]
    assert abs(m0["loss"] - m5["loss"]) <= TOL * abs(m0["loss"])
    assert abs(m0["grad_norm"] - m5["grad_norm"]) <= TOL * m0["grad_norm"]
    assert g0.keys() == g5.keys() and max(_off(g5[n], g0[n]) for n in g0) <= TOL


class _NoHead(LogprobHead):
    """The baseline: what the model's forward and backward hold without any head (the hidden states summed)."""

    def __call__(self, model, x):
        return x.sum(-1), None


def test_the_peak_holds_one_chunk_of_logits_not_all_of_them():
    """Live tensors at the peak of a forward and backward over 1024 tokens at a 4096 vocabulary, above what the
    model holds without a head: the whole logits hold at least two [1024, 4096] fp32 tensors (the logits and their
    log-softmax); in chunks of 64 tokens the head holds a few [64, 4096] ones (5.5 measured), not 16 times as many."""
    model = init_model("qwen3_moe", "tiny", overrides=WIDE, dtype=torch.float32).train()
    ids, keep = _rows(4, 256, 4096)
    tokens = 4 * 255

    def peak(head: LogprobHead) -> int:
        weights = [*model.parameters(), *model.buffers()]
        with Memory({"weights": weights}) as memory:
            lp, _ = model(ids, attention_mask=keep, head=head).head
            lp.sum().backward()
        model.zero_grad(set_to_none=True)
        return memory.peak.total - memory.peak.bytes["weights"]

    base = peak(_NoHead(ids, keep, 1.0, False))
    whole = peak(LogprobHead(ids, keep, 1.0, False, 0)) - base
    chunked = peak(LogprobHead(ids, keep, 1.0, False, 64)) - base
    assert whole >= 2 * tokens * 4096 * 4, (whole, chunked)
    # a chunk's logits, log-softmax and gradient, and the head's own gradient (as large as a chunk here)
    assert chunked <= 8 * 64 * 4096 * 4, (whole, chunked)
