"""Tolerances for logprobs of the same tokens and weights computed two ways whose kernels see other shapes (rank
layouts, packed rows, batch composition), shared by the tests that compare them."""

import torch

# fp32: ~170 unit roundoffs of a logprob of order 1..10 (measured <= 4.8e-7 across rank layouts and packed rows)
FP32_LOGPROBS = 1e-5
# bf16: the logits leave lm_head in bf16, whose rounding step for a logit in [4, 8) is 2^-5: an accumulation-order
# difference that flips one rounding moves that token's logprob by ~0.03. Allowed: two such steps on a token, a mean
# of 2e-3 over the tokens
BF16_LOGPROBS_MAX, BF16_LOGPROBS_MEAN = 2 * 2**-5, 2e-3


def logprobs_agree(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    """Whether ``got`` agrees with the reference ``want`` within ``dtype``'s tolerance (the mean over the tokens the
    reference scored: its non-zero entries)."""
    d = (got - want).abs()
    if dtype == "float32":
        return float(d.max()) <= FP32_LOGPROBS
    return float(d.max()) <= BF16_LOGPROBS_MAX and float(d[want != 0].mean()) <= BF16_LOGPROBS_MEAN
