"""The CPU kernels of an engine's fp32 decode (``moerl.model.packed``): the prepacked expert kernel against torch's
grouped GEMM, in the experts' forward (plain, un-gated, LoRA, MXFP8 never), after a sync, and where it does not
build; the paged decode attention against the gather + matmul path."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_engine_lora import _logprob_k3, _trained_adapter

from moerl.bridges import load_model
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.model.moe import PACKED_MAX_ROWS, Experts
from moerl.model.packed import kernel, pack, packed_group_mm, packed_weight
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


def test_rows_or_groups_that_do_not_match_the_weight_are_named():
    packed = pack(torch.randn(4, 64, 32), False)
    with pytest.raises(ValueError, match=r"rows \(3, 32\), 4 groups, weight \[4, 64, 32\]"):
        packed_group_mm(torch.randn(3, 32), packed, torch.tensor([1, 2, 3, 3]))
    with pytest.raises(ValueError, match="3 groups"):
        packed_group_mm(torch.randn(3, 64), packed, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="mode 2 needs a scale per row"):
        packed_group_mm(torch.randn(3, 64), pack(torch.randn(4, 64, 32), True), torch.tensor([1, 2, 3, 3]), 2)


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
    """An engine's layout (``k_major``: K-major weights and their packed panels) against the same experts in the
    trainer's layout, fp32, no autograd (1e-5 relative: the sums' order differs; the kernel's own control is
    above): SiLU experts take the fused kernel, the others (un-gated relu2, GPT-OSS's clamped SwiGLU with biases)
    the plain one and torch's activation. With autograd, or past PACKED_MAX_ROWS rows a group, torch's GEMM."""
    trainer, engine = _experts(activation, bias), _experts(activation, bias)
    engine.k_major()
    assert engine.packed and not trainer.packed
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


def test_a_weight_changed_in_place_is_packed_again():
    """A sync's in-place copy bumps the weight's version: the kept panels are made again from the new values, into
    the same tensor (a compiled graph reads it by address)."""
    experts = _experts("silu")
    experts.k_major()
    w = experts.down_proj.transpose(1, 2)
    first = packed_weight(experts, "down", w, False)
    before = first.clone()
    assert packed_weight(experts, "down", w, False) is first  # unchanged: kept
    with torch.no_grad():
        experts.down_proj.add_(1.0)
    again = packed_weight(experts, "down", w, False)
    assert again is first and torch.equal(again, pack(w, False)) and not torch.equal(again, before)


def test_mxfp8_experts_never_take_the_fp32_kernel():
    from moerl.model.mx import apply_mxfp8

    model = torch.nn.Module()
    model.experts = _experts("silu")
    model.experts.k_major()
    apply_mxfp8(model)
    with torch.no_grad():
        assert model.experts.packed and not model.experts._packs(torch.randn(4, 256))


def test_a_lora_engine_decodes_its_adapters_from_the_packed_base(tmp_path):
    """LoRA slots on experts the kernel streams: the base GEMMs from packed panels (unfused: the adapter's delta comes
    before the activation), each request equal to its fp32 merged model (k3 <= 1e-6, as test_engine_lora), the base
    model beyond it (the control)."""
    path = tmp_path / "big"
    init_model("qwen3_moe", "tiny", path, overrides=BIG)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")  # this preset has no dense MLP layer
    tensors, merged = _trained_adapter(path, "shared_outer", rank=4, seed=1, targets=targets)
    engine = LLMEngine(path, EngineConfig(max_num_seqs=4, max_model_len=48, max_loras=1), dtype=torch.float32)
    assert engine.model.layers[0].mlp.experts.packed
    engine.add_adapter("s", tensors)
    prompts = [[5, 9, 14, 3, 22], [40, 41, 42, 43], [7, 7, 8]]
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i), adapter="s") for i, p in enumerate(prompts)
    ]
    base = load_model(path, dtype=torch.float32)
    outs = engine.generate(reqs)
    experts = engine.model.layers[1].mlp.experts
    assert type(experts).__name__ == "LoraExperts" and experts.packed and set(experts._packed) == {"gate_up", "down"}
    for out in outs:
        assert _logprob_k3(merged, out) <= 1e-6
        assert _logprob_k3(base, out) > 1e-6


def test_without_a_compiler_the_engine_keeps_torchs_gemm(tmp_path):
    """No C compiler (``CC`` names none): ``kernel()`` is None, the engine's experts are not packed and decode."""
    path = tmp_path / "big"
    init_model("qwen3_moe", "tiny", path, overrides=BIG)
    code = (
        "import torch; from moerl.engine import LLMEngine, EngineConfig, SamplingParams; "
        "from moerl.model.packed import kernel; assert kernel() is None; "
        f"e = LLMEngine({str(path)!r}, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.float32); "
        "assert not e.model.layers[0].mlp.experts.packed; "
        "print(len(e.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids))"
    )
    env = os.environ | {"CC": "no-such-compiler", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr[-2000:]


@pytest.mark.parametrize("scale", [0.125, 4.0])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_paged_decode_attention_reads_the_pools_as_the_gathered_path_does(arch, scale):
    """A decode step's attention from the pools in place (``StepView.attend``: rows at positions 0 to 45 over
    shuffled blocks of 16) against the gather + matmul path (``update``, ``mask``, ``attend``), fp32 (1e-5): full
    and sliding-window layers (a window of 8), GPT-OSS's sinks, grouped query heads; a sharp softmax too (scale 4:
    scores tens apart, most weights below e^-87, where the kernel's vector exp stops). The control: a sliding
    layer's keys read as a full layer's differ by more."""
    from moerl.engine.kv_cache import KVCache, StepView
    from moerl.model.attention import attend

    over = {"sliding_window": 8} if arch == "gpt_oss" else {}
    cfg = preset_config(arch, "tiny", over)[1]
    cache = KVCache(cfg, num_blocks=16, block_size=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for pool in cache.k + cache.v:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    positions = torch.tensor([[0], [7], [20], [45]])
    tables = torch.randperm(16, generator=gen)[:12].view(4, 3)
    hkv, _, d = cache.k[0].shape
    hq = cfg.num_heads
    q, k, v = (torch.randn(4, 1, h, d, generator=gen) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen) if arch == "gpt_oss" else None
    for sliding in (False, True) if cache.sliding_window else (False,):
        with torch.no_grad():
            got = StepView(cache, tables, positions, torch.ones(4, dtype=torch.long)).attend(
                0, q, k, v, sliding, scale, sinks
            )
            view = StepView(cache, tables, positions, torch.ones(4, dtype=torch.long))
            keys, values = view.update(0, k, v)
            want = attend(q.transpose(1, 2), keys, values, view.mask(sliding), scale, sinks)
            full = attend(q.transpose(1, 2), keys, values, view.mask(False), scale, sinks)
        assert got is not None and (got - want).abs().max() <= 1e-5, sliding
        if sliding:
            assert (got - full).abs().max() > 1e-3
    with torch.enable_grad():  # a trainer's forward (autograd) takes the gathered path
        assert (
            StepView(cache, tables, positions, torch.ones(4, dtype=torch.long)).attend(0, q, k, v, False, 1, None)
            is None
        )
