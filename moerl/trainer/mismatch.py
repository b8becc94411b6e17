"""Training-inference mismatch: metrics and importance corrections between the rollout engine's logprobs and the
trainer's logprobs of the same tokens under the same weights.

With ``rho_t = exp(old_logp_t - rollout_logp_t)`` (trainer over engine, per loss token), the corrections are weights
multiplied into the per-token policy-gradient loss, as constants (no gradient):

- ``tis`` (truncated IS): token ``w_t = min(rho_t, cap)``; sequence ``w = min(prod_t rho_t, cap)``; geometric
  ``w = min(exp(mean_t log rho_t), cap)``.
- ``mis`` (masked IS, a 0/1 rejection mask): token ``w_t = 1[low <= rho_t <= high]``; sequence: the whole sequence
  gets 0 when ``prod_t rho_t`` is outside ``[low, high]``; geometric: the same test on ``exp(mean_t log rho_t)``.
- ``icepop`` (Ling team, Ring-1T): token level only, ``w_t = rho_t`` if ``low <= rho_t <= high`` else 0. It differs
  from token MIS in keeping the IS weight ``rho_t`` inside the band (MIS uses 1 there): IcePop calibrates the
  gradients of the tokens it keeps and drops the rest.

Sequence products are computed in log space, so long sequences do not overflow.
"""

from __future__ import annotations

import math

import torch

from moerl.errors import ConfigError

KINDS = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence", "geometric")


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


@torch.no_grad()
def mismatch_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "none",
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor:
    """Per-token correction weights [B, T] (detached, 0 off ``mask``) for ``kind`` (none | tis | mis | icepop) at
    ``level`` (token | sequence | geometric; icepop: token only); see the module docstring for the formulas."""
    if kind not in KINDS:
        raise ConfigError(f"mismatch kind={kind!r}: allowed: {', '.join(KINDS)}")
    if level not in LEVELS:
        raise ConfigError(f"mismatch level={level!r}: allowed: {', '.join(LEVELS)}")
    if kind == "icepop" and level != "token":
        raise ConfigError(f"mismatch level={level!r}: icepop is token-level only (allowed: token)")
    m = mask.to(old_logp.dtype)
    if kind == "none":
        return m.clone()
    log_rho = (old_logp - rollout_logp) * m
    if kind == "icepop":
        rho = log_rho.exp()
        return torch.where((log_rho >= _log(low)) & (log_rho <= _log(high)), rho, 0.0) * m
    if level != "token":
        log_rho = log_rho.sum(1, keepdim=True)
        if level == "geometric":
            log_rho = log_rho / m.sum(1, keepdim=True).clamp(min=1)
        log_rho = log_rho.expand_as(m)
    if kind == "tis":
        w = log_rho.clamp(max=math.log(cap)).exp()
    else:
        w = ((log_rho >= _log(low)) & (log_rho <= _log(high))).to(m.dtype)
    return w * m


@torch.no_grad()
def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """With ``d = trainer_logp - rollout_logp`` over the ``mask`` tokens: ``k3`` = mean of ``exp(d) - 1 - d`` and
    ``frac_large_diff`` = fraction with ``|d| > ln 2`` (the probabilities differ by more than 2x). 0 if no tokens."""
    m = mask.to(trainer_logp.dtype)
    n = max(1.0, float(m.sum()))
    d = (trainer_logp - rollout_logp) * m
    return {
        "k3": float(((d.exp() - 1 - d) * m).sum()) / n,
        "frac_large_diff": float(((d.abs() > math.log(2)) * m).sum()) / n,
    }
