"""``all_finite`` agrees with ``torch.isfinite(t).all()`` (the slow oracle) on every dtype moerl moves."""

import pytest
import torch

from moerl.finite import all_finite

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 31, 32, 33, 4099])
def test_one_bad_value_anywhere_is_found(dtype, n):
    base = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert all_finite(base) and all_finite(base.view(-1, 1).expand(n, 3).t())
    for pos in sorted({0, n // 2, n - 1}):
        for value in (float("nan"), float("inf"), -float("inf")):
            x = base.clone()
            x[pos] = value
            assert not all_finite(x) and not all_finite(x.view(-1, 1).expand(n, 3).t()), (pos, value)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float8_e5m2])
def test_float8_every_byte_agrees_with_isfinite(dtype):
    for b in range(256):
        x = torch.tensor([b], dtype=torch.uint8).view(dtype)
        assert all_finite(x) == bool(torch.isfinite(x.float()).all()), b


def test_integers_and_empty_tensors_are_finite():
    assert all_finite(torch.tensor([2**31 - 1, -5])) and all_finite(torch.zeros(0)) and all_finite(torch.tensor(1.0))
