"""MXFP8: the quantizer against torchao and hand-computed vectors; MX GEMM gradients; an MXFP8 training run."""

import pytest
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

from moerl.errors import ConfigError
from moerl.model.grouped import Groups, group_mm
from moerl.model.mx import MXExperts, MXLinear, mx_fake_quant, mx_group_mm, mx_linear, mx_quantize
from moerl.trainer import OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import sft_loss


def block(*values):
    return torch.tensor(list(values) + [0.0] * (32 - len(values)))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # floor (OCP): X = 2^(floor(log2 amax) - 8) = 2; 1000 / 2 = 500 saturates to 448 -> 896
        ("floor", [1.0, 0.5, 448.0, 896.0]),
        # rceil: X = 2^ceil(log2(amax / 448)) = 4; 1000 / 4 = 250 rounds to 256 -> 1024
        ("rceil", [1.0, 0.5, 448.0, 1024.0]),
    ],
)
def test_hand_computed_saturation_and_scales(mode, expected):
    out = mx_fake_quant(block(1.0, 0.5, 448.0, 1000.0)[None], mode=mode)[0]
    assert out[:4].tolist() == expected and (out[4:] == 0).all()


def test_hand_computed_rounding_zero_and_tiny_blocks():
    # amax 1.0625: X = 2^-8; 1.0625 * 256 = 272 is a tie between 256 and 288 -> even mantissa -> 256 -> 1.0
    assert mx_fake_quant(block(1.0625, 0.75)[None], mode="floor")[0, :2].tolist() == [1.0, 0.75]
    assert (mx_fake_quant(torch.zeros(2, 64)) == 0).all()  # all-zero blocks stay zero
    # 1e-30: X = 2^(floor(log2 1e-30) - 8) = 2^-108; 1e-30 * 2^108 = 324.5 -> 320 (E4M3 step 32 there)
    tiny = mx_fake_quant(torch.full((1, 32), 1e-30), mode="floor")
    assert torch.equal(tiny, torch.full((1, 32), 320 * 2.0**-108))


def test_non_finite_blocks_become_nan():
    x = torch.ones(3, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    out = mx_fake_quant(x)
    assert out[0, :32].isnan().all() and torch.equal(out[0, 32:], x[0, 32:])
    assert out[1, 32:].isnan().all() and torch.equal(out[1, :32], x[1, :32])
    assert torch.equal(out[2], x[2])


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_exact_against_torchao_along_any_dim(mode, dtype):
    torchao_mode = ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    scale, data = mx_quantize(x, mode)
    ref_scale, ref_data = to_mx(x, torch.float8_e4m3fn, 32, torchao_mode)
    assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    ref_cols = to_dtype(
        *reversed(to_mx(x.T.contiguous(), torch.float8_e4m3fn, 32, torchao_mode)), torch.float8_e4m3fn, 32, dtype
    ).T
    assert torch.equal(mx_fake_quant(x, 0, mode), ref_cols)
    odd = x[:, :40]  # K not a multiple of 32: zero-padded, then cropped
    ref_odd = to_dtype(
        *reversed(to_mx(torch.nn.functional.pad(odd, (0, 24)), torch.float8_e4m3fn, 32, torchao_mode)),
        torch.float8_e4m3fn,
        32,
        dtype,
    )[:, :40]
    assert torch.equal(mx_fake_quant(odd, -1, mode), ref_odd)


def test_unknown_scale_mode():
    with pytest.raises(ConfigError, match=r"MX scale mode 'even': allowed: floor, rceil"):
        mx_fake_quant(torch.ones(1, 32), mode="even")


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_mx_linear_gradients_close_to_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 128, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(64, 128, generator=g) * 0.1).bfloat16().requires_grad_()
    r = torch.randn(96, 64, generator=g).bfloat16()
    (mx_linear(x, w, None, "rceil") * r).sum().backward()
    mx_gx, mx_gw = x.grad.float(), w.grad.float()
    x.grad = w.grad = None
    (torch.nn.functional.linear(x, w) * r).sum().backward()
    # E4M3 keeps 3 mantissa bits: ~3% relative error per GEMM operand; stated tolerance 8% (relative Frobenius)
    assert _rel(mx_gx, x.grad.float()) < 0.08 and _rel(mx_gw, w.grad.float()) < 0.08
    assert _rel(mx_gx, x.grad.float()) > 1e-4  # and it is really quantized


def test_mx_grouped_gemm_gradients_close_to_bf16():
    g = torch.Generator().manual_seed(1)
    experts, k, n = 4, 64, 96
    keys = torch.sort(torch.randint(0, experts, (150,), generator=g)).values
    groups = Groups(keys, experts)
    x = torch.randn(150, k, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(experts, k, n, generator=g) * 0.1).bfloat16().requires_grad_()
    r = torch.randn(150, n, generator=g).bfloat16()
    (mx_group_mm(x, w, groups, "rceil") * r).sum().backward()
    mx_gx, mx_gw = x.grad.float(), w.grad.float()
    x.grad = w.grad = None
    (group_mm(x, w, groups) * r).sum().backward()
    assert _rel(mx_gx, x.grad.float()) < 0.08 and _rel(mx_gw, w.grad.float()) < 0.08


@pytest.mark.parametrize("sizes", [[303, 32, 0, 265], [13, 32, 0, 3]], ids=["grouped", "padded"])
def test_the_mx_weight_gradient_quantizes_each_groups_tokens_in_its_own_blocks(sizes):
    """The experts' weight gradient reduces over each group's tokens, quantized along them in blocks of 32 that
    start at the group's first row (a group's last block zero-padded), as a per-group float64 loop computes it;
    within 1e-5 of each group's largest entry (fp32 GEMMs of the same quantized operands). The layout is sized from
    the shapes, with no host read of the counts. Negative control: blocks of 32 over the sorted rows as they lie
    (blocks straddling two groups)."""
    g = torch.Generator().manual_seed(2)
    experts, k, n, rows = 4, 32, 48, sum(sizes)  # a group without rows, one of exactly a block
    keys = torch.arange(experts).repeat_interleave(torch.tensor(sizes))
    # each group's rows at their own magnitude: a block that straddled two groups would take the larger one's scale
    scale = torch.tensor([1.0, 300.0, 1.0, 0.01]).repeat_interleave(torch.tensor(sizes))[:, None]
    x = (torch.randn(rows, k, generator=g) * scale).requires_grad_()
    w = torch.randn(experts, k, n, generator=g)
    r = torch.randn(rows, n, generator=g)
    w.requires_grad_()
    (mx_group_mm(x, w, Groups(keys, experts), "rceil") * r).sum().backward()

    def reference(aligned: bool) -> torch.Tensor:
        def blocks(t, rows_of_group):  # zero-padded to whole blocks per group, or the whole sorted buffer at once
            t = t.detach()
            if not aligned:
                t = mx_fake_quant(torch.cat([t, t.new_zeros(-t.shape[0] % 32, t.shape[1])]), 0, "rceil")[: t.shape[0]]
                return [t[m] for m in rows_of_group]
            out = []
            for m in rows_of_group:
                part = t[m]
                part = torch.cat([part, part.new_zeros(-part.shape[0] % 32, part.shape[1])])
                out.append(mx_fake_quant(part, 0, "rceil") if part.shape[0] else part)
            return out

        masks = [keys == e for e in range(experts)]
        xs, rs = blocks(x, masks), blocks(r, masks)
        return torch.stack([a.double().T @ b.double() for a, b in zip(xs, rs, strict=True)])

    got = w.grad.double()
    for aligned in (True, False):
        want = reference(aligned)
        err = float(((got - want).abs() / want.abs().amax((1, 2), keepdim=True).clamp(min=1e-30)).max())
        assert (err < 1e-5) if aligned else (err > 1e-3), err


def test_mxfp8_training_loss_falls_and_keeps_router_embeddings_unquantized(hf_checkpoints):
    from test_trainer import make_batch

    pol = Policy(
        hf_checkpoints["Qwen3MoeForCausalLM"][0],
        PolicyConfig(mode="mxfp8", dtype="bfloat16", optim=OptimConfig(lr=1e-3)),
    )
    model = pol.model
    q_proj, experts = model.layers[0].self_attn.q_proj, model.layers[0].mlp.experts
    assert isinstance(q_proj, MXLinear) and isinstance(experts, MXExperts)
    assert q_proj.mode == "rceil" and experts.mode == "rceil"
    assert not hasattr(model.layers[0].mlp.router, "mode") and type(model.lm_head) is torch.nn.Linear
    assert model.layers[0].mlp.router.weight.dtype == torch.float32
    batch = make_batch()
    losses = [pol.train_step(batch, sft_loss)["loss"] for _ in range(10)]
    assert losses[-1] < losses[0] - 0.3, losses


def test_mxfp8_without_torchao_is_refused_by_name(monkeypatch):
    import sys

    from moerl.errors import ConfigError
    from moerl.model.mx import _mode

    monkeypatch.setitem(sys.modules, "torchao.prototype.mx_formats.config", None)  # as where torchao is absent
    with pytest.raises(ConfigError, match=r"MXFP8 \(policy.mode=mxfp8\) needs torchao 0\.18.*lora / full mode"):
        _mode("rceil")
    monkeypatch.undo()
    assert _mode("rceil") is not None  # with torchao: the scale mode


def test_inference_keeps_quantized_weights_until_they_change():
    """Without autograd, an engine's MX layers (``keep=True``) quantize each weight once per weight version: the
    output is bit for bit the autograd path's, a weight changed in place (a sync's copy) is quantized again, into the
    kept tensor (the cached result would miss: negative control), and a training forward takes the autograd path."""
    from moerl.model.mx import apply_mxfp8
    from moerl.presets import init_model

    model = init_model("qwen3_moe", "tiny", dtype=torch.float32)
    apply_mxfp8(model, "rceil", keep=True)
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        want = model(ids).logits.detach()  # every GEMM through the autograd functions
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        q = model.layers[0].self_attn.q_proj
        assert q._mx_kept  # kept after the first inference forward
        kept = next(iter(q._mx_kept.values()))[1]
        before = kept.clone()
        q.weight.mul_(1.5)  # in place, as a sync commits
        moved = model(ids).logits
    with torch.enable_grad():
        assert torch.equal(moved, model(ids).logits.detach())
    # quantized again into the same tensor (which a compiled graph reads as its input)
    assert next(iter(q._mx_kept.values()))[1] is kept and not torch.equal(kept, before)
    assert (moved - want).abs().max() > 1e-3


def test_a_trainers_mx_layers_quantize_at_every_forward():
    """A trainer's MX layers (the default, ``keep=False``) keep nothing between forwards: FSDP all-gathers a layer's
    weights into the same storage each forward without bumping their version counter, which this test does by
    writing through ``.data``. The next forward without autograd sees the new weights; an engine's layers
    (``keep=True``) would go on with the stale quantization (negative control: why a trainer must not keep)."""
    from moerl.model.mx import apply_mxfp8
    from moerl.presets import init_model

    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    outs = {}
    for keep in (False, True):
        model = init_model("qwen3_moe", "tiny", dtype=torch.float32, seed=0)
        apply_mxfp8(model, "rceil", keep=keep)
        q = model.layers[0].self_attn.q_proj
        with torch.no_grad():
            model(ids)
            version = q.weight._version
            q.weight.data.mul_(1.5)  # new values at the same address, the version unchanged (as FSDP's all-gather)
            assert q.weight._version == version
            outs[keep] = model(ids).logits
        assert bool(q.__dict__.get("_mx_kept")) == keep
        with torch.enable_grad():
            want = model(ids).logits.detach()  # the autograd path quantizes the weights as they are
        outs[keep] = (outs[keep] - want).abs().max()
    assert outs[False] == 0
    assert outs[True] > 1e-3
