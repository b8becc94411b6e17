"""The CPU kernels of an engine's fp32 and bf16 decode (``moerl.cpu.kernels``): the prepacked expert kernel against
torch's grouped GEMM, in the experts' forward (plain, un-gated, LoRA, MXFP8 never), after a sync, and where it does
not build; the paged decode attention against the gather + matmul path."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_engine_lora import _logprob_k3, _trained_adapter

import moerl.cpu.kernels as packed_module
from moerl.bridges import load_model
from moerl.cpu import kernel_module
from moerl.cpu.experts import BF16_DOT_MAX_ROWS, PACKED_MAX_ROWS, KernelExperts
from moerl.cpu.kernels import (
    bf16_linear,
    bf16_linear_packs,
    kernel,
    linear_panels,
    moe_decode,
    pack,
    packed_group_mm,
    packed_weight,
    packs,
    rms_norm,
    vector_width,
)
from moerl.cpu.linear import KernelLinear
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.model.attention import FP32_SDPA_MAX_KEYS, attend
from moerl.model.linear import Linear
from moerl.model.moe import Experts
from moerl.precision import cpu_features
from moerl.presets import init_model, preset_config

pytestmark = pytest.mark.skipif(kernel() is None, reason="the packed kernel does not build here (no C compiler)")

# fp32 against torch._grouped_mm on outputs of ~20 (K = 512 products of unit normals): the sums' order differs;
# measured <= 1e-4 (gate-up and down) and 3e-3 after SiLU * up (~500); a weight perturbed by 1e-2 moves them ~0.2
ATOL = 1e-3
BIG = {"num_hidden_layers": 2, "hidden_size": 256, "moe_intermediate_size": 384}  # 768 / 384 KiB an expert in fp32


def _groups(rows: int, experts: int, seed: int) -> torch.Tensor:
    """Each group's end row: ``rows`` rows drawn over ``experts`` groups, a few of them empty."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(0, experts - 3, (rows,), generator=g), minlength=experts)
    return counts[torch.randperm(experts, generator=g)].cumsum(0).to(torch.int32)


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_the_kernel_computes_what_the_grouped_gemm_does(rows):
    """Every mode against ``torch._grouped_mm`` (fp32, ATOL) over groups of 0 to ~60 rows (a group's tail shorter
    than the kernel's block of rows included); a weight perturbed after packing is caught (the control)."""
    e, h, i = 12, 512, 256
    gen = torch.Generator().manual_seed(rows)
    gate_up, down = torch.randn(e, h, 2 * i, generator=gen), torch.randn(e, i, h, generator=gen)
    x, hid, scale = torch.randn(rows, h, generator=gen), torch.randn(rows, i, generator=gen), torch.rand(rows)
    offs = _groups(rows, e, rows)
    ref = torch._grouped_mm(x, gate_up, offs=offs)
    packed = pack(gate_up, True)
    assert (packed_group_mm(x, packed, offs, 1) - ref).abs().max() <= ATOL
    gate, up = ref.chunk(2, -1)
    act = packed_group_mm(x, packed, offs, 2, scale)
    assert (act - F.silu(gate) * up * scale[:, None]).abs().max() <= ATOL * (1 + act.abs().max())
    want = torch._grouped_mm(hid, down, offs=offs)
    assert (packed_group_mm(hid, pack(down, False), offs, 0) - want).abs().max() <= ATOL
    perturbed = pack(down + 1e-2 * torch.randn(down.shape, generator=gen), False)
    assert (packed_group_mm(hid, perturbed, offs, 0) - want).abs().max() > ATOL


@pytest.mark.parametrize("rows", [5, 200])
def test_bf16_weights_are_widened_exactly_and_the_result_rounded_once(rows):
    """bf16 weights and rows: the kernel widens them exactly and sums in fp32, so against ``torch._grouped_mm`` of the
    same values in fp32 it is as close as the fp32 kernel (ATOL); a bf16 result is that sum rounded once (within half
    a bf16 step, 2^-8 relative, plus the sums' order). The control: one weight row a few bf16 steps off is caught."""
    e, h, i = 12, 512, 256
    gen = torch.Generator().manual_seed(rows)
    gate_up, down = torch.randn(e, h, 2 * i, generator=gen).bfloat16(), torch.randn(e, i, h, generator=gen).bfloat16()
    x, scale = torch.randn(rows, h, generator=gen).bfloat16(), torch.rand(rows)
    offs = _groups(rows, e, rows)
    ref = torch._grouped_mm(x.float(), gate_up.float(), offs=offs)
    packed = pack(gate_up, True)
    assert packed.dtype == torch.bfloat16
    assert (packed_group_mm(x, packed, offs, 1, out_dtype=torch.float32) - ref).abs().max() <= ATOL
    rounded = packed_group_mm(x, packed, offs, 1)
    assert rounded.dtype == torch.bfloat16
    assert ((rounded.float() - ref).abs() <= ref.abs() * 2**-8 + ATOL).all()
    gate, up = ref.chunk(2, -1)
    act = packed_group_mm(x, packed, offs, 2, scale, torch.float32)
    assert (act - F.silu(gate) * up * scale[:, None]).abs().max() <= ATOL * (1 + act.abs().max())
    want = torch._grouped_mm(act, down.float(), offs=offs)
    got = packed_group_mm(act, pack(down, False), offs, 0, out_dtype=torch.bfloat16)
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + ATOL * (1 + want.abs().max())).all()
    off = down.clone()
    off[:, 7] = (off[:, 7].float() * (1 + 2**-6)).bfloat16()  # one row of every expert's weight, a few steps off
    moved = packed_group_mm(act, pack(off, False), offs, 0, out_dtype=torch.float32)
    assert (moved - want).abs().max() > ATOL * (1 + want.abs().max())


def test_bf16_panels_hold_k_pairs():
    """A bf16 weight's panels hold each column's two K rows side by side (AMX's weight tiles): element (k, j) of a
    panel sits at pair row k // 2, column j, half k % 2; a bf16 weight of odd K is not packed (fp32 is)."""
    w = torch.randn(2, 6, 4 * vector_width()).bfloat16()
    panels = pack(w, False)
    nt = panels.shape[3]
    pairs = panels.view(2, panels.shape[1], 3, nt, 2)
    for k in range(6):
        assert torch.equal(pairs[:, :, k // 2, :, k % 2].flatten(1), w[:, k])
    assert not packs(torch.randn(2, 7, 4 * vector_width()).bfloat16(), False)
    assert packs(torch.randn(2, 7, 4 * vector_width()), False)


def test_rows_or_groups_that_do_not_match_the_weight_are_named():
    packed = pack(torch.randn(4, 64, 32), False)
    with pytest.raises(ValueError, match=r"rows \(3, 32\), 4 groups, weight \[4, 64, 32\]"):
        packed_group_mm(torch.randn(3, 32), packed, torch.tensor([1, 2, 3, 3]))
    with pytest.raises(ValueError, match="3 groups"):
        packed_group_mm(torch.randn(3, 64), packed, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="mode 2 needs a scale per row"):
        packed_group_mm(torch.randn(3, 64), pack(torch.randn(4, 64, 32), True), torch.tensor([1, 2, 3, 3]), 2)
    with pytest.raises(ValueError, match=r"weight torch.float16, result torch.float32: fp32 or bf16 only"):
        packed_group_mm(torch.randn(3, 64), packed.half(), torch.tensor([1, 2, 3, 3]), out_dtype=torch.float32)


def _experts(activation: str, bias: bool = False) -> Experts:
    """Routed experts of 768 / 384 KiB each in fp32 (streaming their weights bounds decode), random weights."""
    cfg = replace(preset_config("qwen3_moe", "tiny", BIG)[1], activation=activation, expert_bias=bias)
    experts = Experts(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return experts


@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("relu2", False), ("swiglu_clamped", True)])
def test_packed_experts_decode_what_the_grouped_path_does(activation, bias):
    """An engine's layout (``KernelExperts``: K-major weights and their packed panels) against the same experts in the
    trainer's layout, fp32, no autograd (1e-5 relative: the sums' order differs; the kernel's own control is
    above): SiLU experts take the fused kernel, the others (un-gated relu2, GPT-OSS's clamped SwiGLU with biases)
    the plain one and torch's activation. With autograd, or past PACKED_MAX_ROWS rows a group, torch's GEMM."""
    trainer, engine = _experts(activation, bias), _experts(activation, bias)
    engine = kernel_module(engine)
    assert engine.has_panels and type(trainer) is Experts
    x = torch.randn(40, 256)
    idx = torch.stack([torch.randperm(trainer.num_experts)[:2] for _ in range(40)])
    weights = torch.rand(40, 2).softmax(-1)
    with torch.no_grad():
        want, got = trainer(x, idx, weights), engine(x, idx, weights)
    assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max()), activation
    assert set(engine._packed) == {"gate_up", "down"}
    assert not engine._packs(x)  # autograd on: a trainer's forward never takes the kernel
    with torch.no_grad():
        assert engine._packs(x) and not engine._packs(torch.randn((PACKED_MAX_ROWS + 1) * engine.num_experts, 256))


def test_bf16_experts_decode_what_fp32_experts_of_the_same_weights_do():
    """bf16 experts (an engine's where ``auto`` is bf16) take the kernel whatever their size (tiny's too), against the
    trainer's layout in fp32 on the same bf16 values: within two bf16 roundings of the largest output (each expert's
    rows, then their routed sum: 2^-7), the gate-up product never rounded. The control: down_proj 3% off is caught."""
    trainer = _experts("silu")
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_(p.bfloat16().float())
    engine = _experts("silu").to(torch.bfloat16)
    engine.load_state_dict(trainer.state_dict())
    engine = kernel_module(engine)
    assert engine.has_panels and type(trainer) is Experts
    small = kernel_module(Experts(preset_config("qwen3_moe", "tiny")[1]).to(torch.bfloat16))
    assert small.has_panels
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 256, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(trainer.num_experts, generator=gen)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=gen).softmax(-1).bfloat16().float()
    with torch.no_grad():
        got, want = engine(x, idx, weights), trainer(x.float(), idx, weights)
        tol = 2**-7 * want.abs().max()
        assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= tol
        assert set(engine._packed) == {"gate_up", "down"}
        trainer.down_proj.mul_(1.03)
        assert (got.float() - trainer(x.float(), idx, weights)).abs().max() > tol


def _moe_oracle(x, idx, gate, gate_up, down) -> torch.Tensor:
    """sum_k gate * down(SiLU(gate) * up) in float64, token by token (the gate weights rounded to x's dtype)."""
    inter, gate = down.shape[1], gate.to(x.dtype).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            h = x[n].double() @ gate_up[e].double()
            out[n] += (F.silu(h[:inter]) * h[inter:] * gate[n, j]) @ down[e].double()
    return out


def expert_path(monkeypatch, path: str) -> None:
    """Run bf16 experts on AMX's tiles (``bf16_dot``; skipped where the CPU or Linux has none) or on vector FMAs."""
    if path == "bf16_dot" and not packed_module.bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    monkeypatch.setattr(packed_module, "_bf16_dot", path == "bf16_dot")


PATHS = [(torch.float32, "vector"), (torch.bfloat16, "vector"), (torch.bfloat16, "bf16_dot")]  # (dtype, expert path)


@pytest.mark.parametrize(("dtype", "path"), PATHS)
@pytest.mark.parametrize(
    ("tokens", "skewed", "spread"), [(1, False, 1), (40, False, 1), (40, True, 1), (40, False, 60)]
)
def test_the_experts_in_one_call_compute_what_each_expert_does(tokens, skewed, spread, dtype, path, monkeypatch):
    """``moe_decode`` (sort, gather, both GEMMs, the sum) against a float64 loop over each token's experts: fp32 within
    1e-5 of the largest output (the sums' order), bf16 within 2^-8 (the result's one rounding; on AMX the activations
    are rounded to bf16 too, as torch's bf16 experts round them: measured 2e-3 of the largest output either way).
    Routes spread over the experts, or skewed (most tokens to one expert: a group longer than the kernel's block of
    rows, others empty); rows 60x wider (``spread``: gate values past +-88, where the kernel's vector e^-g is
    clamped). bf16 on AMX and on vector FMAs: two paths (their results differ in the last bits). The control:
    down_proj 1% (fp32) / 3% (bf16) off is caught."""
    expert_path(monkeypatch, path)
    e, h, inter, k = 8, 128, 96, 2
    gen = torch.Generator().manual_seed(11)
    gate_up = (torch.randn(e, h, 2 * inter, generator=gen) * h**-0.5).to(dtype)
    down = (torch.randn(e, inter, h, generator=gen) * inter**-0.5).to(dtype)
    x = (torch.randn(tokens, h, generator=gen) * spread).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    if spread > 1:  # gate values past e^x's range in fp32 both ways: SiLU 0 and SiLU = g
        assert (x.double() @ gate_up[0].double()).abs().max() > 100
    if skewed:
        idx[: tokens * 3 // 4, 0] = 5
        idx[: tokens * 3 // 4, 1] = 2
    gate = torch.rand(tokens, k, generator=gen).softmax(-1)
    with torch.no_grad():
        got = moe_decode(x, idx, gate, pack(gate_up, True), pack(down, False))
        if path == "bf16_dot" and tokens > 1:
            monkeypatch.setattr(packed_module, "_bf16_dot", False)
            assert not torch.equal(got, moe_decode(x, idx, gate, pack(gate_up, True), pack(down, False)))
    want = _moe_oracle(x, idx, gate, gate_up, down)
    tol = (1e-5 if dtype == torch.float32 else 2**-8) * want.abs().max()
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.double() - want).abs().max() <= tol
    off = _moe_oracle(x, idx, gate, gate_up, down * (1.01 if dtype == torch.float32 else 1.03))
    assert (got.double() - off).abs().max() > tol


def test_the_experts_in_one_call_name_what_they_do_not_take():
    """An expert id outside the weights' experts, or routes and rows that do not match, are named; nothing runs."""
    e, h, inter = 4, 64, 32
    gate_up, down = pack(torch.randn(e, h, 2 * inter), True), pack(torch.randn(e, inter, h), False)
    x, gate = torch.randn(3, h), torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"expert id outside 0..3 in idx \(max 4\)"):
        moe_decode(x, torch.tensor([[0, 1], [2, 4], [3, 0]]), gate, gate_up, down)
    with pytest.raises(ValueError, match=r"idx \(3, 2\), gate \(3, 1\)"):
        moe_decode(x, torch.zeros(3, 2, dtype=torch.long), gate[:, :1], gate_up, down)
    with pytest.raises(ValueError, match=r"rows torch.float32 \(3, 48\)"):
        moe_decode(torch.randn(3, 48), torch.zeros(3, 2, dtype=torch.long), gate, gate_up, down)


def test_an_engines_silu_experts_decode_in_one_call():
    """The engine's SiLU experts take the one call without autograd and for decode's rows; with autograd, past
    PACKED_MAX_ROWS rows an expert, or for another activation, the grouped path."""
    silu, relu2 = kernel_module(_experts("silu")), kernel_module(_experts("relu2"))
    x, idx = torch.randn(40, 256), torch.zeros(40, 2, dtype=torch.long)
    assert not silu._one_call(x, idx)
    with torch.no_grad():
        assert silu._one_call(x, idx) and not relu2._one_call(x, idx)
        many = (PACKED_MAX_ROWS + 1) * silu.num_experts
        assert not silu._one_call(torch.randn(many, 256), torch.zeros(many, 2, dtype=torch.long))
        # bf16 experts on AMX: a prefill's rows too, up to BF16_DOT_MAX_ROWS (token, expert) rows
        silu.to(torch.bfloat16)
        rows = torch.randn(many, 256).bfloat16()
        assert silu._one_call(rows, torch.zeros(many, 2, dtype=torch.long)) == packed_module.bf16_dot()
        most = BF16_DOT_MAX_ROWS // 2 + 1
        assert not silu._one_call(torch.randn(most, 256).bfloat16(), torch.zeros(most, 2, dtype=torch.long))


def test_a_prefills_bf16_experts_in_one_call_compute_what_torchs_path_does(monkeypatch):
    """A bf16 prefill's experts on AMX (``moe_decode`` for more rows than the vector kernel takes) against the grouped
    path on torch's GEMMs of the same weights: within 2^-7 of the largest output (each path rounds its activations
    once to bf16). The control: down_proj 3% off is caught."""
    expert_path(monkeypatch, "bf16_dot")
    experts = kernel_module(_experts("silu").to(torch.bfloat16))
    gen = torch.Generator().manual_seed(4)
    n = (PACKED_MAX_ROWS + 8) * experts.num_experts
    x = torch.randn(n, 256, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in range(n)])
    weights = torch.rand(n, 2, generator=gen).softmax(-1)
    with torch.no_grad():
        assert experts._one_call(x, idx)
        got = experts(x, idx, weights)
        experts.has_panels = False  # torch's grouped GEMMs
        want = experts(x, idx, weights).float()
        tol = 2**-7 * want.abs().max()
        assert (got.float() - want).abs().max() <= tol
        experts.down_proj.mul_(1.03)
        assert (got.float() - experts(x, idx, weights).float()).abs().max() > tol


def test_a_weight_changed_in_place_is_packed_again():
    """A sync's in-place copy bumps the weight's version: the kept panels are made again from the new values, into
    the same tensor (a compiled graph reads it by address)."""
    experts = kernel_module(_experts("silu"))
    w = experts.down_proj.transpose(1, 2)
    first = packed_weight(experts, "down", experts.down_proj, False)
    before = first.clone()
    assert packed_weight(experts, "down", experts.down_proj, False) is first  # unchanged: kept
    with torch.no_grad():
        experts.down_proj.add_(1.0)
    again = packed_weight(experts, "down", experts.down_proj, False)
    assert again is first and torch.equal(again, pack(w, False)) and not torch.equal(again, before)


def test_mxfp8_takes_over_the_backends_experts_and_never_their_fp32_kernel():
    """MXFP8 applied to an engine's experts the backend holds swaps them as it swaps plain ones (the backend's class
    stands for ``Experts``): its GEMMs, not the panels'. A class that stands for neither is refused."""
    from moerl.model.mx import MXExperts, apply_mxfp8
    from moerl.model.swap import swapped

    model = torch.nn.Module()
    model.experts = kernel_module(_experts("silu"))
    assert type(model.experts) is KernelExperts
    apply_mxfp8(model)
    assert type(model.experts) is MXExperts and not hasattr(model.experts, "panels")
    with pytest.raises(TypeError, match=r"MXExperts does not extend KernelLinear"):
        swapped(kernel_module(Linear(4, 4)), MXExperts)


def test_a_lora_engine_decodes_its_adapters_from_the_packed_base(tmp_path):
    """LoRA slots on experts the kernel streams: the base GEMMs from packed panels (unfused: the adapter's delta comes
    before the activation), each request equal to its fp32 merged model (k3 <= 1e-6, as test_engine_lora), the base
    model beyond it (the control)."""
    path = tmp_path / "big"
    init_model("qwen3_moe", "tiny", path, overrides=BIG)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")  # this preset has no dense MLP layer
    tensors, merged = _trained_adapter(path, "shared_outer", rank=4, seed=1, targets=targets)
    engine = LLMEngine(path, EngineConfig(max_num_seqs=4, max_model_len=48, max_loras=1), dtype=torch.float32)
    assert engine.model.layers[0].mlp.experts.has_panels
    engine.add_adapter("s", tensors)
    prompts = [[5, 9, 14, 3, 22], [40, 41, 42, 43], [7, 7, 8]]
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i), adapter="s") for i, p in enumerate(prompts)
    ]
    base = load_model(path, dtype=torch.float32)
    outs = engine.generate(reqs)
    experts = engine.model.layers[1].mlp.experts
    assert type(experts).__name__ == "KernelLoraExperts" and experts.has_panels
    assert set(experts._packed) == {"gate_up", "down"}
    for out in outs:
        assert _logprob_k3(merged, out) <= 1e-6
        assert _logprob_k3(base, out) > 1e-6


def test_without_a_compiler_the_engine_keeps_torchs_gemm(tmp_path):
    """No C compiler (``CC`` names none): ``kernel()`` is None, the engine's experts are not packed and decode."""
    path = tmp_path / "big"
    init_model("qwen3_moe", "tiny", path, overrides=BIG)
    code = (
        "import torch; from moerl.engine import LLMEngine, EngineConfig, SamplingParams; "
        "from moerl.cpu.kernels import kernel; assert kernel() is None; "
        f"e = LLMEngine({str(path)!r}, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.float32); "
        "assert type(e.model.layers[0].mlp.experts).__name__ == 'Experts'; "
        "print(len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids))"
    )
    env = os.environ | {"CC": "no-such-compiler", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr[-2000:]


@pytest.mark.parametrize("heads", ["tiny", "d64", "g3"])
@pytest.mark.parametrize("scale", [0.125, 4.0])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_reads_the_pools_as_the_gathered_path_does(arch, scale, dtype, heads):
    """A decode step's attention from the pools in place (``StepView.attend``: rows at positions 0 to 45 over
    shuffled blocks of 16) against the gather + matmul path (``update``, ``mask``, ``attend``) in fp32 on the same
    values: full and sliding-window layers (a window of 8), GPT-OSS's sinks, grouped query heads (two a KV head
    with heads of 32 and of 64, where the kernel takes two heads at a time, and three); a sharp softmax too (scale 4:
    scores tens apart, most weights below e^-87, where the kernel's vector exp stops). fp32 within 1e-5 of the
    largest output (at least 1e-5); bf16 pools and queries (widened exactly, summed in fp32) within the output's one
    rounding (2^-8 of its largest). The
    control: a sliding layer's keys read as a full layer's differ by more. The kernel writes the step's keys and
    values into the pools itself, where ``update`` writes them."""
    from moerl.engine.kv_cache import KVCache, StepView
    from moerl.model.attention import attend

    over = {"sliding_window": 8} if arch == "gpt_oss" else {}
    over |= {"tiny": {}, "d64": {"head_dim": 64}, "g3": {"num_attention_heads": 6, "num_key_value_heads": 2}}[heads]
    cfg = preset_config(arch, "tiny", over)[1]
    assert cfg.num_heads // cfg.num_kv_heads == (3 if heads == "g3" else 2) and cfg.head_dim == (
        64 if heads == "d64" else 32
    )
    cache = KVCache(cfg, num_blocks=16, block_size=16, dtype=dtype)
    ref = KVCache(cfg, num_blocks=16, block_size=16, dtype=torch.float32)  # the oracle's: the same values in fp32
    gen = torch.Generator().manual_seed(0)
    for pool, into in zip(cache.k + cache.v, ref.k + ref.v, strict=True):
        pool.copy_(torch.randn(pool.shape, generator=gen))
        into.copy_(pool)
    positions = torch.tensor([[0], [7], [20], [45]])
    tables = torch.randperm(16, generator=gen)[:12].view(4, 3)
    hkv, _, d = cache.k[0].shape
    hq = cfg.num_heads
    q, k, v = (torch.randn(4, 1, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen) if arch == "gpt_oss" else None
    for kind in ("full", "sliding") if cache.sliding_window else ("full",):
        with torch.no_grad():
            got = StepView(cache, tables, positions, torch.ones(4, dtype=torch.long)).attend(
                0, q, k, v, kind, scale, sinks
            )
            view = StepView(ref, tables, positions, torch.ones(4, dtype=torch.long))
            keys, values = view.update(0, k.float(), v.float())
            want = attend(q.float().transpose(1, 2), keys, values, view.mask(kind), scale, sinks)
            full = attend(q.float().transpose(1, 2), keys, values, view.mask("full"), scale, sinks)
        tol = (1e-5 if dtype == torch.float32 else 2**-8) * want.abs().max().clamp(min=1)
        assert got is not None and got.dtype == dtype and (got.float() - want).abs().max() <= tol, kind
        if kind == "sliding":
            assert (got.float() - full).abs().max() > max(tol, 1e-3)
    # the kernel wrote this step's keys and values where ``update`` writes them (and nothing else)
    assert torch.equal(cache.k[0].float(), ref.k[0]) and torch.equal(cache.v[0].float(), ref.v[0])
    with torch.enable_grad():  # a trainer's forward (autograd) takes the gathered path
        assert (
            StepView(cache, tables, positions, torch.ones(4, dtype=torch.long)).attend(0, q, k, v, "full", 1, None)
            is None
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 512), (64, 1, 8, 64), (3, 7, 100), (4096, 512)])
def test_rms_norm_in_one_call_computes_what_torch_does(shape, dtype):
    """The engine's RMSNorm kernel against ``F.rms_norm`` (torch's CPU composite: fp32 statistics, one rounding after
    the weight), rows of decode, per-head norms, a dim that is no vector multiple and prefill's many rows (threaded),
    weights fp32 and bf16: fp32 within 2 ulp of the output (the squares summed in another order), bf16 within one
    bf16 step, 2^-7 relative. The control: eps 1 where the norm's is 1e-6 (rows of mean square ~9) is caught."""
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    for w in (torch.randn(shape[-1], generator=gen), torch.randn(shape[-1], generator=gen).to(dtype)):
        want = F.rms_norm(x.float(), (shape[-1],), w.float(), 1e-6).to(dtype).float()
        tol = want.abs() * (2**-22 if dtype == torch.float32 else 2**-7) + 1e-6
        got = rms_norm(x, w, 1e-6)
        assert got.dtype == dtype and got.shape == x.shape and ((got.float() - want).abs() <= tol).all()
        assert not ((rms_norm(x, w, 1.0).float() - want).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 1, 512), (3, 7, 100), (4096, 512)])
def test_the_residual_add_and_its_norm_in_one_call_give_each_ops_bits(shape, dtype):
    """``add_rms_norm`` (a decode layer's residual add and the norm after it, one call) against torch's add then
    ``rms_norm``: the sum and the norm equal bit for bit, fp32 and bf16 rows, fp32 and bf16 weights, a dim that is no
    vector multiple and prefill's many rows (threaded). The control: the branch ``a`` one bf16 step off in one row
    changes both."""
    from moerl.cpu.kernels import add_rms_norm

    gen = torch.Generator().manual_seed(shape[-1])
    x, a = ((torch.randn(shape, generator=gen) * 3).to(dtype) for _ in range(2))
    for w in (torch.randn(shape[-1], generator=gen), torch.randn(shape[-1], generator=gen).to(dtype)):
        total, normed = add_rms_norm(x, a, w, 1e-6)
        assert torch.equal(total, x + a) and torch.equal(normed, rms_norm(x + a, w, 1e-6))
        off = a.clone()
        off[1, ..., 0] = (off[1, ..., 0].float() * (1 + 2**-6)).to(dtype)
        moved = add_rms_norm(x, off, w, 1e-6)
        assert not torch.equal(moved[0], total) and not torch.equal(moved[1], normed)
    with pytest.raises(ValueError, match=r"add_rms_norm: rows torch.\w+ \(2, 8\) \+ torch.\w+ \(2, 6\)"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 6), torch.ones(8), 1e-6)


def test_rms_norm_names_rows_and_weights_it_does_not_take():
    with pytest.raises(ValueError, match=r"rms_norm: rows torch.float32 \(4, 8\), weight torch.float32 \(6,\)"):
        rms_norm(torch.randn(4, 8), torch.ones(6), 1e-6)
    with pytest.raises(ValueError, match="rows torch.float16"):
        rms_norm(torch.randn(4, 8).half(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "experts", "k", "norm", "scale", "bias"), [
    (64, 16, 2, True, 1.0, False), (5, 8, 3, False, 2.5, True), (300, 128, 8, True, 1.0, False)
])  # fmt: skip
def test_a_softmax_top_k_router_in_one_call_computes_torchs_rule(rows, experts, k, norm, scale, bias, dtype):
    """``router_topk`` (an engine's router, one call) against the router's torch rule (fp32 GEMM of the rows, softmax,
    top-k of the probabilities, normalized, scaled): the same experts in the same order and gate weights within
    2^-18 relative (the logits summed in another order: up to 2e-6 measured, as far as torch's own fp32 logits lie from
    fp64's; no near-ties in these rows), rows of decode and of a prefill (threaded), hidden sizes no vector multiple,
    replayed experts (R3) in every other row. The control: one expert's router row perturbed by 1% changes the weights
    beyond the tolerance. Rows of another width are named."""
    from moerl.cpu.kernels import router_topk
    from moerl.model.moe import Router

    gen = torch.Generator().manual_seed(rows)
    h = 100 if rows == 5 else 512
    x, w = torch.randn(rows, h, generator=gen).to(dtype), torch.randn(experts, h, generator=gen) * 0.05
    b = torch.randn(experts, generator=gen) if bias else None
    cfg = preset_config("qwen3_moe", "tiny", {"num_experts": experts, "num_experts_per_tok": k})[1]
    router = Router(replace(cfg, hidden_size=h, norm_topk_prob=norm, routed_scaling_factor=scale, router_bias=bias))
    with torch.no_grad():
        router.weight.copy_(w)
        if bias:
            router.bias.copy_(b)
        want_w, want_idx = router(x)
        gate, idx = router_topk(x, w, b, k, norm, scale)
        assert torch.equal(idx, want_idx)
        assert torch.allclose(gate, want_w, rtol=2**-18, atol=0)
        replay = torch.randint(0, experts, (rows, k), generator=gen)
        replay[::2] = -1  # these rows route themselves
        want_w, want_idx = router(x, replay)
        gate, idx = router_topk(x, w, b, k, norm, scale, replay)
        assert torch.equal(idx, want_idx) and torch.equal(idx[1::2], replay[1::2])
        assert torch.allclose(gate, want_w, rtol=2**-18, atol=0)
        w[int(want_idx[0, 0])] *= 1.01
        moved, _ = router_topk(x, w, b, k, norm, scale)
        assert not torch.allclose(moved, want_w, rtol=2**-18, atol=0)
    with pytest.raises(ValueError, match=r"router_topk: rows torch.float32 \(2, 8\), weight torch.float32 \(4, 6\)"):
        router_topk(torch.randn(2, 8), torch.randn(4, 6), None, 2, True, 1.0)


def test_an_engine_runs_its_norms_in_one_call(tmp_path, monkeypatch):
    """An engine's own CPU model (the CPU backend, ``moerl.cpu.install``) has every RMSNorm (layer, q / k, final)
    swapped for the backend's, one kernel call without autograd, and the residual add before a pre-norm in the same
    call; a trainer's model of the same checkpoint keeps the plain module, and the two decode the same greedy tokens
    (fp32)."""
    import moerl.cpu.norms as cpu_norms
    from moerl.cpu.attention import KernelAttention
    from moerl.cpu.kernels import add_rms_norm
    from moerl.cpu.norms import KernelRMSNorm
    from moerl.model.norms import RMSNorm

    path = tmp_path / "tiny"
    init_model("qwen3_moe", "tiny", path)
    engine = LLMEngine(path, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.float32)
    norms = [m for m in engine.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(type(m) is KernelRMSNorm for m in norms)
    assert all(type(layer.self_attn) is KernelAttention for layer in engine.model.layers)  # q / k norm + RoPE
    assert len(norms) == 4 * engine.model.config.num_layers + 1
    calls = []
    monkeypatch.setattr(cpu_norms, "add_rms_norm", lambda *a: calls.append(a) or add_rms_norm(*a))
    layer = engine.model.layers[0]  # the residual add before the MoE and its norm: one call (add_rms_norm)
    x, a = torch.randn(2, 1, 128), torch.randn(2, 1, 128)
    with torch.no_grad():
        s, y = layer.post_attention_layernorm.add_and_norm(x, a)
    assert len(calls) == 1 and torch.equal(s, x + a)
    layer.post_attention_layernorm.add_and_norm(x, a)  # with autograd: the plain module's two steps
    assert len(calls) == 1
    model = load_model(path, dtype=torch.float32)
    assert not any(type(m) is not RMSNorm for m in model.modules() if isinstance(m, RMSNorm))
    plain = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=32))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    got = engine.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert got == plain.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids


@pytest.mark.parametrize(("keys", "fp32"), [(22, True), (FP32_SDPA_MAX_KEYS, True), (FP32_SDPA_MAX_KEYS + 8, False)])
def test_short_bf16_attention_on_a_cpu_runs_in_fp32(keys, fp32):
    """bf16 SDPA on a CPU costs a fixed ~35 us per (row, head): up to FP32_SDPA_MAX_KEYS keys ``attend`` runs it on the
    exact fp32 widening of its bf16 inputs and rounds once (equal to fp32 attention rounded to bf16, up to fp32's sum
    order: at most one bf16 step apart), longer ones in bf16 (a looser 2^-6 of the largest output; it is not the
    fp32 result rounded once). Gradients flow to the bf16 inputs either way."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, keys, 32, generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(3, 2, keys, 32, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    got = attend(q, k, v, None, 32**-0.5)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    ref = ref.transpose(1, 2).flatten(2)
    assert got.dtype == torch.bfloat16
    step = 2**-7 * ref.abs().clamp_min(2**-20)  # one bf16 step at each output's size
    off = (got.float() - ref).abs()
    if fp32:
        assert bool((off <= step).all())
    else:
        assert float(off.max()) <= 2**-6 * float(ref.abs().max()) and not bool((off <= step).all())
    got.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and all(float(t.grad.abs().sum()) > 0 for t in (q, k, v))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(3, 5), (40,), (1, 1), (2, 32)])
def test_a_bf16_projection_on_amx_computes_what_torch_does(lead, bias):
    """``bf16_linear`` (a decode step's bf16 rows on AMX's tiles from the weight's packed panels) against the fp32
    product of the same bf16 values: the sum rounded once to bf16 (within 2^-8 of each output, plus 1e-3 for the sums'
    order), rows not a multiple of AMX's 16 included (copied beside spare rows; whole blocks are read in place). The
    control: one weight row a few bf16 steps off is caught."""
    if not packed_module.bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    gen = torch.Generator().manual_seed(9)
    layer = torch.nn.Linear(256, 192, bias=bias).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(192, 256, generator=gen) * 0.1)
    x = torch.randn(*lead, 256, generator=gen).bfloat16()
    b = layer.bias.float() if bias else None
    want = F.linear(x.float(), layer.weight.float(), b)
    got = bf16_linear(x, linear_panels(layer, layer.weight), layer.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, 192)
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3).all()
    with torch.no_grad():
        layer.weight[7] = (layer.weight[7].float() * (1 + 2**-5)).bfloat16()
    off = F.linear(x.float(), layer.weight.float(), b)
    assert not ((got.float() - off).abs() <= off.abs() * 2**-8 + 1e-3).all()


def test_projections_side_by_side_give_each_ones_bits_and_follow_a_weight_update():
    """``fused_linear``: q / k / v of one input as one AMX call from their panels side by side give each projection's
    own call bit for bit (each column's sums are the same, only more columns), with a bias beside a layer without one
    (zeros); a weight written in place (a sync) is packed again before the next call: the fused result follows it
    (the control: the result from before the write no longer matches)."""
    if not packed_module.bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    nt = 2 * vector_width()
    gen = torch.Generator().manual_seed(3)
    owner = torch.nn.Module()
    layers = (Linear(128, 4 * nt, bias=True), Linear(128, 2 * nt, bias=False), Linear(128, 2 * nt, bias=True))
    with torch.no_grad():
        for m in layers:
            m.to(torch.bfloat16).weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.1)
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
    x = torch.randn(40, 1, 128, generator=gen).bfloat16()

    def each():
        return [bf16_linear(x, linear_panels(m, m.weight), m.bias) for m in layers]

    with torch.inference_mode():
        fused = bf16_linear(x, *packed_module.fused_linear(owner, layers))
        assert fused.shape == (40, 1, 8 * nt)
        assert all(torch.equal(a, b) for a, b in zip(fused.split([4 * nt, 2 * nt, 2 * nt], -1), each(), strict=True))
        with torch.no_grad():
            layers[1].weight.mul_(1.5)
        again = bf16_linear(x, *packed_module.fused_linear(owner, layers))
        assert all(torch.equal(a, b) for a, b in zip(again.split([4 * nt, 2 * nt, 2 * nt], -1), each(), strict=True))
        assert not torch.equal(again, fused)


def test_amx_projections_name_what_they_do_not_take():
    """Only bf16 weights of whole panels and K a multiple of 32 run on AMX; rows that do not match are named."""
    nt = 2 * vector_width()
    assert not bf16_linear_packs(torch.randn(2 * nt, 64))  # fp32
    assert not bf16_linear_packs(torch.randn(2 * nt + 1, 64).bfloat16())
    assert not bf16_linear_packs(torch.randn(2 * nt, 48).bfloat16())
    assert bf16_linear_packs(torch.randn(2 * nt, 64).bfloat16()) == packed_module.bf16_dot()
    if packed_module.bf16_dot():
        layer = torch.nn.Linear(64, 2 * nt, bias=False).bfloat16()
        with pytest.raises(ValueError, match=r"bf16_linear: rows torch.bfloat16 \(3, 32\)"):
            bf16_linear(torch.randn(3, 32).bfloat16(), linear_panels(layer, layer.weight), None)


def test_an_engines_bf16_projections_run_on_amx(tmp_path):
    """An engine's own bf16 model (``moerl.cpu.install``) runs its attention projections on AMX where the CPU has it
    (a trainer's model never), q / k / v in one call, and greedy decode gives the tokens of the same engine on torch's
    GEMMs."""
    path = tmp_path / "tiny"
    init_model("qwen3_moe", "tiny", path)
    engine = LLMEngine(path, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.bfloat16)
    projections = [m for m in engine.model.modules() if type(m) is KernelLinear]
    assert len(projections) == 4 * engine.model.config.num_layers
    assert all(m.has_panels == packed_module.bf16_dot() for m in projections)
    assert not any(isinstance(m, KernelLinear) for m in load_model(path, dtype=torch.bfloat16).modules())
    params = SamplingParams(temperature=0.0, max_tokens=8)
    got = engine.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    # q / k / v of a layer as one call from their panels side by side (fused_linear), where AMX runs
    fused = ["fused weight" in layer.self_attn.__dict__.get("_packed", {}) for layer in engine.model.layers]
    assert all(f == packed_module.bf16_dot() for f in fused)
    engine.direct = None  # the modules' decode (the bound step, moerl.cpu.direct, binds the panels themselves)
    for m in projections:
        m.has_panels = False
    assert got == engine.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids


def test_a_compiled_graph_runs_the_amx_projection_on_the_panels_made_before_it():
    """In a compiled graph a projection on panels is one op on the panels ``refresh_panels`` made outside it: the same
    result as the eager call; panels spoiled (the weight unchanged) change the graph's result (the control)."""
    if not packed_module.bf16_dot():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, or Linux refuses its tile state)")
    layer = kernel_module(Linear(128, 64, bias=False).bfloat16())
    assert layer.has_panels
    layer.refresh_panels()
    x = torch.randn(5, 1, 128).bfloat16()
    step = torch.compile(lambda rows: layer(rows), fullgraph=True)
    with torch.inference_mode():
        want = layer(x)
        assert torch.equal(step(x), want)
        packed_module.graph_panels(layer, "weight").mul_(2)
        assert not torch.equal(step(x), want)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d", "norm"), [(64, True), (40, True), (32, False)])
def test_qk_norms_and_rope_in_one_call_give_the_torch_paths_bits(d, norm, dtype, strided):
    """``norm_rope`` (a decode step's per-head q / k RMSNorms and rotate-half RoPE, in place, one call) against what
    the engine ran before: ``rms_norm`` then ``apply_rope``'s ops: equal bit for bit in fp32 and bf16 (each op's
    rounding kept, no fused multiply-add), heads not a multiple of a vector included, q and k as the column ranges of
    one q / k / v product (``strided``: rows wider than their heads; the v columns between untouched). The control: the
    rows' positions shifted by one miss; q whose rows no one stride steps through is named."""
    from moerl.cpu.kernels import norm_rope
    from moerl.model.rope import apply_rope

    gen = torch.Generator().manual_seed(d)
    q, k = torch.randn(7, 1, 8, d, generator=gen).to(dtype), torch.randn(7, 1, 4, d, generator=gen).to(dtype)
    if strided:  # q | k | v of one [7, 1, 16 d] product: q and k views of its rows
        v = torch.randn(7, 1, 4 * d, generator=gen).to(dtype)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v], -1)
        q, k = (t.unflatten(-1, (-1, d)) for t in qkv.split([8 * d, 4 * d, 4 * d], -1)[:2])
        assert not q.is_contiguous() and not k.is_contiguous()
    qw, kw = ((torch.rand(d, generator=gen) + 0.5).to(dtype) for _ in range(2))
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)

    def cos_sin(pos):
        emb = torch.cat([pos[..., None].float() * inv] * 2, -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    pos = torch.arange(7)[:, None] * 5
    qn, kn = (rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)) if norm else (q, k)
    want = apply_rope(torch.cat([qn, kn], 2), *cos_sin(pos))
    got_q, got_k = q.clone(), k.clone()
    norm_rope(got_q, got_k, qw if norm else None, kw if norm else None, 1e-6, *cos_sin(pos))
    assert torch.equal(torch.cat([got_q, got_k], 2), want)
    off_q, off_k = q.clone(), k.clone()
    norm_rope(off_q, off_k, qw if norm else None, kw if norm else None, 1e-6, *cos_sin(pos + 1))
    assert not torch.equal(torch.cat([off_q, off_k], 2), want)
    with pytest.raises(ValueError, match=r"norm_rope: q torch\..* \(7, 1, 8, \d+\), k .* \(7, 1, 4, \d+\), cos"):
        norm_rope(q, k, qw, None, 1e-6, *cos_sin(pos))
    if strided:
        assert torch.equal(qkv[..., 12 * d :], v)  # the v columns between the rows are left as they were
        from moerl.cpu.kernels import rows_of

        assert rows_of(q).stride(0) == 16 * d
        assert rows_of(torch.randn(7, 2, 8, d).transpose(0, 1)) is None  # rows no one stride steps through
        assert rows_of(q[:, :, ::2]) is None  # heads not side by side


def test_moerl_amx_0_keeps_the_vector_kernels():
    """``MOERL_BF16_DOT=0``: the process never asks for AMX's tile state and its bf16 experts and projections take the
    vector FMAs (the decode still runs: one greedy token of a bf16 engine)."""
    code = (
        "import torch; from moerl.cpu.kernels import bf16_dot; assert not bf16_dot(); "
        "from moerl.presets import init_model; from moerl.engine import LLMEngine, EngineConfig, SamplingParams; "
        "import tempfile; d = tempfile.mkdtemp(); init_model('qwen3_moe', 'tiny', d); "
        "e = LLMEngine(d, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.bfloat16); "
        "assert not any(m.has_panels for m in e.model.modules() if type(m).__name__ == 'KernelLinear'); "
        "print(len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=1))[0].outputs[0].token_ids))"
    )
    env = os.environ | {"MOERL_BF16_DOT": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]


def test_paged_attention_names_new_rows_that_do_not_match():
    """This step's keys / values / slots handed to the eager paged call (``paged_write_decode``) that do not match its
    rows, heads or pools are named, and nothing is written."""
    from moerl.cpu.kernels import paged_write_decode
    from moerl.engine.kv_cache import KVCache

    cfg = preset_config("qwen3_moe", "tiny")[1]
    cache = KVCache(cfg, num_blocks=4, block_size=16, dtype=torch.float32)
    hkv, _, d = cache.k[0].shape
    q, tables, pos = torch.randn(2, cfg.num_heads, d), torch.tensor([[0], [1]]), torch.tensor([3, 5])
    k, v, slots = torch.randn(2, hkv, d), torch.randn(2, hkv, d), torch.tensor([3, 21])
    before = cache.k[0].clone()
    for bad in ((k[:, :1], v, slots), (k, v, slots[:1]), (k.bfloat16(), v, slots)):
        with pytest.raises(ValueError, match=r"paged_decode: new rows \(k torch\.\w+ \(\d, \d, 32\).* for 2 rows of 2"):
            paged_write_decode(q, cache.k[0], cache.v[0], tables, pos, None, 16, 0, 1.0, bad)
    assert torch.equal(cache.k[0], before)


@pytest.mark.skipif(not cpu_features()["avx512_bf16"], reason="the CPU lacks AVX512-BF16")
def test_the_bf16_kernels_without_amx_pass_the_tiles_tests():
    """On a CPU without AMX (AMD Zen 4) bf16 experts and projections run AVX512-BF16's vdpbf16ps on the AMX panels:
    the kernels built as such a CPU's (``MOERL_KERNEL_FLAGS`` turning AMX off; on this CPU where it has AMX) pass the
    tests the tiles pass (the experts' and projections' float64 / fp32 oracles with their controls, and the bound
    step bit for bit with the modules), none skipped."""
    env = os.environ | {"MOERL_KERNEL_FLAGS": "-mno-amx-tile -mno-amx-bf16 -mno-amx-int8", "OMP_NUM_THREADS": "1"}
    check = "from moerl.cpu.kernels import kernel; assert kernel().moerl_bf16_dot() == 2"  # 2: vdpbf16ps, not tiles
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    here = Path(__file__).parent
    tests = [
        str(here / "test_packed.py"),
        str(here / "test_direct.py"),
        "-k",
        "(bf16_dot or one_call or bound or bf16_projection) and not without_amx",
    ]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *tests]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0 and "skipped" not in summary and " passed" in summary, done.stdout[-3000:]
