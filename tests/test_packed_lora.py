"""LoRA slots in the CPU decode kernels (``moerl.cpu.kernels``): the experts' adapters inside ``moe_decode`` and a
linear layer's delta in one call (``lora_add``), each against a float64 loop, with negative controls and the errors
they name; an engine's own model taking both, eager and in its compiled step."""

import pytest
import torch
import torch.nn.functional as F
from test_engine_lora import K3, _logprob_k3, _trained_adapter
from test_packed import PATHS, expert_path

import moerl.cpu.kernels as packed_module
from moerl.bridges import load_model
from moerl.cpu.kernels import bf16_dot, bf16_linear, kernel, linear_panels, lora_add, moe_decode, pack
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.presets import init_model

pytestmark = pytest.mark.skipif(kernel() is None, reason="the packed kernels do not build here (no C compiler)")

# a float64 loop against the kernels' fp32 sums (their order differs): fp32 within 1e-5 of the largest output, bf16
# within 2^-8 of it (the result's one rounding); the adapters move the outputs by ~30%, a slot off by one token or a
# factor 3% off by more than the tolerance (the controls)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-8}
E, H, INTER, K, S, R = 8, 128, 96, 2, 3, 4


def _adapter(shared: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random factors of S slots (fp32) in the experts' shapes, and each slot's scale."""
    lead = (S,) if shared else (S, E)

    def rand(*shape, scale):
        return torch.randn(*shape, generator=gen) * scale

    return {
        "scale": torch.tensor([0.5, 2.0, 1.5]),
        "gate_up_A": rand(*lead, R, H, scale=H**-0.5),
        "gate_up_B": rand(S, E, 2 * INTER, R, scale=0.4),
        "down_A": rand(S, E, R, INTER, scale=INTER**-0.5),
        "down_B": rand(*lead, H, R, scale=0.4),
    }


def _factors(a: dict[str, torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """``moe_decode``'s lora list (``LORA_PARTS``) from the adapter's factors."""
    gate_up_b = pack(a["gate_up_B"].transpose(-1, -2).flatten(0, 1), True)
    down_bt = a["down_B"].transpose(-1, -2).contiguous()
    return [slots, a["scale"], a["gate_up_A"], gate_up_b, a["down_A"], down_bt]


def _oracle(x, idx, gate, gate_up, down, a, slots) -> torch.Tensor:
    """Each token's experts with its slot's deltas (before the activation; on the down rows), float64."""
    shared = a["gate_up_A"].dim() == 3
    gate = gate.to(x.dtype).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        s, xn = int(slots[n]), x[n].double()
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            h = xn @ gate_up[e].double()
            if s >= 0:
                ga = a["gate_up_A"][s] if shared else a["gate_up_A"][s, e]
                h = h + a["scale"][s].double() * (xn @ ga.double().T) @ a["gate_up_B"][s, e].double().T
            act = F.silu(h[:INTER]) * h[INTER:] * gate[n, j]
            out[n] += act @ down[e].double()
            if s >= 0:
                db = a["down_B"][s] if shared else a["down_B"][s, e]
                out[n] += a["scale"][s].double() * (act @ a["down_A"][s, e].double().T) @ db.double().T
    return out


@pytest.mark.parametrize(("dtype", "path"), PATHS)
@pytest.mark.parametrize("layout", ["shared_outer", "per_expert"])
@pytest.mark.parametrize("mixed", [False, True])
def test_the_experts_adapters_in_one_call_compute_each_tokens_own(layout, mixed, dtype, path, monkeypatch):
    """``moe_decode`` with LoRA slots against a float64 loop: one slot for every token, or a mix of the three slots
    and none (a token without one gets exactly the base kernel's output). Controls: the slots rolled by one token (one
    slot: the next slot), and the down B 3% off. bf16 on AMX's tiles and on vector FMAs."""
    expert_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(5)
    tokens = 37
    gate_up = (torch.randn(E, H, 2 * INTER, generator=gen) * H**-0.5).to(dtype)
    down = (torch.randn(E, INTER, H, generator=gen) * INTER**-0.5).to(dtype)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    gate = torch.rand(tokens, K, generator=gen).softmax(-1)
    a = _adapter(layout == "shared_outer", gen)
    slots = torch.randint(-1, S, (tokens,), generator=gen) if mixed else torch.full((tokens,), 1)
    panels = pack(gate_up, True), pack(down, False)
    with torch.no_grad():
        got = moe_decode(x, idx, gate, *panels, _factors(a, slots))
        base = moe_decode(x, idx, gate, *panels)
    want = _oracle(x, idx, gate, gate_up, down, a, slots)
    tol = TOL[dtype] * want.abs().max()
    assert got.dtype == dtype and (got.double() - want).abs().max() <= tol
    assert torch.equal(got[slots < 0], base[slots < 0])
    assert (want - _oracle(x, idx, gate, gate_up, down, a, torch.full_like(slots, -1))).abs().max() > 0.1
    other = slots.roll(1) if mixed else (slots + 1) % S
    assert (got.double() - _oracle(x, idx, gate, gate_up, down, a, other)).abs().max() > tol
    off = a | {"down_B": a["down_B"] * 1.03}
    assert (got.double() - _oracle(x, idx, gate, gate_up, down, off, slots)).abs().max() > tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
def test_a_linear_layers_adapters_in_one_call_add_each_rows_own(per_row, dtype):
    """``lora_add`` against a float64 product: one slot for all rows or each row's own (-1: the row as it was),
    rows of any leading shape, outputs not a multiple of a vector. Control: the slots rolled by one row (one slot:
    the next slot)."""
    gen = torch.Generator().manual_seed(6)
    din, dout = 96, 84
    a, b = torch.randn(S, R, din, generator=gen), torch.randn(S, dout, R, generator=gen)
    scale = torch.tensor([0.5, 2.0, 1.5])
    x, y = torch.randn(5, 7, din, generator=gen).to(dtype), torch.randn(5, 7, dout, generator=gen).to(dtype)
    slots = torch.randint(-1, S, (35,), generator=gen) if per_row else torch.full((35,), 2)

    def oracle(slots):
        rows, out = x.reshape(35, din).double(), y.reshape(35, dout).double().clone()
        for n, s in enumerate(slots.tolist()):
            if s >= 0:
                out[n] += scale[s].double() * (rows[n] @ a[s].double().T) @ b[s].double().T
        return out.view(5, 7, dout)

    got = lora_add(x, y, slots if per_row else 2, a, b.transpose(1, 2).contiguous(), scale)
    want = oracle(slots)
    tol = TOL[dtype] * want.abs().max()
    assert got.dtype == dtype and got.shape == y.shape and (got.double() - want).abs().max() <= tol
    assert torch.equal(got.reshape(35, dout)[slots < 0], y.reshape(35, dout)[slots < 0])
    assert (got.double() - oracle(slots.roll(1) if per_row else (slots + 1) % S)).abs().max() > tol


def test_the_adapters_kernels_name_what_they_do_not_take():
    """A slot past the adapters' and factors that do not match the experts or rows are named; nothing is written."""
    gen = torch.Generator().manual_seed(7)
    gate_up, down = pack(torch.randn(E, H, 2 * INTER), True), pack(torch.randn(E, INTER, H), False)
    x, idx, gate = torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
    lora = _factors(_adapter(True, gen), torch.tensor([0, 3, -1]))
    with pytest.raises(ValueError, match=r"a LoRA slot outside -1..2 \(max 3\)"):
        moe_decode(x, idx, gate, gate_up, down, lora)
    lora[0] = torch.tensor([0, 1])
    named = r"LoRA factors for 8 experts of \[128, 96\] and 3 rows: slot torch.int64 \(2,\)"
    with pytest.raises(ValueError, match=named):
        moe_decode(x, idx, gate, gate_up, down, lora)
    lora[0], lora[4] = torch.tensor([0, 1, 2]), torch.randn(S, E, R, INTER + 1)
    with pytest.raises(ValueError, match=r"down_A torch.float32 \(3, 8, 4, 97\)"):
        moe_decode(x, idx, gate, gate_up, down, lora)
    a, bt, scale = torch.randn(S, R, H), torch.randn(S, R, 64), torch.ones(S)
    with pytest.raises(ValueError, match=r"lora_add: a LoRA slot outside -1..2 \(max 5\)"):
        lora_add(x, torch.randn(3, 64), torch.tensor([0, 5, 1]), a, bt, scale)
    with pytest.raises(ValueError, match=r"lora_add: rows torch.float32 \(3, 128\), output torch.float32 \(3, 60\)"):
        lora_add(x, torch.randn(3, 60), 0, a, bt, scale)


BIG = {"num_hidden_layers": 2, "hidden_size": 256, "moe_intermediate_size": 384}  # fp32 experts the kernel streams


@pytest.mark.parametrize(
    ("layout", "dtype"), [("shared_outer", "float32"), ("per_expert", "float32"), ("shared_outer", "bfloat16")]
)
def test_an_engines_adapters_decode_in_the_kernels(layout, dtype, tmp_path, monkeypatch):
    """An engine's own CPU model (loaded by path) decodes two adapters and no adapter in one batch through the
    kernels (its experts' one call with the adapters' deltas; its projections' ``lora_add``, or in bf16 on AMX the
    GEMM and the delta in one ``bf16_linear``: seen called), each request equal to its fp32 merged model (k3 <= 1e-6
    in fp32, 1e-3 in bf16, as tests/test_engine_lora.py) and the base model beyond it for an adapter's requests."""
    import moerl.cpu.experts as experts_module
    import moerl.cpu.linear as linear_module

    calls = {"experts": 0, "linear": 0, "fused": 0}

    def spy(fn, key, lora_at):
        def wrapped(*args):
            calls[key] += lora_at is None or bool(args[lora_at])  # moe_decode: with adapters
            return fn(*args)

        return wrapped

    monkeypatch.setattr(experts_module, "moe_decode", spy(experts_module.moe_decode, "experts", 5))
    on_bf16_dot = dtype == "bfloat16" and bf16_dot()
    linear = "bf16_linear" if on_bf16_dot else "lora_add"
    lora_at = 3 if on_bf16_dot else None
    monkeypatch.setattr(linear_module, linear, spy(getattr(linear_module, linear), "linear", lora_at))
    # q / k / v with their adapters in one call (fused_projections: its LoRA arguments), o_proj its own
    monkeypatch.setattr(linear_module, "fused_bf16", spy(linear_module.fused_bf16, "fused", None))
    path = tmp_path / "big"
    init_model("qwen3_moe", "tiny", path, overrides=BIG)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")  # this preset has no dense MLP layer
    adapters = {
        "s": _trained_adapter(path, "shared_outer", rank=4, seed=1, targets=targets),
        "p": _trained_adapter(path, layout, rank=4, seed=2, targets=targets),
    }
    cfg = EngineConfig(max_num_seqs=6, max_model_len=48, max_loras=2, max_lora_rank=4, lora_layout=layout)
    engine = LLMEngine(path, cfg, dtype=getattr(torch, dtype))
    engine.direct = None  # the modules' calls spied on (the bound step gives their bits: tests/test_direct.py)
    for name, (tensors, _) in adapters.items():
        engine.add_adapter(name, tensors)
    names = ["s", "p", None]
    prompts = [[5, 9, 14, 3, 22], [40, 41, 42, 43], [7, 7, 8], [11, 12], [60, 61, 62], [3, 4, 5, 6]]
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i), adapter=names[i % 3])
        for i, p in enumerate(prompts)
    ]
    base = load_model(path, dtype=torch.float32)
    outs = engine.generate(reqs)
    assert calls["experts"] >= 7 * len(engine.model.moe_layer_ids)
    own = calls["linear"] - calls["fused"]  # the layers' own calls with adapters; the fused ones run three layers
    assert own + 3 * calls["fused"] >= 7 * 4 * 2 and (calls["fused"] >= 7 * 2) == on_bf16_dot
    tol = K3[dtype]
    for req, out in zip(reqs, outs, strict=True):
        oracle = base if req.adapter is None else adapters[req.adapter][1]
        assert _logprob_k3(oracle, out) <= tol, req.adapter
        if req.adapter is not None:
            assert _logprob_k3(base, out) > tol
    # another adapter loaded where "p" was (its slot's factors written in place): the kernels' kept arguments are
    # made again, and "p"'s requests now follow the new adapter's merged model, not the old one's
    engine.remove_adapter("p")
    engine.add_adapter("p", adapters["s"][0])
    again = [r for r in reqs if r.adapter == "p"]
    for out in engine.generate(again):
        assert _logprob_k3(adapters["s"][1], out) <= tol
        assert _logprob_k3(adapters["p"][1], out) > tol


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_a_bf16_projections_adapters_join_its_amx_sums(per_row, bias):
    """``bf16_linear`` with LoRA slots (the base GEMM on AMX and each row's delta in one call) against a float64
    product: the sums rounded once to bf16 (2^-8 of each output plus 1e-3), a row without a slot exactly the plain
    call's. Control: the slots rolled by one row (one slot: the next slot). Bad slots and factors are named."""
    if not bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    gen = torch.Generator().manual_seed(8)
    k, n = 128, 96
    layer = torch.nn.Linear(k, n, bias=bias).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
    a, b = torch.randn(S, R, k, generator=gen) * 0.2, torch.randn(S, n, R, generator=gen) * 0.2
    scale = torch.tensor([0.5, 2.0, 1.5])
    x = torch.randn(5, 7, k, generator=gen).bfloat16()
    slots = torch.randint(-1, S, (35,), generator=gen) if per_row else torch.full((35,), 1)
    factors = [scale, a, pack(b.transpose(1, 2), False)]

    def oracle(slots):
        rows = x.reshape(35, k).double()
        out = rows @ layer.weight.double().T + (layer.bias.double() if bias else 0)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                out[i] += scale[s].double() * (rows[i] @ a[s].double().T) @ b[s].double().T
        return out.view(5, 7, n)

    panels = linear_panels(layer, layer.weight)
    got = bf16_linear(x, panels, layer.bias, [slots, *factors])
    want = oracle(slots)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 7, n)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-3).all()
    plain = bf16_linear(x, panels, layer.bias).reshape(35, n)
    assert torch.equal(got.reshape(35, n)[slots < 0], plain[slots < 0])
    other = oracle(slots.roll(1) if per_row else (slots + 1) % S)
    assert not ((got.double() - other).abs() <= other.abs() * 2**-8 + 1e-3).all()
    with pytest.raises(ValueError, match=r"bf16_linear: a LoRA slot outside -1..2 \(max 3\)"):
        bf16_linear(x, panels, None, [torch.full((35,), 3), *factors])
    with pytest.raises(ValueError, match=r"bf16_linear: LoRA slots, scale, A, B\^T panels for 35 rows of \[128\]"):
        bf16_linear(x, panels, None, [slots[:34], *factors])


def _lora_layers(ctx, gen: torch.Generator, outs: tuple[int, ...], k: int = 128) -> tuple:
    """bf16 ``LoraLinear`` layers of one input as an engine lays them out (the backend's, on panels), random
    factors."""
    from moerl.cpu import kernel_module
    from moerl.model.lora import LinearLora, LoraLinear

    layers = []
    for n in outs:
        layer = LoraLinear(k, n, bias=False).bfloat16()
        layer.lora = LinearLora(ctx, S, R, k, n, 0.0, torch.bfloat16)
        layer = kernel_module(layer)
        assert layer.has_panels
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.1)
            layer.lora.lora_A.copy_(torch.randn(S, R, k, generator=gen) * 0.2)
            layer.lora.lora_B.copy_(torch.randn(S, n, R, generator=gen) * 0.2)
            layer.lora.scale.copy_(torch.tensor([0.5, 2.0, 1.5]))
        layers.append(layer)
    return tuple(layers)


def test_projections_with_adapters_in_one_call_give_each_ones_bits():
    """``fused_projections`` of three ``LoraLinear`` layers (q / k / v) with a slot per row: one AMX call whose
    adapters' A are stacked along the rank and B^T's panels side by side (zeros beyond each layer's own rank rows)
    gives each layer's own call bit for bit; an adapter written in place is taken up by the next call (against each
    layer's call again; the control: the first result no longer matches). Layers whose scales differ (one scale a
    slot in the kernel) are not fused: None, and each runs its own call."""
    if not bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    from moerl.cpu.linear import fused_projections
    from moerl.model.lora import LoraContext

    gen = torch.Generator().manual_seed(11)
    ctx, owner = LoraContext(), torch.nn.Module()
    nt = 2 * kernel().moerl_panel_vector()
    layers = _lora_layers(ctx, gen, (4 * nt, 2 * nt, 2 * nt))
    x = torch.randn(12, 1, 128, generator=gen).bfloat16()
    ctx.set(torch.randint(-1, S, (12,), generator=gen), 12, 1)
    with torch.inference_mode():
        fused = fused_projections(owner, layers, x)
        assert all(torch.equal(a, layer(x)) for a, layer in zip(fused, layers, strict=True))
        with torch.no_grad():
            layers[2].lora.lora_B[1].mul_(-1.0)  # an adapter load writes its slot in place
        again = fused_projections(owner, layers, x)
        assert all(torch.equal(a, layer(x)) for a, layer in zip(again, layers, strict=True))
        assert not torch.equal(again[2], fused[2]) and torch.equal(again[0], fused[0])
        args, _, tile_r0 = owner._fused_bf16_memo[2]  # each panel's first shrink: 0, r, 2r by layer
        assert tile_r0.tolist() == [0] * 4 + [R] * 2 + [2 * R] * 2
        panels = packed_module.fused_linear(owner, layers)[0]
        with pytest.raises(ValueError, match=r"bf16_linear: LoRA slots, scale, A, B\^T panels for 12 rows of \[128\]"):
            packed_module.bf16_lora(args, panels, tile_r0 + 1)  # the last layer's shrinks past A's rank rows
        with torch.no_grad():
            layers[1].lora.scale[2] = 3.0
        assert fused_projections(owner, layers, x) is None


def test_a_lora_projections_kernel_arguments_are_made_again_when_a_factor_changes():
    """An engine's bf16 ``LoraLinear`` keeps its ``bf16_linear`` arguments (panels, factors, the checked struct) from
    step to step: the same ones while nothing changes, made again when an adapter load writes a factor in place or
    the rows change. Each output against a float64 product of the factors of the moment (2^-8 of each output plus
    1e-3); control: the output after the write differs from the one before beyond that."""
    if not bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    from moerl.model.lora import LoraContext

    k, n = 128, 96
    ctx, gen = LoraContext(), torch.Generator().manual_seed(9)
    (layer,) = _lora_layers(ctx, gen, (n,), k)

    def oracle(x):
        rows = x.reshape(-1, k).double()
        a, b, s = (t.double() for t in (layer.lora.lora_A[1], layer.lora.lora_B[1], layer.lora.scale[1]))
        return (rows @ layer.weight.double().T + s * (rows @ a.T) @ b.T).view(*x.shape[:-1], n)

    def close(got, want):
        return bool(((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-3).all())

    x = torch.randn(8, 1, k, generator=gen).bfloat16()
    ctx.set(1, 8, 1)
    with torch.inference_mode():
        first = layer(x)
        memo = layer._bf16_memo
        assert close(first, oracle(x)) and close(layer(x), oracle(x)) and layer._bf16_memo is memo
        with torch.no_grad():
            layer.lora.lora_B[1].mul_(-1.0)  # an adapter load writes its slot in place
        second = layer(x)
        assert layer._bf16_memo is not memo and close(second, oracle(x)) and not close(first, oracle(x))
        fewer = x[:5]
        ctx.set(1, 5, 1)
        assert close(layer(fewer), oracle(fewer))
