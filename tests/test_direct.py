"""The CPU engine's decode step as bound kernel calls (``moerl.cpu.direct``) against the modules' forward it
replaces: the same tokens, logprobs and chosen experts bit for bit (bf16 on BF16_DOT, fp32 with torch's GEMMs), weights
synced in place seen, and the models it does not bind named."""

import pytest
import torch
from test_engine_lora import _trained_adapter

import moerl.cpu.kernels as packed_module
from moerl.cpu.direct import refusal
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.engine.kv_cache import StepView
from moerl.model.mx import apply_mxfp8
from moerl.presets import init_model

pytestmark = pytest.mark.skipif(packed_module.kernel() is None, reason="the kernels do not build here")
BF16_DOT = pytest.mark.skipif(
    not packed_module.bf16_dot(), reason="no bf16 dot products here: a bf16 step runs bound on them only"
)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=BF16_DOT)]


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")  # every module of a MoE-only model
PROMPTS = [[5 + i] * (3 + 7 * i) for i in range(5)]


def _generate(engine: LLMEngine, direct) -> list:
    """(tokens, logprobs, routed experts) of a batch whose rows finish at different steps (the batch shrinks) and grow
    past a table width the step binds (more blocks a row), sampled with seeds."""
    engine.direct = direct
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_tokens=6 + 9 * i, ignore_eos=True, seed=i))
        for i, p in enumerate(PROMPTS)
    ]
    outs = [o.outputs[0] for o in engine.generate(reqs)]
    return [(o.token_ids, o.logprobs, o.routed_experts) for o in outs]


def _same(a: list, b: list) -> bool:
    """Equal tokens, and logprobs and routed experts equal bit for bit (None beside None)."""
    tensors = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))  # noqa: E731
    return all(
        ta == tb and tensors(la, lb) and tensors(ra, rb) for (ta, la, ra), (tb, lb, rb) in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "tiny"
    init_model("qwen3_moe", "tiny", path, seed=3)
    return path


@pytest.mark.parametrize("dtype", DTYPES)
def test_bound_decode_steps_give_the_modules_tokens_logprobs_and_experts_bit_for_bit(tiny, dtype):
    """A batch decoded through the bound calls and through the modules: equal bit for bit, over batch sizes 5..1 and
    tables of 1..8 blocks. The control: an expert weight changed in place (a sync's ``copy_``) changes the bound
    step's logprobs, and they are again the modules' (the weights' versions are checked each step)."""
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=8, capture_routing=True)
    engine = LLMEngine(tiny, cfg, dtype=dtype)
    direct = engine.direct
    assert refusal(engine.model, engine.cache) is None
    bound = _generate(engine, direct)
    assert sorted(b for b, _ in direct._bound) == [1, 2, 3, 4, 5]  # each batch size bound once
    assert max(b.width for b in direct._bound.values()) >= 8
    assert _same(bound, _generate(engine, None))
    for (tokens, _, routed), prompt in zip(bound, PROMPTS, strict=True):  # every token's experts, the prompt's too
        assert routed.shape[0] == len(prompt) + len(tokens) - 1
    with torch.no_grad():
        w = engine.model.layers[1].mlp.experts.down_proj
        w.copy_(w * 1.25)
    synced = _generate(engine, direct)
    assert not any(torch.equal(a[1], b[1]) for a, b in zip(synced, bound, strict=True))
    assert _same(synced, _generate(engine, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_synced_in_place_between_steps_is_seen_by_the_next(tiny, dtype):
    """Decode steps called alone (no prefill between them to pack the weights again): the step after an in-place
    change of an expert's and of a projection's weight gives the modules' logits for the new weights, not the old."""
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64, block_size=8), dtype=dtype)
    direct, model = engine.direct, engine.model
    ids, positions, tables = torch.tensor([[7], [9]]), torch.tensor([[5], [12]]), torch.tensor([[0, 1], [2, 3]])

    def modules():
        one = torch.ones(2, dtype=torch.long)
        view = StepView(engine.cache, tables, positions, one, torch.arange(2))
        return model(ids, positions=positions, cache=view, logits_index=one - 1).logits

    with torch.inference_mode():
        before = direct.step(ids, positions, tables)[0]
        assert torch.equal(before, modules())
        for w in (model.layers[2].mlp.experts.gate_up_proj, model.layers[0].self_attn.v_proj.weight):
            w.mul_(1.5)
        after = direct.step(ids, positions, tables)[0]
        assert not torch.equal(after, before)
        assert torch.equal(after, modules())


@BF16_DOT
def test_a_cache_released_between_calls_is_bound_again(tiny):
    """``release_cache``: the pools are made again for each call; the bound step follows them (the modules' tokens)."""
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, release_cache=True)
    engine = LLMEngine(tiny, cfg, dtype=torch.bfloat16)
    direct = engine.direct
    first = _generate(engine, direct)
    assert _same(first, _generate(engine, direct)) and _same(first, _generate(engine, None))


@BF16_DOT
@pytest.mark.parametrize("layout", ["shared_outer", "per_expert"])
def test_adapters_in_a_bound_step_give_the_modules_tokens_bit_for_bit(tiny, layout):
    """Rows of two adapters and rows of none in one batch, then every row on one adapter (the single-slot path): the
    bound calls with each row's slot give the modules' tokens, logprobs and experts bit for bit; the adapters change
    the tokens (the control)."""
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=8, max_loras=2, max_lora_rank=8, lora_layout=layout)
    engine = LLMEngine(tiny, cfg, dtype=torch.bfloat16)
    direct = engine.direct
    for name, seed in (("a", 1), ("b", 2)):
        engine.add_adapter(
            name, _trained_adapter(tiny, layout, rank=4 if name == "a" else 8, seed=seed, targets=TARGETS)[0]
        )

    def run(direct, names):
        engine.direct = direct
        reqs = [
            Request(p, SamplingParams(temperature=1.0, max_tokens=5 + 4 * i, ignore_eos=True, seed=i), adapter=name)
            for i, (p, name) in enumerate(zip(PROMPTS, names, strict=True))
        ]
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, None) for o in engine.generate(reqs)]

    for names in (["a", None, "b", "a", None], ["b"] * 5):
        bound = run(direct, names)
        assert direct.why is None and any(lora for _, lora in direct._bound)
        assert _same(bound, run(None, names))
        assert not _same(bound, run(direct, [None] * 5))


@BF16_DOT
def test_models_the_bound_step_does_not_run_are_named(tiny, tmp_path):
    """Adapters on an fp32 model's projections (their delta is ``lora_add``'s, not bound), MXFP8 swapped in after the
    engine is built, q / k / v biases: each refused with its reason (the modules run it), and the swap is seen at the
    next step."""
    cfg = EngineConfig(max_num_seqs=2, max_model_len=32, max_loras=1)
    fp32 = LLMEngine(tiny, cfg, dtype=torch.float32)
    assert "adapters on projections off the bf16 dot products" in refusal(fp32.model, fp32.cache)
    ids, positions, tables = torch.tensor([[7]]), torch.tensor([[0]]), torch.tensor([[0]])
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.bfloat16)
    with torch.inference_mode():
        assert fp32.direct.step(ids, positions, tables) is None and "off the bf16 dot products" in fp32.direct.why
        assert engine.direct.step(ids, positions, tables) is not None
        apply_mxfp8(engine.model, keep=True)
        assert engine.direct.step(ids, positions, tables) is None and "projection" in engine.direct.why
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert len(engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4  # the modules' MXFP8 step
    shared = tmp_path / "shared"
    init_model("qwen2_moe", "tiny", shared)
    engine = LLMEngine(shared, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.bfloat16)
    assert "with a bias" in refusal(engine.model, engine.cache)  # Qwen2-MoE's q / k / v biases


def test_a_module_not_the_backends_is_the_refusal_and_the_modules_run(tiny):
    """The step is assembled from the backend's modules: one module put back to its plain class (a layer's router)
    is refused by its name and class, and the engine decodes through the modules: the bound step's tokens and
    experts, its logprobs within 1e-5 (fp32; the plain router sums its logits in another order than the kernel's).
    The backend's module put back: bound again."""
    from moerl.model.moe import Router
    from moerl.model.swap import replace_module, swapped

    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=8, capture_routing=True)
    engine = LLMEngine(tiny, cfg, dtype=torch.float32)
    direct = engine.direct
    bound = _generate(engine, direct)
    kernel_router = engine.model.layers[1].mlp.router
    replace_module(engine.model, "layers.1.mlp.router", swapped(kernel_router, Router))
    named = "layer 1: mlp.router is a Router, not the CPU backend's"
    assert refusal(engine.model, engine.cache) == named
    assert not direct.runs() and direct.why == named
    modules = _generate(engine, direct)
    for (tb, lb, rb), (tm, lm, rm) in zip(bound, modules, strict=True):
        assert tb == tm and torch.equal(rb, rm) and (lb - lm).abs().max() <= 1e-5
    replace_module(engine.model, "layers.1.mlp.router", kernel_router)
    assert direct.runs() and direct.why is None
