"""CPU training's fused ops (``moerl.cpu.training``): RMSNorm and the attention's q / k norms with RoPE, their
forwards bit for bit torch's ops, their backwards (one C call each) against float64 autograd of the torch ops, in fp32
and bf16; a model's gradients with them swapped in against the plain model's (the backend off: torch's ops); where
they do not apply."""

import pytest
import torch
import torch.nn.functional as F

import moerl.cpu.training as training
from moerl.cpu.kernels import kernel
from moerl.cpu.training import FusedAttention, FusedRMSNorm, NormRopeFn, RmsNormFn, fuses, install_training
from moerl.model.attention import Attention
from moerl.model.norms import RMSNorm
from moerl.model.rope import apply_rope
from moerl.model.transformer import MoEModel
from moerl.presets import preset_config

pytestmark = pytest.mark.skipif(kernel() is None, reason="the kernels do not build here (no C compiler)")

# gradients relative to their largest entry: fp32 sums in another order (measured <= 2e-6, dw over 1,000+ rows);
# bf16 inputs and a once-rounded bf16 result (measured <= 7e-3); a wrong rotation or a skipped norm term is O(1)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _norm_rope_ref(q, k, qw, kw, cos, sin, eps=1e-6):
    """The attention's torch path: per-head norms, then q and k rotated together."""
    if qw is not None:
        q, k = F.rms_norm(q, (q.shape[-1],), qw, eps), F.rms_norm(k, (k.shape[-1],), kw, eps)
    qk = apply_rope(torch.cat([q, k], 2), cos, sin)
    return qk.split([q.shape[2], k.shape[2]], 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 50, 128), (1320, 4, 32), (7, 40), (5, 24)])  # 40, 24: vector tails
def test_rms_norm_backward_against_float64(dtype, shape):
    """dx and dw against float64 autograd of ``F.rms_norm``; the forward equal to ``F.rms_norm`` in the dtype; a
    frozen weight gets no grad. Control: the grad with the norm's x-term dropped (a plain ``g * w * inv``) is beyond
    the tolerance."""
    torch.manual_seed(0)
    d = shape[-1]
    x, g = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
    w = torch.rand(d, dtype=torch.float64) + 0.5
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.rms_norm(xr, (d,), wr, 1e-6).backward(g)
    xa, wa = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    y = RmsNormFn.apply(xa, wa, 1e-6)
    assert torch.equal(y, F.rms_norm(x.to(dtype), (d,), w.to(dtype), 1e-6))
    y.backward(g.to(dtype))
    assert xa.grad.dtype == wa.grad.dtype == dtype
    assert _rel(xa.grad, xr.grad) < TOL[dtype]
    assert _rel(wa.grad, wr.grad) < TOL[dtype]
    inv = (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    assert _rel(g * w * inv, xr.grad) > 4 * TOL[dtype]  # control
    frozen = x.to(dtype).requires_grad_()
    RmsNormFn.apply(frozen, w.to(dtype), 1e-6).backward(g.to(dtype))
    assert _rel(frozen.grad, xr.grad) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("cos_rows", [3, 1])  # 1: cos / sin broadcast over the batch, as positions [1, T] give them
def test_norm_rope_backward_against_float64(dtype, norm, cos_rows):
    """dq, dk and the norms' weight grads against float64 autograd of the attention's torch path (norms, RoPE on q
    and k together); the forward equal to that path in the dtype. Control: the grads of the rotation the other way
    (sin negated) are beyond the tolerance."""
    torch.manual_seed(1)
    b, t, hq, hk, d = 3, 20, 4, 2, 32
    q, k = torch.randn(b, t, hq, d, dtype=torch.float64), torch.randn(b, t, hk, d, dtype=torch.float64)
    qw, kw = (torch.rand(d, dtype=torch.float64) + 0.5 for _ in range(2)) if norm else (None, None)
    angle = torch.rand(cos_rows, t, d // 2, dtype=torch.float64) * 6
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def grads(qq, kk, sn):
        leaves = [z.clone().requires_grad_() if z is not None else None for z in (qq, kk, qw, kw)]
        a, c = _norm_rope_ref(*leaves, cos, sn)
        ((a * gq).sum() + (c * gk).sum()).backward()
        return [z.grad for z in leaves if z is not None]

    want = grads(q, k, sin)
    cast = [z.to(dtype).requires_grad_() if z is not None else None for z in (q, k, qw, kw)]
    a, c = NormRopeFn.apply(*cast, 1e-6, cos.to(dtype), sin.to(dtype))
    with torch.no_grad():
        ra, rc = _norm_rope_ref(
            *(z.to(dtype) if z is not None else None for z in (q, k, qw, kw)), cos.to(dtype), sin.to(dtype)
        )
    assert torch.equal(a, ra) and torch.equal(c, rc)
    ((a.double() * gq).sum() + (c.double() * gk).sum()).backward()
    got = [z.grad for z in cast if z is not None]
    assert len(got) == (4 if norm else 2)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == dtype and _rel(x, y) < TOL[dtype]
    for x, y in zip(grads(q, k, -sin)[:2], want[:2], strict=True):  # control
        assert _rel(x, y) > 10 * TOL[dtype]


def test_a_models_gradients_with_the_fused_ops_match_the_torch_path(monkeypatch):
    """The tiny Qwen3-MoE preset (per-head q / k norms, RoPE) in fp32: one loss's gradients with the fused ops swapped
    in (``install_training``; their kernels called: counted) against the plain model, the backend off (torch's ops:
    no call), within fp32's tolerance, the loss equal bit for bit (the forwards are torch's ops). Control: the
    model with one norm's weight perturbed by 1e-2 lies beyond it."""
    import copy

    torch.manual_seed(0)
    cfg = preset_config("qwen3_moe", "tiny")[1]
    plain = MoEModel(cfg, torch.float32)
    for name, p in plain.named_parameters():  # norms' weights off 1, to exercise their grads
        p.data.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model = copy.deepcopy(plain)
    install_training(model)
    kinds = {type(m) for m in model.modules()}
    assert {FusedRMSNorm, FusedAttention} <= kinds and not {RMSNorm, Attention} & kinds
    assert not {FusedRMSNorm, FusedAttention} & {type(m) for m in plain.modules()}
    ids = torch.randint(0, cfg.vocab_size, (2, 24))

    def run(m):
        m.zero_grad()
        loss = m(ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    calls = {"norm": 0, "rope": 0}
    for name, fn, key in (("RmsNormFn", RmsNormFn, "norm"), ("NormRopeFn", NormRopeFn, "rope")):

        def counted(*args, _apply=fn.apply, _key=key):
            calls[_key] += 1
            return _apply(*args)

        monkeypatch.setattr(getattr(training, name), "apply", counted)
    loss, got = run(model)
    assert calls["norm"] == 2 * cfg.num_layers + 1 and calls["rope"] == cfg.num_layers
    ref_loss, want = run(plain)
    assert calls["norm"] == 2 * cfg.num_layers + 1 and calls["rope"] == cfg.num_layers  # the plain model: none
    assert torch.equal(loss, ref_loss) and got.keys() == want.keys()
    worst = max(_rel(got[n], want[n]) for n in want)
    assert worst < 1e-4, worst
    model.layers[0].self_attn.q_norm.weight.data.add_(1e-2)
    _, moved = run(model)
    assert max(_rel(moved[n], want[n]) for n in want) > 1e-3  # control


def test_fused_ops_apply_only_to_plain_cpu_tensors_with_autograd():
    """Plain CPU tensors with autograd on; a plan's fake tensors where it traces the CPU's paths (what the ops keep
    for the backward is what it counts), not where it traces CUDA's; never fp16, meta or no-grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moerl.device import gpu_paths

    x = torch.randn(4, 8)
    assert fuses(x, torch.nn.Parameter(torch.ones(8)))
    assert not fuses(x.half())
    assert not fuses(x.to("meta"))
    with torch.no_grad():
        assert not fuses(x)
    with FakeTensorMode():
        fake = torch.randn(4, 8, requires_grad=True)
        assert fuses(fake)
        w = torch.ones(8, requires_grad=True)
        RmsNormFn.apply(fake, w, 1e-6).sum().backward()  # a plan's trace: shapes only, no kernel on fake data
        assert fake.grad.shape == fake.shape and w.grad.shape == w.shape
        with gpu_paths():
            assert not fuses(fake)
