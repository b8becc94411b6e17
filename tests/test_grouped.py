"""The grouped GEMM (``moerl.model.grouped``) and the op a compiled graph calls, ``moerl::group_mm``, whose backward
is registered (dx = group_mm of dy by the transposed weights, dw = ``group_mm_wgrad``): values and both gradients
against a per-group float64 loop, on the padded bmm path (small groups) and the grouped-GEMM path (large groups, K
and N not multiples of the 16-byte alignment included). Negative control: keys that put one row in the wrong
group miss the tolerance."""

import pytest
import torch

from moerl.model.grouped import BUCKET_ROWS, Groups, _bucketed, _group_mm_op, group_mm, jits_per_shape

# fp32: sums of <= 600 products of unit normals (2e-6 measured); bf16: one rounding of K-long sums, relative
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _reference(x, w, keys, dy):
    """(y, dx, dw) by a loop over the groups, in float64."""
    x, w, dy = x.double(), w.double(), dy.double()
    y, dx, dw = torch.zeros(x.shape[0], w.shape[2]).double(), torch.zeros_like(x), torch.zeros_like(w)
    for g in range(w.shape[0]):
        rows = keys == g
        y[rows], dx[rows], dw[g] = x[rows] @ w[g], dy[rows] @ w[g].T, x[rows].T @ dy[rows]
    return y, dx, dw


def _through_op(x, w, keys, n_groups, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _group_mm_op(x, w, keys, n_groups)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _error(got, want) -> float:
    pairs = zip(got, want, strict=True)
    return max(float((a.double() - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, k, n",
    [(12, 16, 24), (600, 16, 24), (600, 4, 24), (600, 6, 5)],
    ids=["padded", "grouped", "rank4", "unaligned"],
)
def test_the_compiled_graphs_grouped_gemm_and_its_gradients_equal_a_loop(dtype, rows, k, n):
    gen = torch.Generator().manual_seed(0)
    n_groups = 4
    keys = torch.randint(0, n_groups - 1, (rows,), generator=gen).sort().values  # the last group has no rows
    x = torch.randn(rows, k, generator=gen).to(dtype)
    # the weights as the experts hand them over: a transposed view of [G, N, K]
    w = torch.randn(n_groups, n, k, generator=gen).to(dtype).transpose(1, 2)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    assert Groups(keys, n_groups).padded == (rows == 12)
    want = _reference(x, w, keys, dy)
    got = _through_op(x, w, keys, n_groups, dy)
    assert all(g.dtype == dtype for g in got) and got[2].shape == w.shape
    assert float(got[2][n_groups - 1].abs().max()) == 0.0  # a group without rows gets no gradient
    assert _error(got, want) <= TOL[dtype]
    assert _error((group_mm(x, w, Groups(keys, n_groups)),), want[:1]) <= TOL[dtype]  # the eager path, same rule

    # negative control: the first row of group 1 counted in group 0
    moved = keys.clone()
    moved[int((keys == 1).nonzero()[0])] = 0
    assert _error(_through_op(x, w, moved, n_groups, dy), want) > TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, k, n",
    [(12, 16, 24), (600, 16, 24), (600, 4, 24), (600, 6, 10), (600, 2, 12)],
    ids=["padded", "aligned", "rank4", "unaligned", "rank2"],
)
def test_the_ops_fakes_have_the_real_outputs_sizes_and_strides(dtype, rows, k, n):
    # a compiled graph plans every later op from the fake; torch's opcheck compares fake and real outputs (sizes,
    # strides, dtype), the schema and the autograd registration, forward and backward
    from moerl.model.grouped import _group_mm_wgrad_op

    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 3, (rows,), generator=gen).sort().values
    x = torch.randn(rows, k, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(4, n, k, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    torch.library.opcheck(_group_mm_op, (x, w, keys, 4))
    torch.library.opcheck(_group_mm_wgrad_op, (x.detach(), torch.randn(rows, n).to(dtype), keys, 4))


def test_a_compiled_graph_reads_an_unaligned_grouped_gemm_as_eager_does():
    # the strided output of a padded K / N once met a contiguous fake: "expected ... stride 12==10" at run time
    gen = torch.Generator().manual_seed(0)
    keys = torch.arange(2).repeat_interleave(200)
    x, w = torch.randn(400, 6, generator=gen), torch.randn(2, 6, 10, generator=gen)

    def f(x, w, keys):
        return _group_mm_op(x, w, keys, 2).t() * 2 + 1

    want = f(x, w, keys)
    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor", fullgraph=True)(x, w, keys)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)  # fp32: the same GEMM, elementwise ops after it
    assert not torch.allclose(got, want + 1e-3, atol=1e-5, rtol=0)  # the tolerance catches a small shift


@pytest.mark.parametrize("n, padded", [(64, True), (1024, False)], ids=["small-weights", "streamed-weights"])
def test_decode_sized_groups_pad_unless_each_fp32_weight_is_streamed(n, padded, monkeypatch):
    """Groups of decode size may take the padded bmm; fp32 groups whose weight passes PAD_MAX_FP32_BYTES (1 MiB
    here: K 256 x N 1024) take the per-group GEMMs instead, and both equal a loop over the groups."""
    from moerl.model import grouped

    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 8, (24,), generator=gen).sort().values
    x, w = torch.randn(24, 256, generator=gen), torch.randn(8, 256, n, generator=gen)
    groups = Groups(keys, 8)
    assert groups.padded and grouped.streams_weights(w) == (not padded)
    used = []
    monkeypatch.setattr(Groups, "pad", lambda self, rows, pad=Groups.pad: used.append(1) or pad(self, rows))
    want = torch.cat([x[keys == g] @ w[g] for g in range(8)])
    assert torch.allclose(group_mm(x, w, groups), want, atol=1e-4, rtol=1e-5)
    assert bool(used) == padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_grouped_gemm_and_its_autograd_equal_a_loop(dtype):
    """The eager path a training forward takes (autograd through it, not the op): values and both gradients against
    the float64 loop. In bf16 each group's rows go to the GEMM padded to a multiple of ``BUCKET_ROWS`` (oneDNN
    compiles a kernel per shape: padded, a step's shapes repeat), zeros past them, each row at its own place."""
    gen = torch.Generator().manual_seed(1)
    n_groups, rows = 5, 700
    keys = torch.randint(0, n_groups, (rows,), generator=gen).sort().values
    keys[keys == 3] = 2  # a group without rows
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(n_groups, 80, 96, generator=gen).to(dtype).transpose(1, 2)
    dy = torch.randn(rows, 80, generator=gen).to(dtype)
    groups = Groups(keys, n_groups)
    assert not groups.padded
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = group_mm(xg, wg, groups)
    y.backward(dy)
    want = _reference(x, w, keys, dy)
    assert _error((y.detach(), xg.grad, wg.grad), want) <= TOL[dtype]
    assert jits_per_shape(x) == (dtype == torch.bfloat16)
    (buf,), place, ends = _bucketed(groups, x)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert bool((sizes % BUCKET_ROWS == 0).all()) and int(sizes[3]) == 0
    rest = torch.ones(buf.shape[0], dtype=torch.bool)
    rest[place] = False
    assert torch.equal(buf[place], x) and not bool(buf[rest].any())  # the padding rows zeros
    # negative control: one row's place off by one lands it beside its group's padding, and the result moves
    wrong = place.clone()
    wrong[0] += 1
    shifted = torch.zeros_like(buf).index_copy(0, wrong, x)
    got = torch._grouped_mm(shifted, w.contiguous(), offs=ends).index_select(0, place)
    assert _error((got,), want[:1]) > TOL[dtype]
