"""Losses that ``Policy.train_step`` takes: ``sft_loss`` and the RL policy losses (PPO-clip, GSPO, CISPO)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from moerl.config import require
from moerl.errors import ConfigError
from moerl.trainer.batch import Batch
from moerl.trainer.logprobs import ENTROPY_METRIC
from moerl.trainer.mismatch import KINDS as MISMATCH_KINDS
from moerl.trainer.mismatch import LEVELS as MISMATCH_LEVELS
from moerl.trainer.mismatch import mismatch_metrics, mismatch_weights
from moerl.trainer.policy import LossFn


def sft_loss(logprobs: torch.Tensor, mb: Batch, entropy: torch.Tensor | None = None):
    """Negative log-likelihood of the ``loss_mask`` tokens, averaged over every such token of the whole batch."""
    nll = -(logprobs * mb.loss_mask).sum() / mb.total_tokens
    return nll, {"nll": float(nll.detach()) * mb.total_tokens / max(1, int(mb.loss_mask.sum()))}


LOSS_KINDS = ("ppo", "gspo", "cispo")
REDUCTIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(slots=True)
class PolicyLossConfig:
    """The RL policy loss. ``kind``: ppo | gspo | cispo. ``clip_low`` / ``clip_high``: the ratio is clipped to
    ``[1 - clip_low, 1 + clip_high]`` (clip-higher when ``clip_high > clip_low``). ``dual_clip`` (c > 1, ppo / gspo):
    caps the loss of negative-advantage tokens at ``-c * A``. ``reduction``: token_mean | seq_mean_token_sum |
    seq_mean_token_mean. ``kl_coef`` / ``kl_estimator`` (k1 | k2 | k3): KL to the reference, added to the loss
    unless ``kl_in_reward``; then the loop shapes the rewards instead, e.g. per sequence
    ``r - kl_coef * (kl_penalty(logp, ref_logp, kl_estimator) * loss_mask).sum(1)`` before the advantages.
    ``entropy_coef``: entropy bonus (needs ``train_step(..., entropy=True)``). ``mismatch`` (none | tis | mis | icepop),
    ``mismatch_level`` (token | sequence | geometric), ``mismatch_cap`` (TIS cap), ``mismatch_low`` /
    ``mismatch_high`` (MIS / IcePop band): see ``moerl.trainer.mismatch``."""

    # ppo | gspo (sequence-level ratio) | cispo (clipped IS weight, gradient to every token)
    kind: Literal[LOSS_KINDS] = "ppo"
    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # clip-higher when above clip_low (DAPO)
    dual_clip: float | None = None  # c > 1 (ppo / gspo): caps negative-advantage tokens' loss at -c * A
    reduction: Literal[REDUCTIONS] = "token_mean"  # token_mean | seq_mean_token_sum | seq_mean_token_mean
    kl_coef: float = 0.0  # weight of the KL to the reference policy (needs policy.reference or LoRA)
    kl_estimator: Literal[KL_ESTIMATORS] = "k3"  # k1 | k2 | k3
    kl_in_reward: bool = False  # the KL shapes the rewards before the advantages instead of entering the loss
    entropy_coef: float = 0.0  # entropy bonus weight
    # engine / trainer mismatch correction: none | tis | mis | icepop (moerl.trainer.mismatch)
    mismatch: Literal[MISMATCH_KINDS] = "none"
    mismatch_level: Literal[MISMATCH_LEVELS] = "token"  # token | sequence | geometric
    mismatch_cap: float = 2.0  # tis: the importance weight's cap
    mismatch_low: float = 0.5  # mis / icepop: weights below this are masked
    mismatch_high: float = 2.0  # mis / icepop: weights above this are masked

    @property
    def entropy(self) -> bool | str:
        """What a training step computes of each token's entropy for this loss (``Policy.train_step``'s
        ``entropy``): differentiable for an entropy bonus, else its value alone (a metric)."""
        return True if self.entropy_coef > 0 else ENTROPY_METRIC

    def __post_init__(self) -> None:
        choices = (
            ("kind", LOSS_KINDS),
            ("reduction", REDUCTIONS),
            ("kl_estimator", KL_ESTIMATORS),
            ("mismatch", MISMATCH_KINDS),
            ("mismatch_level", MISMATCH_LEVELS),
        )
        rules = (
            *(
                (n, getattr(self, n), getattr(self, n) in allowed, f"allowed: {', '.join(allowed)}")
                for n, allowed in choices
            ),
            ("clip_low", self.clip_low, 0 <= self.clip_low < 1, "must be in [0, 1)"),
            ("clip_high", self.clip_high, self.clip_high >= 0, "must be >= 0"),
            ("dual_clip", self.dual_clip, self.dual_clip is None or self.dual_clip > 1, "must be None or > 1"),
            (
                "dual_clip",
                self.dual_clip,
                self.dual_clip is None or self.kind != "cispo",
                "applies to kind ppo or gspo only",
            ),
            ("kl_coef", self.kl_coef, 0 <= self.kl_coef < math.inf, "must be finite and >= 0"),
            ("entropy_coef", self.entropy_coef, 0 <= self.entropy_coef < math.inf, "must be finite and >= 0"),
            (
                "mismatch_level",
                self.mismatch_level,
                self.mismatch != "icepop" or self.mismatch_level == "token",
                "icepop allows: token",
            ),
            ("mismatch_cap", self.mismatch_cap, self.mismatch_cap >= 1, "must be >= 1"),
            ("mismatch_low", self.mismatch_low, 0 <= self.mismatch_low <= 1, "must be in [0, 1]"),
            ("mismatch_high", self.mismatch_high, self.mismatch_high >= 1, "must be >= 1"),
        )
        require("PolicyLossConfig.{}", rules)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled-token logprobs, with ``d = ref_logprobs - logprobs``:
    k1 = ``-d``, k2 = ``d^2 / 2``, k3 = ``exp(d) - 1 - d`` (unbiased and >= 0). Differentiable in ``logprobs``."""
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(f"kl estimator={estimator!r}: allowed: {', '.join(KL_ESTIMATORS)}")
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d.square() / 2
    return d.exp() - 1 - d


def reduce_loss(
    values: torch.Tensor, mask: torch.Tensor, reduction: str, total_tokens: int, total_seqs: int
) -> torch.Tensor:
    """Reduce per-token ``values`` [B, T] over ``mask`` with GLOBAL totals, so micro-batch results add up to the
    full batch's: token_mean = ``sum(v * m) / total_tokens``; seq_mean_token_sum = ``sum_i sum_t(v * m) /
    total_seqs``; seq_mean_token_mean = ``sum_i (sum_t(v * m) / n_i) / total_seqs`` (``n_i``: row i's tokens)."""
    vm = values * mask
    if reduction == "token_mean":
        return vm.sum() / max(1, total_tokens)
    if reduction == "seq_mean_token_sum":
        return vm.sum() / max(1, total_seqs)
    if reduction == "seq_mean_token_mean":
        return (vm.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(1, total_seqs)
    raise ConfigError(f"reduction={reduction!r}: allowed: {', '.join(REDUCTIONS)}")


def _mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x.detach() * mask).sum()) / max(1.0, float(mask.sum()))


def make_policy_loss(cfg: PolicyLossConfig) -> LossFn:
    """A ``loss_fn(logprobs, micro_batch, entropy) -> (loss, metrics)`` for ``Policy.train_step``.

    Reads ``extras``: ``advantages`` ([B] or [B, T]); ``old_logprobs`` (absent: ``logprobs.detach()``, i.e. one
    on-policy update); ``ref_logprobs`` (needed when ``kl_coef > 0`` and not ``kl_in_reward``); ``rollout_logprobs``
    (needed by a mismatch correction). With ``r = exp(logp - old_logp)`` per loss token and ``A`` the advantage:

    - ppo: ``L = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``; with dual-clip c, for ``A < 0``:
      ``L = min(L, -c * A)``.
    - gspo: the same with ``r`` replaced by the sequence ratio ``s = exp(mean_t (logp - old_logp))`` over the
      sequence's loss tokens, for every one of its tokens (the gradient flows through the mean).
    - cispo: ``L = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp`` (gradient through ``logp`` only).

    ``L`` is multiplied by the mismatch weights, reduced with ``cfg.reduction`` over the global totals, then
    ``+ kl_coef * reduce(kl)`` and ``- entropy_coef * reduce(entropy)``.

    Metrics are means over this micro-batch's own loss tokens (``pg_loss``: its reduction with the micro-batch's own
    totals); ``train_step`` averages them weighted by rows, exact when micro-batches hold equal token counts:
    ``pg_loss``, ``clip_frac`` (tokens whose loss clipping changed, dual-clip included; cispo: whose weight was
    clipped), ``ratio_mean``, ``kl`` (with ``ref_logprobs``), ``entropy`` (when given), ``mismatch_k3`` and
    ``mismatch_frac_large_diff`` (with ``rollout_logprobs``, old vs rollout logprobs), ``mismatch_weight_mean``.
    """

    def loss_fn(
        logprobs: torch.Tensor, mb: Batch, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return _policy_loss(cfg, logprobs, mb, entropy)

    return loss_fn


def _policy_loss(
    cfg: PolicyLossConfig, logprobs: torch.Tensor, mb: Batch, entropy: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``make_policy_loss``'s loss on one micro-batch: the clipped objective, mismatch-weighted, reduced, then the
    KL and entropy terms."""
    ex = mb.extras
    mask = mb.loss_mask.to(logprobs.dtype)
    adv = _advantages(ex, logprobs.dtype)
    old = ex.get("old_logprobs")
    old = logprobs.detach() if old is None else old.to(logprobs.dtype)
    pg, ratio, changed = _surrogate(cfg, logprobs, old, adv, mask)
    metrics = {"clip_frac": _mean(changed.to(mask.dtype), mask), "ratio_mean": _mean(ratio, mask)}
    pg = _mismatch_weighted(cfg, pg, old, ex.get("rollout_logprobs"), mask, metrics)
    n_tok, n_seq = int(mask.sum()), int((mask.sum(1) > 0).sum())
    metrics["pg_loss"] = float(reduce_loss(pg.detach(), mask, cfg.reduction, n_tok, n_seq))
    loss = reduce_loss(pg, mask, cfg.reduction, mb.total_tokens, mb.total_seqs)
    kl = _kl_term(cfg, logprobs, mb, mask, metrics)
    if kl is not None:
        loss = loss + kl
    bonus = _entropy_bonus(cfg, entropy, mb, mask, metrics)
    if bonus is not None:
        loss = loss - bonus
    return loss, metrics


def _advantages(extras: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``extras['advantages']`` as [B, 1] (per sequence) or [B, T] (per token)."""
    if "advantages" not in extras:
        raise ConfigError("the policy loss needs extras['advantages'] ([B] per sequence or [B, T] per token)")
    adv = extras["advantages"].to(dtype)
    return adv[:, None] if adv.dim() == 1 else adv


def _surrogate(
    cfg: PolicyLossConfig, logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss of ``cfg.kind`` (see ``make_policy_loss``), the ratio it used (gspo: the
    sequence's), and where clipping changed the loss (cispo: the weight)."""
    log_ratio = (logprobs - old) * mask
    if cfg.kind == "gspo":
        log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    if cfg.kind == "cispo":
        return -clipped.detach() * adv * logprobs, ratio, clipped != ratio
    unclipped = -adv * ratio
    pg = torch.maximum(unclipped, -adv * clipped)
    if cfg.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip * adv), pg)
    return pg, ratio, pg != unclipped


def _mismatch_weighted(
    cfg: PolicyLossConfig,
    pg: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor | None,
    mask: torch.Tensor,
    metrics: dict[str, float],
) -> torch.Tensor:
    """``pg`` times the rollout-vs-trainer mismatch weights of ``cfg.mismatch`` (unchanged with none); the
    mismatch metrics into ``metrics`` whenever the rollout logprobs are there."""
    if rollout is not None:
        metrics.update({f"mismatch_{k}": v for k, v in mismatch_metrics(old, rollout, mask).items()})
    if cfg.mismatch == "none":
        return pg
    if rollout is None:
        raise ConfigError(f"PolicyLossConfig.mismatch={cfg.mismatch!r} needs extras['rollout_logprobs']")
    bounds = (cfg.mismatch_cap, cfg.mismatch_low, cfg.mismatch_high)
    w = mismatch_weights(old.detach(), rollout, mask, cfg.mismatch, cfg.mismatch_level, *bounds)
    metrics["mismatch_weight_mean"] = _mean(w, mask)
    return pg * w


def _kl_term(
    cfg: PolicyLossConfig, logprobs: torch.Tensor, mb: Batch, mask: torch.Tensor, metrics: dict[str, float]
) -> torch.Tensor | None:
    """``kl_coef * reduce(kl)`` to add to the loss (None when the KL is not in the loss); ``metrics['kl']``
    whenever the reference logprobs are there."""
    kl_in_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward
    ref = mb.extras.get("ref_logprobs")
    if ref is None:
        if kl_in_loss:
            raise ConfigError("PolicyLossConfig.kl_coef > 0 (KL in the loss) needs extras['ref_logprobs']")
        return None
    kl = kl_penalty(logprobs * mask, ref.to(logprobs.dtype) * mask, cfg.kl_estimator)
    metrics["kl"] = _mean(kl, mask)
    if not kl_in_loss:
        return None
    return cfg.kl_coef * reduce_loss(kl, mask, cfg.reduction, mb.total_tokens, mb.total_seqs)


def _entropy_bonus(
    cfg: PolicyLossConfig, entropy: torch.Tensor | None, mb: Batch, mask: torch.Tensor, metrics: dict[str, float]
) -> torch.Tensor | None:
    """``entropy_coef * reduce(entropy)`` to subtract from the loss (None when the coefficient is 0);
    ``metrics['entropy']`` whenever the entropy is given."""
    if entropy is None:
        if cfg.entropy_coef > 0:
            raise ConfigError("PolicyLossConfig.entropy_coef > 0 needs the entropy: train_step(..., entropy=True)")
        return None
    metrics["entropy"] = _mean(entropy, mask)
    if not cfg.entropy_coef > 0:
        return None
    return cfg.entropy_coef * reduce_loss(entropy, mask, cfg.reduction, mb.total_tokens, mb.total_seqs)
