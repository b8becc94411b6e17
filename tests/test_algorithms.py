"""RL algorithm pieces against hand-computed values: advantages, DAPO filters, policy losses, reductions, KL,
entropy, mismatch corrections and metrics, config errors."""

import math

import pytest
import torch

from moerl.errors import ConfigError
from moerl.trainer import Batch
from moerl.trainer.advantages import (
    compute_advantages,
    dynamic_sampling_keep,
    grpo,
    overlong_mask,
    reinforce_pp,
    rloo,
)
from moerl.trainer.losses import PolicyLossConfig, kl_penalty, make_policy_loss
from moerl.trainer.mismatch import mismatch_metrics, mismatch_weights

F64 = torch.float64
LOSS_MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])  # 3 + 2 = 5 loss tokens, 2 sequences
N = 5


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def close(a, b, tol=1e-9) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=0)


def batch(**extras) -> Batch:
    return Batch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), LOSS_MASK, extras=extras)


def ratio_setup(ratios):
    """old logprobs -1 on loss tokens and logprobs = old + ln(ratio): a leaf tensor with the given ratios."""
    old = t([[0, -1, -1, -1], [0, -1, -1, 0]])
    lr = t([[0] + [math.log(r) for r in ratios[0]], [0] + [math.log(r) for r in ratios[1]] + [0]])
    return (old + lr).requires_grad_(True), old


def run(cfg, logp, **extras):
    loss, metrics = make_policy_loss(cfg)(logp, batch(**extras), None)
    loss.backward()
    return loss, metrics, logp.grad


# ---------------------------------------------------------------- advantages


def test_grpo_centres_per_group_and_divides_by_population_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    # group 0: mean 0.5, population std 0.5; group 1: all equal -> 0; group 2: mean 0.5, var (2.25 + 3 * 0.25) / 4
    want = [
        [x / (0.5 + 1e-6) for x in (0.5, -0.5, -0.5, 0.5)],
        [0.0] * 4,
        [x / (math.sqrt(0.75) + 1e-6) for x in (1.5, -0.5, -0.5, -0.5)],
    ]
    assert close(grpo(r), want, 1e-6)
    assert close(grpo(r, std_normalize=False), [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [1.5, -0.5, -0.5, -0.5]])
    assert close(grpo(torch.tensor([[1, 0]])), [[0.5 / 0.500001, -0.5 / 0.500001]], 1e-6)  # int rewards are fine


def test_rloo_uses_the_mean_of_the_other_samples():
    r = torch.tensor([[2.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    want = [[2 - 0, 0 - 2 / 3, 0 - 2 / 3, 0 - 2 / 3], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]]
    assert close(rloo(r), want, 1e-6)
    with pytest.raises(ConfigError, match="group_size=1"):
        rloo(torch.ones(3, 1))


def test_reinforce_pp_normalises_over_the_whole_batch():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # batch mean 0.25, variance (0.75^2 + 3 * 0.25^2) / 4 = 0.1875
    std = math.sqrt(0.1875)
    assert close(reinforce_pp(r), [[0.75 / (std + 1e-6), -0.25 / (std + 1e-6)], [-0.25 / (std + 1e-6)] * 2], 1e-6)
    assert close(grpo(r)[1], [0.0, 0.0])  # a per-group estimator gives the all-equal group 0; the batch one does not


def test_compute_advantages_dispatches_and_names_the_allowed_methods():
    r = torch.tensor([[3.0, 1.0]])
    assert close(compute_advantages(r, "grpo", std_normalize=False), [[1.0, -1.0]])
    assert close(compute_advantages(r, "rloo"), [[2.0, -2.0]])
    assert close(compute_advantages(r, "reinforce_pp"), [[1 / 1.000001, -1 / 1.000001]], 1e-6)
    with pytest.raises(ConfigError, match="'ppo'.*grpo, rloo, reinforce_pp"):
        compute_advantages(r, "ppo")
    with pytest.raises(ConfigError, match=r"\[num_groups, group_size\]"):
        grpo(torch.ones(4))


def test_dapo_dynamic_sampling_and_overlong_mask():
    r = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 1.0]])
    assert dynamic_sampling_keep(r).tolist() == [True, False, False, True]
    m = overlong_mask(["stop", "length", "error", "stop", "context"])
    assert m.dtype == torch.float32 and m.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]


# ---------------------------------------------------------------- policy losses

RATIOS = ([1.1, 1.5, 0.5], [0.5, 1.3])
ADV = t([1.0, -2.0])


def test_ppo_asymmetric_clip_values_gradients_and_metrics():
    logp, old = ratio_setup(RATIOS)
    cfg = PolicyLossConfig(kind="ppo", clip_low=0.2, clip_high=0.28)
    loss, m, grad = run(cfg, logp, advantages=ADV, old_logprobs=old)
    # A=1: r=1.1 -> -1.1; r=1.5 -> clipped to 1.28; r=0.5 -> -min(0.5, 0.8) = -0.5 (unclipped)
    # A=-2: r=0.5 -> -min(-1.0, -1.6) = 1.6 (clipped at 0.8); r=1.3 -> -min(-2.6, -2.56) = 2.6 (unclipped)
    per_token = [-1.1, -1.28, -0.5, 1.6, 2.6]
    assert close(loss, sum(per_token) / N)
    # d/dlogp of -A * r is -A * r where unclipped, 0 where the clipped branch is taken
    assert close(grad, [[0, -1.1 / N, 0, -0.5 / N], [0, 0, 2 * 1.3 / N, 0]])
    assert close(m["pg_loss"], sum(per_token) / N) and close(m["clip_frac"], 2 / 5)
    assert close(m["ratio_mean"], (1.1 + 1.5 + 0.5 + 0.5 + 1.3) / 5)
    assert "kl" not in m and "entropy" not in m and "mismatch_k3" not in m


def test_ppo_dual_clip_caps_negative_advantage_losses():
    logp, old = ratio_setup(([1.1, 1.5, 0.5], [0.5, 4.0]))
    plain, _, _ = run(PolicyLossConfig(clip_high=0.28), logp, advantages=ADV, old_logprobs=old)
    logp.grad = None
    loss, m, grad = run(PolicyLossConfig(clip_high=0.28, dual_clip=3.0), logp, advantages=ADV, old_logprobs=old)
    # A=-2, r=4: -min(-8, -2.56) = 8, capped at -c * A = 6 (constant: no gradient); A>0 rows unaffected
    assert close(plain, (-1.1 - 1.28 - 0.5 + 1.6 + 8.0) / N)
    assert close(loss, (-1.1 - 1.28 - 0.5 + 1.6 + 6.0) / N)
    assert close(grad, [[0, -1.1 / N, 0, -0.5 / N], [0, 0, 0, 0]])
    assert close(m["clip_frac"], 3 / 5)


def test_on_policy_without_old_logprobs_is_reinforce():
    logp = t([[0, -1.0, -2.0, -0.5], [0, -0.3, -0.7, 0]]).requires_grad_(True)
    loss, m, grad = run(PolicyLossConfig(), logp, advantages=ADV)
    assert close(loss, (3 * -1.0 + 2 * 2.0) / N)  # ratio 1: -A per token
    assert close(grad, [[0, -1 / N, -1 / N, -1 / N], [0, 2 / N, 2 / N, 0]])
    assert m["clip_frac"] == 0 and close(m["ratio_mean"], 1.0)


def test_gspo_sequence_ratio_values_and_gradients():
    logp, old = ratio_setup(RATIOS)
    s0, s1 = (1.1 * 1.5 * 0.5) ** (1 / 3), (0.5 * 1.3) ** (1 / 2)  # geometric means: 0.938, 0.806
    loss, m, grad = run(PolicyLossConfig(kind="gspo", clip_high=0.28), logp, advantages=ADV, old_logprobs=old)
    # both inside [0.8, 1.28]: per-token losses -s0 (x3) and 2 * s1 (x2); d s_i / d logp_t = s_i / n_i
    assert close(loss, (3 * -s0 + 2 * 2 * s1) / N)
    assert close(grad, [[0, -s0 / N, -s0 / N, -s0 / N], [0, 2 * s1 / N, 2 * s1 / N, 0]])
    assert close(m["ratio_mean"], (3 * s0 + 2 * s1) / 5) and m["clip_frac"] == 0
    logp.grad = None
    loss, m, grad = run(
        PolicyLossConfig(kind="gspo", clip_low=0.1, clip_high=0.1), logp, advantages=ADV, old_logprobs=old
    )
    # s1 = 0.806 < 0.9 with A=-2: max(2 * 0.806, 2 * 0.9) = 1.8, the clipped branch: no gradient for row 1
    assert close(loss, (3 * -s0 + 2 * 1.8) / N)
    assert close(grad, [[0, -s0 / N, -s0 / N, -s0 / N], [0, 0, 0, 0]])
    assert close(m["clip_frac"], 2 / 5)


def test_cispo_stop_gradient_clipped_weight_times_logp():
    logp, old = ratio_setup(RATIOS)
    loss, m, grad = run(PolicyLossConfig(kind="cispo", clip_high=0.28), logp, advantages=ADV, old_logprobs=old)
    lp0, lp1 = [-1 + math.log(r) for r in RATIOS[0]], [-1 + math.log(r) for r in RATIOS[1]]
    # weights clip(r, 0.8, 1.28): row 0 [1.1, 1.28, 0.8] with A=1, row 1 [0.8, 1.28] with A=-2
    want = (-1.0 * (1.1 * lp0[0] + 1.28 * lp0[1] + 0.8 * lp0[2]) + 2.0 * (0.8 * lp1[0] + 1.28 * lp1[1])) / N
    assert close(loss, want)
    # gradient -sg(w) * A / N on every token, clipped ones included (what distinguishes CISPO from PPO)
    assert close(grad, [[0, -1.1 / N, -1.28 / N, -0.8 / N], [0, 1.6 / N, 2.56 / N, 0]])
    assert close(m["clip_frac"], 4 / 5)


@pytest.mark.parametrize(
    "reduction, want",
    [
        ("token_mean", (-2.88 + 4.2) / 5),
        ("seq_mean_token_sum", (-2.88 + 4.2) / 2),
        ("seq_mean_token_mean", (-2.88 / 3 + 4.2 / 2) / 2),
    ],
)
def test_reductions(reduction, want):
    logp, old = ratio_setup(RATIOS)  # per-token PPO losses: row 0 sums to -2.88 (3 tokens), row 1 to 4.2 (2)
    cfg = PolicyLossConfig(clip_high=0.28, reduction=reduction)
    loss, m, _ = run(cfg, logp, advantages=ADV, old_logprobs=old)
    assert close(loss, want) and close(m["pg_loss"], want)


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_micro_batch_losses_and_gradients_sum_to_the_full_batch(kind, reduction):
    g = torch.Generator().manual_seed(0)
    b, T = 5, 6
    loss_mask = torch.ones(b, T, dtype=torch.long)
    loss_mask[:, :2] = 0
    loss_mask[1, 4:] = 0
    loss_mask[3] = 0  # a row with no loss token
    old = -torch.rand(b, T, generator=g, dtype=F64)
    extras = {
        "advantages": torch.randn(b, generator=g, dtype=F64),
        "old_logprobs": old,
        "ref_logprobs": old - 0.1 * torch.rand(b, T, generator=g, dtype=F64),
        "rollout_logprobs": old + 0.3 * torch.randn(b, T, generator=g, dtype=F64),
    }
    full = Batch(torch.zeros(b, T, dtype=torch.long), torch.ones(b, T, dtype=torch.long), loss_mask, extras=extras)
    assert full.total_tokens == 4 + 2 + 4 + 0 + 4 and full.total_seqs == 4
    logp = (old + 0.3 * torch.randn(b, T, generator=g, dtype=F64)).requires_grad_(True)
    ent = torch.rand(b, T, generator=g, dtype=F64)
    cfg = PolicyLossConfig(kind=kind, reduction=reduction, kl_coef=0.05, entropy_coef=0.01, mismatch="tis")
    fn = make_policy_loss(cfg)
    want, _ = fn(logp, full, ent)
    (want_grad,) = torch.autograd.grad(want, logp)
    for size in (2, 3):
        total, grads = 0.0, []
        for i, mb in enumerate(full.split(size)):
            rows = slice(i * size, (i + 1) * size)
            lp = logp.detach()[rows].clone().requires_grad_(True)
            loss, _ = fn(lp, mb, ent[rows])
            loss.backward()
            total, grads = total + loss.detach(), [*grads, lp.grad]
        assert close(total, want.detach(), 1e-12) and close(torch.cat(grads), want_grad, 1e-12)


# ---------------------------------------------------------------- KL and entropy


def test_kl_estimators():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])  # d = ref - logp = [-0.5, 1.0]
    assert close(kl_penalty(logp, ref, "k1"), [0.5, -1.0])
    assert close(kl_penalty(logp, ref, "k2"), [0.125, 0.5])
    assert close(kl_penalty(logp, ref, "k3"), [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    with pytest.raises(ConfigError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_in_loss_in_reward_and_missing_reference():
    logp = t([[0, -1.0, -2.0, -0.5], [0, -0.3, -0.7, 0]]).requires_grad_(True)
    d = [0.2, -0.4, 0.1, 0.5, -0.3]  # ref - logp on the loss tokens
    ref = logp.detach() + t([[0, *d[:3]], [0, *d[3:], 0]])
    k3 = [math.exp(x) - 1 - x for x in d]
    zero = t([0.0, 0.0])  # advantages 0: the loss is the KL term alone
    loss, m, grad = run(PolicyLossConfig(kl_coef=0.1), logp, advantages=zero, ref_logprobs=ref)
    assert close(loss, 0.1 * sum(k3) / N) and close(m["kl"], sum(k3) / 5)
    # d k3 / d logp = 1 - exp(d)
    assert close(
        grad,
        [[0, *(0.1 * (1 - math.exp(x)) / N for x in d[:3])], [0, *(0.1 * (1 - math.exp(x)) / N for x in d[3:]), 0]],
    )
    logp.grad = None
    loss, m, _ = run(PolicyLossConfig(kl_coef=0.1, kl_in_reward=True), logp, advantages=zero, ref_logprobs=ref)
    assert loss.item() == 0 and close(m["kl"], sum(k3) / 5)
    loss, m, _ = run(PolicyLossConfig(kl_coef=0.1, kl_estimator="k2"), logp, advantages=zero, ref_logprobs=ref)
    assert close(loss, 0.1 * sum(x * x / 2 for x in d) / N)
    with pytest.raises(ConfigError, match="ref_logprobs"):
        make_policy_loss(PolicyLossConfig(kl_coef=0.1))(logp, batch(advantages=zero), None)


def test_entropy_bonus_and_metric():
    logp = t([[0, -1.0, -2.0, -0.5], [0, -0.3, -0.7, 0]]).requires_grad_(True)
    ent = t([[9.0, 1.0, 2.0, 3.0], [9.0, 0.5, 1.5, 9.0]])  # 9s are off the loss mask
    fn = make_policy_loss(PolicyLossConfig(entropy_coef=0.01, reduction="seq_mean_token_mean"))
    loss, m = fn(logp, batch(advantages=t([0.0, 0.0])), ent)
    assert close(loss, -0.01 * ((1 + 2 + 3) / 3 + (0.5 + 1.5) / 2) / 2)
    assert close(m["entropy"], (1 + 2 + 3 + 0.5 + 1.5) / 5)
    with pytest.raises(ConfigError, match="entropy=True"):
        fn(logp, batch(advantages=t([0.0, 0.0])), None)
    _, m = make_policy_loss(PolicyLossConfig())(logp, batch(advantages=t([0.0, 0.0])), ent)
    assert close(m["entropy"], 1.6)  # reported even without a bonus


# ---------------------------------------------------------------- mismatch

# rho = exp(old - rollout) on the loss tokens: row 0 [3, 0.5, 1], row 1 [0.25, 1.5]; products 1.5 and 0.375
RHO = ([3.0, 0.5, 1.0], [0.25, 1.5])
OLD = t([[0] + [math.log(r) for r in RHO[0]], [0] + [math.log(r) for r in RHO[1]] + [0]])
ROLLOUT = torch.zeros(2, 4, dtype=F64)


@pytest.mark.parametrize(
    "kind, level, want",
    [
        ("none", "token", [[0, 1, 1, 1], [0, 1, 1, 0]]),
        ("tis", "token", [[0, 2.0, 0.5, 1.0], [0, 0.25, 1.5, 0]]),
        ("tis", "sequence", [[0, 1.5, 1.5, 1.5], [0, 0.375, 0.375, 0]]),
        ("tis", "geometric", [[0, *[1.5 ** (1 / 3)] * 3], [0, *[0.375**0.5] * 2, 0]]),
        ("mis", "token", [[0, 0, 1, 1], [0, 0, 1, 0]]),
        ("mis", "sequence", [[0, 1, 1, 1], [0, 0, 0, 0]]),  # 0.375 < 0.5: the whole of row 1 is masked
        ("mis", "geometric", [[0, 1, 1, 1], [0, 1, 1, 0]]),  # 1.5^(1/3) = 1.14 and 0.375^(1/2) = 0.61 are inside
        ("icepop", "token", [[0, 0, 0.5, 1.0], [0, 0, 1.5, 0]]),  # like token MIS but keeps rho inside the band
    ],
)
def test_mismatch_weights(kind, level, want):
    w = mismatch_weights(OLD, ROLLOUT, LOSS_MASK, kind, level, cap=2.0, low=0.5, high=2.0)
    assert not w.requires_grad and close(w, want, 1e-12)


def test_mismatch_weights_bad_kind_level():
    with pytest.raises(ConfigError, match="none, tis, mis, icepop"):
        mismatch_weights(OLD, ROLLOUT, LOSS_MASK, "is")
    with pytest.raises(ConfigError, match="token, sequence, geometric"):
        mismatch_weights(OLD, ROLLOUT, LOSS_MASK, "tis", "seq")
    with pytest.raises(ConfigError, match="icepop is token-level only"):
        mismatch_weights(OLD, ROLLOUT, LOSS_MASK, "icepop", "sequence")


def test_mismatch_metrics():
    d = [1.0, -0.1, 0.0, -1.0, 0.5]  # |d| > ln 2 = 0.693: 1.0 and -1.0
    trainer = t([[0, *d[:3]], [0, *d[3:], 0]])
    rollout = torch.zeros(2, 4, dtype=F64)
    rollout[1, 3] = 5.0  # off the mask: ignored
    m = mismatch_metrics(trainer, rollout, LOSS_MASK)
    assert close(m["k3"], sum(math.exp(x) - 1 - x for x in d) / 5) and close(m["frac_large_diff"], 2 / 5)


def test_loss_applies_mismatch_weights_as_constants_and_reports_metrics():
    logp = OLD.clone().requires_grad_(True)  # ratio 1
    cfg = PolicyLossConfig(mismatch="tis", mismatch_cap=2.0)
    loss, m, grad = run(cfg, logp, advantages=t([1.0, 1.0]), old_logprobs=OLD, rollout_logprobs=ROLLOUT)
    w = [2.0, 0.5, 1.0, 0.25, 1.5]
    assert close(loss, -sum(w) / N)
    assert close(grad, [[0, -2.0 / N, -0.5 / N, -1.0 / N], [0, -0.25 / N, -1.5 / N, 0]])
    assert close(m["mismatch_weight_mean"], sum(w) / 5)
    assert close(m["mismatch_k3"], sum(r - 1 - math.log(r) for r in RHO[0] + RHO[1]) / 5)
    assert close(m["mismatch_frac_large_diff"], 2 / 5)  # rho 3 and 0.25; 0.5 is exactly ln 2, not above
    extras = {"advantages": t([1.0, 1.0]), "old_logprobs": OLD, "rollout_logprobs": ROLLOUT}
    loss, _, _ = run(PolicyLossConfig(mismatch="icepop"), OLD.clone().requires_grad_(True), **extras)
    assert close(loss, -(0.5 + 1.0 + 1.5) / N)
    with pytest.raises(ConfigError, match="rollout_logprobs"):
        make_policy_loss(cfg)(logp, batch(advantages=t([1.0, 1.0])), None)


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"kind": "grpo"}, r"kind='grpo': allowed: ppo, gspo, cispo"),
        ({"reduction": "mean"}, r"reduction='mean': allowed: token_mean, seq_mean_token_sum, seq_mean_token_mean"),
        ({"kl_estimator": "k4"}, r"kl_estimator='k4': allowed: k1, k2, k3"),
        ({"mismatch": "is"}, r"mismatch='is': allowed: none, tis, mis, icepop"),
        ({"mismatch_level": "seq"}, r"mismatch_level='seq': allowed: token, sequence, geometric"),
        ({"clip_low": 1.0}, r"clip_low=1.0: must be in \[0, 1\)"),
        ({"clip_high": -0.1}, r"clip_high=-0.1: must be >= 0"),
        ({"dual_clip": 1.0}, r"dual_clip=1.0: must be None or > 1"),
        ({"kind": "cispo", "dual_clip": 3.0}, r"dual_clip=3.0: applies to kind ppo or gspo only"),
        ({"kl_coef": -0.1}, r"kl_coef=-0.1: must be finite and >= 0"),
        ({"entropy_coef": math.nan}, r"entropy_coef=nan: must be finite and >= 0"),
        ({"mismatch": "icepop", "mismatch_level": "sequence"}, r"mismatch_level='sequence': icepop allows: token"),
        ({"mismatch_cap": 0.5}, r"mismatch_cap=0.5: must be >= 1"),
        ({"mismatch_low": 1.5}, r"mismatch_low=1.5: must be in \[0, 1\]"),
        ({"mismatch_high": 0.9}, r"mismatch_high=0.9: must be >= 1"),
    ],
)
def test_policy_loss_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        PolicyLossConfig(**kw)


def test_missing_advantages():
    with pytest.raises(ConfigError, match="advantages"):
        make_policy_loss(PolicyLossConfig())(torch.zeros(2, 4, dtype=F64), batch(), None)
