"""The engine under faults and bad input: interrupted generations, non-finite logits, bad adapters, bad requests."""

import dataclasses
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moerl.bridges import load_model
from moerl.bridges.peft import write_peft_adapter
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.errors import CheckpointError, ConfigError, RequestError
from moerl.model.lora import EXPERT_KEYS, LINEAR_KEYS, LinearLora
from moerl.model.transformer import MoEModel

ARCH = "Qwen3MoeForCausalLM"
A_PROMPT = [5, 9, 14, 6, 22, 8, 7, 30, 31]  # 9 tokens: two full blocks of 4 and a partial one
# B fits one block, so while A prefills its block table is padded to A's width
OTHERS = [[40, 41, 42], list(range(50, 64)), [70, 71, 72, 73, 74]]
CFG = EngineConfig(max_num_seqs=8, max_model_len=32, block_size=4)


def sp(seed: int, max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.9, max_tokens=max_tokens, n=n, seed=seed, ignore_eos=True)


def batch(a_prompt: list[int], a_max_tokens: int, a_n: int = 2, adapter: str | None = None) -> list[Request]:
    """Request A first (so it owns block 0), then the others with short and long totals."""
    others = [Request(p, sp(i + 1, m)) for i, (p, m) in enumerate(zip(OTHERS, [2, 8, 6], strict=True))]
    return [Request(a_prompt, sp(0, a_max_tokens, a_n), adapter=adapter), *others]


def fill_the_cache() -> list[Request]:
    """Eight requests that together take every block of CFG's cache, at odd prompt lengths (partial blocks)."""
    return [Request(list(range(10 + i, 15 + 2 * i)), sp(20 + i, 32 - (5 + i))) for i in range(8)]


def assert_same(a, b) -> None:
    """Two completions are equal bit for bit: tokens, logprobs, routed experts."""
    assert a.token_ids == b.token_ids
    assert torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.routed_experts, b.routed_experts)


def assert_clean(engine: LLMEngine) -> None:
    """Nothing queued or running, every KV block free, every refcount 0."""
    s = engine.scheduler
    assert not s.waiting and not s.prefilling and not s.running
    assert s.blocks.num_free == engine.cache.num_blocks
    assert set(s.blocks.refs) == {0}


def unused_token(outs, prompts) -> int:
    """A token id (>= 4) that no prompt or completion here contains."""
    used = {t for p in prompts for t in p} | {t for o in outs for c in o.outputs for t in c.token_ids}
    return next(t for t in range(4, 128) if t not in used)


def adapter_tensors(engine: LLMEngine, std: float, seed: int) -> dict[str, torch.Tensor]:
    """Random moerl-named adapter tensors of the slots' full rank for every adapted module of ``engine``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for path, lora in engine.adapters.modules.items():
        for key in LINEAR_KEYS if isinstance(lora, LinearLora) else EXPERT_KEYS:
            out[f"{path}.{key}"] = torch.randn(getattr(lora, key)[0].shape, generator=gen) * std
        out[f"{path}.scale"] = torch.tensor(1.0)
    return out


@pytest.fixture
def dense_model(hf_checkpoints):
    """The tiny Qwen3-MoE (fp32) with every token routed to all its experts (top_k = E).

    Then the shapes inside a batched forward do not depend on the values in it, so a request that goes
    non-finite leaves its batch mates' numbers bit-identical to a batch where it stays finite. (With top_k < E
    one row's routing changes the expert group sizes, hence the GEMM shapes and the last bits of other rows.)
    """
    base = load_model(hf_checkpoints[ARCH][0], dtype=torch.float32)
    model = MoEModel(dataclasses.replace(base.config, top_k=base.config.num_experts), torch.float32)
    model.load_state_dict(base.state_dict())
    model.hf_config = base.hf_config
    return model.eval()


# -- faults while generating ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "fault", "nth"),
    [("forward", KeyboardInterrupt, 1), ("forward", RuntimeError, 4), ("on_token", KeyboardInterrupt, 5)],
)
def test_an_interrupted_generate_leaves_the_engine_clean(where, fault, nth, hf_checkpoints, monkeypatch):
    # chunked prefill and 3 slots for 4 requests: the fault finds requests waiting, prefilling and running
    cfg = EngineConfig(max_num_seqs=3, max_model_len=32, block_size=4, max_num_batched_tokens=8)
    model = load_model(hf_checkpoints[ARCH][0], dtype=torch.float32)
    engine = LLMEngine(model, cfg)
    calls = []

    def maybe_fail(*_):
        calls.append(1)
        if len(calls) == nth:
            raise fault("injected fault")

    on_token = None
    if where == "forward":
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda *a, **k: maybe_fail() or forward(*a, **k))
    else:
        on_token = maybe_fail
    with pytest.raises(fault, match="injected fault"):
        engine.generate(batch(A_PROMPT, 6), on_token=on_token)
    assert_clean(engine)
    monkeypatch.undo()
    again = engine.generate(batch(A_PROMPT, 6))
    fresh = LLMEngine(model, cfg).generate(batch(A_PROMPT, 6))
    for a, b in zip(again, fresh, strict=True):
        assert a.error is None and len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert_same(x, y)


def test_a_non_finite_prompt_fails_its_request_alone(dense_model):
    # fresh engines: A is admitted first and gets block 0, the block short tables used to be padded with
    clean = LLMEngine(dense_model, CFG).generate(batch(A_PROMPT, 1))  # A stops where the poisoned A will fail
    engine = LLMEngine(dense_model, CFG)
    bad_tok = unused_token(clean, [A_PROMPT, *OTHERS])
    emb = dense_model.embed_tokens.weight
    saved = emb[bad_tok].clone()
    with torch.no_grad():
        emb[bad_tok] = float("nan")
    poisoned = A_PROMPT[:3] + [bad_tok] + A_PROMPT[4:]
    outs = engine.generate(batch(poisoned, 6))
    a = outs[0]
    assert re.match(r"request \d+: non-finite logits \(nan\) at generated token 0 of sample 0", a.error), a.error
    assert a.error_kind == "non_finite"
    assert [(c.finish_reason, c.token_ids) for c in a.outputs] == [("error", []), ("error", [])]
    for out, ref in zip(outs[1:], clean[1:], strict=True):
        assert out.error is None and out.error_kind is None
        assert_same(out.outputs[0], ref.outputs[0])
    assert_clean(engine)
    # the failed request's blocks held NaN keys/values; the requests that get them next are not poisoned
    with torch.no_grad():
        emb[bad_tok] = saved
    fresh = LLMEngine(dense_model, CFG).generate(fill_the_cache())
    for out, ref in zip(engine.generate(fill_the_cache()), fresh, strict=True):
        assert out.error is None
        assert_same(out.outputs[0], ref.outputs[0])


def test_non_finite_logits_while_decoding_fail_that_request_alone(dense_model):
    engine = LLMEngine(dense_model, CFG)
    free = engine.generate(batch(A_PROMPT, 8, a_n=1))
    others = [t for p in OTHERS for t in p] + [t for o in free[1:] for t in o.outputs[0].token_ids]
    gen = free[0].outputs[0].token_ids
    # a token A samples at index j, that nothing else here contains: make its embedding infinite
    j = next(j for j in range(1, 6) if gen[j] not in A_PROMPT + gen[:j] + others)
    clean = engine.generate(batch(A_PROMPT, j + 2, a_n=1))  # A' stops at the step where A will fail
    assert gen[j] not in [t for o in clean[1:] for t in o.outputs[0].token_ids]
    with torch.no_grad():
        dense_model.embed_tokens.weight[gen[j]] = float("inf")
    outs = engine.generate(batch(A_PROMPT, 8, a_n=1))
    a = outs[0]
    assert re.match(rf"request \d+: non-finite logits \(nan\) at generated token {j + 1} of sample 0", a.error)
    assert a.error_kind == "non_finite"
    c = a.outputs[0]
    assert c.finish_reason == "error" and c.token_ids == gen[: j + 1]
    assert torch.equal(c.logprobs, clean[0].outputs[0].logprobs[: j + 1])
    for out, ref in zip(outs[1:], clean[1:], strict=True):
        assert out.error is None
        assert_same(out.outputs[0], ref.outputs[0])
    assert_clean(engine)


def test_finite_logits_whose_sum_overflows_fail_no_request(dense_model, monkeypatch):
    """The step's finiteness check sums the logits first: finite logits of ~3e37 (their sum overflows to inf) are
    looked at row by row and fail nothing. Negative control: the same logits with one logit of the first decode
    step's first row inf fail that row's request alone."""
    engine = LLMEngine(dense_model, CFG)
    run = engine._run
    poison = {}

    def huge(kind, inputs, adapters):
        logits, routed = run(kind, inputs, adapters)
        logits = logits + 3e37  # every logit finite
        if "row" in poison and kind == "decode":  # the first decode step only
            logits[poison.pop("row"), 0] = float("inf")
        return logits, routed

    monkeypatch.setattr(engine, "_run", huge)
    assert not torch.isfinite(torch.full((4, 128), 3e37).sum())  # what the check sees: a sum that overflows
    outs = engine.generate(batch(A_PROMPT, 6))
    assert [o.error for o in outs] == [None] * 4
    assert all(len(c.token_ids) == c_max for o, c_max in zip(outs, [6, 2, 8, 6], strict=True) for c in o.outputs)
    poison["row"] = 0  # the first running row: a sample of A
    outs = engine.generate(batch(A_PROMPT, 6))
    assert re.match(r"request \d+: non-finite logits \(inf\) at generated token 1 of sample 0", outs[0].error)
    assert [o.error for o in outs[1:]] == [None] * 3
    assert_clean(engine)


def test_an_adapter_that_overflows_fails_only_its_requests(dense_model):
    cfg = dataclasses.replace(CFG, max_loras=1, max_lora_rank=4)
    engine = LLMEngine(dense_model, cfg)
    engine.add_adapter("a", adapter_tensors(engine, 0.1, seed=0))
    clean = engine.generate(batch(A_PROMPT, 1, adapter="a"))
    huge = {k: v * 1e30 if not k.endswith("scale") else v for k, v in adapter_tensors(engine, 0.1, seed=0).items()}
    engine.set_adapter("a", huge, version=1)  # finite, so loading accepts it; its products overflow
    outs = engine.generate(batch(A_PROMPT, 6, adapter="a"))
    assert re.match(r"request \d+: non-finite logits \((nan|inf)\) at generated token 0 of sample 0", outs[0].error)
    assert "adapter 'a'" in outs[0].error and outs[0].error_kind == "non_finite"
    assert all(c.finish_reason == "error" for c in outs[0].outputs)
    for out, ref in zip(outs[1:], clean[1:], strict=True):
        assert out.error is None
        assert_same(out.outputs[0], ref.outputs[0])
    assert_clean(engine)


# -- adapters refused at load ----------------------------------------------------------------------------------------


def _lora_engine(hf_checkpoints) -> LLMEngine:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]  # PEFT-writable (no dense MLP)
    cfg = EngineConfig(max_num_seqs=2, max_model_len=32, max_loras=1, max_lora_rank=4, lora_targets=targets)
    return LLMEngine(hf_checkpoints[ARCH][0], cfg, dtype=torch.float32)


def _slots(engine: LLMEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items() if ".lora." in k}


def test_non_finite_and_rank_zero_adapters_are_refused_and_leave_the_slot(hf_checkpoints):
    engine = _lora_engine(hf_checkpoints)
    good = adapter_tensors(engine, 0.1, seed=0)
    engine.set_adapter("a", good, version=3)
    before = _slots(engine)
    q_b, gu_a = "layers.0.self_attn.q_proj.lora_B", "layers.0.mlp.experts.gate_up_A"
    cases = [
        ({q_b: good[q_b].index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan")))}, q_b, "1 NaN"),
        ({gu_a: torch.full_like(good[gu_a], float("inf"))}, gu_a, f"{good[gu_a].numel()} inf"),
        ({"layers.0.self_attn.q_proj.scale": torch.tensor(float("-inf"))}, "layers.0.self_attn.q_proj.scale", "1 inf"),
    ]
    for change, key, what in cases:
        with pytest.raises(CheckpointError, match=rf"adapter 'a': tensor '{re.escape(key)}' has {what}"):
            engine.set_adapter("a", good | change, version=4)
    q_a = "layers.0.self_attn.q_proj.lora_A"
    rank0 = good | {q_a: torch.zeros(0, 64), q_b: torch.zeros(64, 0)}
    with pytest.raises(
        CheckpointError, match=rf"adapter 'b': tensor '{re.escape(q_a)}' has rank 0 \(shape \(0, 64\)\)"
    ):
        engine.add_adapter("b", rank0)
    scale = "layers.0.self_attn.q_proj.scale"
    with pytest.raises(
        CheckpointError, match=rf"adapter 'a': tensor '{scale}' has shape \(2,\); a scale is one number"
    ):
        engine.set_adapter("a", good | {scale: torch.ones(2)}, version=4)
    with pytest.raises(CheckpointError, match=rf"adapter 'a': '{q_a}' is a list, not a tensor"):
        engine.set_adapter("a", good | {q_a: [[0.0] * 64] * 4}, version=4)
    mixed = good | {q_a: good[q_a][:2]}
    with pytest.raises(CheckpointError, match=r"adapter 'a': module 'layers\.0\.self_attn\.q_proj' has lora_A of "):
        engine.set_adapter("a", mixed, version=4)
    after = _slots(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.weight_version == 3 and engine.adapters.names == {"a": 0}


def test_a_non_finite_peft_adapter_directory_is_refused(hf_checkpoints, tmp_path):
    engine = _lora_engine(hf_checkpoints)
    engine.add_adapter("a", adapter_tensors(engine, 0.1, seed=0))
    write_peft_adapter(engine.model, tmp_path, slot=0)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    weights[key][1, 2] = float("nan")
    save_file(weights, tmp_path / "adapter_model.safetensors")
    before = _slots(engine)
    with pytest.raises(
        CheckpointError, match=r"adapter 'a' \(from .*\): tensor 'layers\.0\.self_attn\.q_proj\.lora_A' has 1 NaN"
    ):
        engine.add_adapter("a", tmp_path)
    after = _slots(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("case", ["rank 0 linear", "rank 0 experts", "ranks differ", "config not json"])
def test_a_malformed_peft_adapter_directory_is_refused_by_name(case, hf_checkpoints, tmp_path):
    engine = _lora_engine(hf_checkpoints)
    engine.add_adapter("a", adapter_tensors(engine, 0.1, seed=0))
    write_peft_adapter(engine.model, tmp_path, slot=0)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    experts = next(k for k in weights if "experts" in k and k.endswith("lora_A.weight")).removesuffix(".lora_A.weight")
    if case == "rank 0 linear":
        weights[f"{q}.lora_A.weight"] = weights[f"{q}.lora_A.weight"][:0]
        weights[f"{q}.lora_B.weight"] = weights[f"{q}.lora_B.weight"][:, :0]
    elif case == "rank 0 experts":
        weights[f"{experts}.lora_A.weight"] = weights[f"{experts}.lora_A.weight"][:0]
        weights[f"{experts}.lora_B.weight"] = weights[f"{experts}.lora_B.weight"][:, :0]
    elif case == "ranks differ":
        weights[f"{q}.lora_B.weight"] = weights[f"{q}.lora_B.weight"][:, :1]
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "adapter_model.safetensors")
    if case == "config not json":
        (tmp_path / "adapter_config.json").write_text('{"r": 8,')
    pattern = {
        "rank 0 linear": r"module '.*q_proj' has lora_A \(0, \d+\) and lora_B \(\d+, 0\); needs .* rank r >= 1",
        "rank 0 experts": r"module '.*experts.*' has lora_A \(0, \d+\)",
        "ranks differ": r"module '.*q_proj' has lora_A \(\d+, \d+\) and lora_B \(\d+, 1\)",
        "config not json": r"adapter_config\.json is not valid JSON",
    }[case]
    before = _slots(engine)
    with pytest.raises(CheckpointError, match=pattern):
        engine.add_adapter("a", tmp_path)
    after = _slots(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- requests refused before anything runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["", ["ok", ""], ["ok", 3]])
def test_empty_or_non_text_stop_strings_are_refused(stop):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.stop={re.escape(repr(stop))}: must be non-empty str"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize("field", ["max_tokens", "min_tokens", "top_k", "n", "seed"])
@pytest.mark.parametrize("value", [2.5, "8", True, None])
def test_integer_sampling_fields_refuse_other_types(field, value):
    if value is None and field == "seed":
        return  # seed None: the engine's generator
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}={re.escape(repr(value))}: must be an int"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["1", None, float("nan"), float("inf"), True])
def test_real_sampling_fields_refuse_other_types(field, value):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}={re.escape(repr(value))}: must be a finite"):
        SamplingParams(**{field: value})


def test_sampling_params_take_numpy_and_torch_scalars():
    p = SamplingParams(max_tokens=np.int64(4), top_k=torch.tensor(3), seed=np.int32(1), temperature=np.float32(0.5))
    assert (p.max_tokens, p.top_k, p.seed, p.temperature) == (4, 3, 1, 0.5)
    assert type(p.max_tokens) is int and type(p.top_k) is int and type(p.temperature) is float
    with pytest.raises(ConfigError, match=r"SamplingParams\.stop_token_ids=\[1\.5\]: must be a list of int"):
        SamplingParams(stop_token_ids=[1.5])
    with pytest.raises(ConfigError, match=r"SamplingParams\.ignore_eos='no': must be True or False"):
        SamplingParams(ignore_eos="no")


@pytest.fixture
def engine(hf_checkpoints):
    return LLMEngine(hf_checkpoints[ARCH][0], EngineConfig(max_num_seqs=4, max_model_len=16, max_loras=1))


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([5, 1.5], r"prompt token 1\.5 at position 1 is not an integer token id"),
        ([5, "a"], r"prompt token 'a' at position 1 is not an integer token id"),
        ([True, 5], r"prompt token True at position 0 is not an integer token id"),
        ([5, torch.tensor(6.0)], r"prompt token tensor\(6\.\) at position 1 is not an integer token id"),
        (torch.tensor([5.0, 6.0]), r"prompt is a torch\.float32 tensor; token ids must be integers"),
        (torch.tensor([[5, 6]]), r"prompt tensor has shape \(1, 2\); token ids must be 1-D"),
        (None, r"prompt must be text or a list of token ids, not NoneType"),
    ],
)
def test_non_integer_prompt_tokens_are_refused(engine, prompt, message, monkeypatch):
    ran = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: ran.append(1) or forward(*a, **k))
    with pytest.raises(RequestError, match=rf"request 1: {message}"):
        engine.generate([Request([5, 6], request_id="0"), Request(prompt, request_id="1")])
    assert not ran
    assert_clean(engine)


def test_integer_prompts_of_any_kind_are_taken(engine):
    prompts = [torch.tensor([5, 6]), np.array([5, 6]), [np.int64(5), torch.tensor(6)], (5, 6)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=2))
    assert all(o.prompt_token_ids == [5, 6] and type(o.prompt_token_ids[0]) is int for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def test_stop_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(RequestError, match=r"request 1: stop token id 500 outside the vocabulary \[0, 128\)"):
        engine.generate([[5, 6], Request([5, 6], SamplingParams(stop_token_ids=[3, 500]))])
    with pytest.raises(RequestError, match=r"request 0: stop token id -1 outside the vocabulary"):
        engine.generate([Request([5, 6], SamplingParams(stop_token_ids=[-1]))])
    assert_clean(engine)


def test_unknown_adapters_are_request_errors(engine, hf_checkpoints):
    with pytest.raises(RequestError, match=r"request 0: unknown adapter 'nope'; loaded adapters: none"):
        engine.generate([Request([5, 6], adapter="nope")])
    with pytest.raises(RequestError, match=r"request 0: adapter must be a name \(str\), not int"):
        engine.generate([Request([5, 6], adapter=3)])
    with pytest.raises(RequestError, match=r"remove_adapter: unknown adapter 'nope'; loaded adapters: none"):
        engine.remove_adapter("nope")
    plain = LLMEngine(engine.model, EngineConfig(max_num_seqs=2, max_model_len=16))
    with pytest.raises(ConfigError, match=r"remove_adapter\('x'\): EngineConfig\.max_loras=0"):
        plain.remove_adapter("x")
    with pytest.raises(RequestError, match=r"request 0: params must be a SamplingParams, not dict"):
        engine.generate([Request([5, 6], params={"max_tokens": 2})])


def test_rejected_requests_say_so(engine):
    outs = engine.generate(
        [[5] * 16, Request([5, 6], SamplingParams(n=5)), [5, 6]], SamplingParams(max_tokens=2, temperature=0)
    )
    assert outs[0].error.startswith("request 0: prompt of 16 tokens does not fit the context window")
    assert outs[1].error.startswith("request 1: n=5 samples exceed EngineConfig.max_num_seqs=4")
    assert [o.error_kind for o in outs] == ["rejected", "rejected", None]
    assert outs[2].outputs[0].finish_reason == "length"


def _peft_saved(base_path, out, task_type) -> None:
    """A LoRA on the attention of transformers' model of ``base_path``, saved by PEFT itself (its own
    adapter_config.json: ``base_model_name_or_path``, and ``auto_mapping`` where ``task_type`` is None)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type=task_type
    )
    get_peft_model(base, lora).save_pretrained(out)


def test_an_adapter_of_another_family_is_refused_by_name_and_one_of_this_family_loads(hf_checkpoints, tmp_path):
    """Mixtral's attention has Qwen3-MoE's tensor names and shapes, so its adapters would load onto Qwen3-MoE (the
    control: one that says nothing of its base does). One that names its base is refused, naming both
    architectures, from what moerl writes (``auto_mapping``) and from what PEFT writes (its base's config.json, or
    its own ``auto_mapping``), the slots left as they were; adapters of Qwen3-MoE bases (this checkpoint, another
    one of the family) load."""
    import json
    import shutil

    mixtral = hf_checkpoints["MixtralForCausalLM"][0]
    other = EngineConfig(max_num_seqs=2, max_model_len=32, max_loras=1, max_lora_rank=4, lora_targets=["q_proj"])
    foreign = LLMEngine(mixtral, other, dtype=torch.float32)
    foreign.add_adapter("m", adapter_tensors(foreign, 0.1, seed=1))
    write_peft_adapter(foreign.model, tmp_path / "moerl", base=str(mixtral))
    _peft_saved(mixtral, tmp_path / "peft", "CAUSAL_LM")
    _peft_saved(mixtral, tmp_path / "peft_auto", None)
    cfg = json.loads((tmp_path / "moerl" / "adapter_config.json").read_text())
    assert cfg["auto_mapping"]["base_model_class"] == "MixtralForCausalLM"
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["auto_mapping"] is None

    engine = _lora_engine(hf_checkpoints)
    engine.add_adapter("a", adapter_tensors(engine, 0.1, seed=0))
    before = _slots(engine)
    said = {
        "moerl": r"auto_mapping\.base_model_class 'MixtralForCausalLM'",
        "peft": rf"base_model_name_or_path '{re.escape(str(mixtral))}', whose config\.json says MixtralForCausalLM",
        "peft_auto": r"auto_mapping\.base_model_class 'MixtralForCausalLM'",
    }
    for made, by in said.items():
        with pytest.raises(CheckpointError) as refused:
            engine.add_adapter("a", tmp_path / made)
        want = rf"adapter_config\.json: the adapter was made for a MixtralForCausalLM model \({by}\), not for this "
        assert re.search(want + r"Qwen3MoeForCausalLM model; load it onto a MixtralForCausalLM checkpoint", str(
            refused.value
        )), (made, str(refused.value))  # fmt: skip
        assert all(torch.equal(before[k], v) for k, v in _slots(engine).items()), made
    # the control: the same adapter saying nothing of its base loads, its names and shapes being Qwen3-MoE's too
    silent = tmp_path / "silent"
    shutil.copytree(tmp_path / "moerl", silent)
    (silent / "adapter_config.json").write_text(
        json.dumps(cfg | {"auto_mapping": None, "base_model_name_or_path": None})
    )
    engine.add_adapter("a", silent)
    assert not all(torch.equal(before[k], v) for k, v in _slots(engine).items())

    qwen = hf_checkpoints[ARCH][0]
    sibling = tmp_path / "sibling"  # another checkpoint of the family (a fine-tune, a copy elsewhere)
    shutil.copytree(qwen, sibling)
    write_peft_adapter(engine.model, tmp_path / "own", slot=0, base=str(qwen))
    write_peft_adapter(engine.model, tmp_path / "sibling_adapter", slot=0, base=str(sibling))
    _peft_saved(qwen, tmp_path / "own_peft", None)
    for made in ("own", "sibling_adapter", "own_peft"):
        engine.add_adapter("a", tmp_path / made)
    assert engine.adapters.names == {"a": 0}


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("auto_mapping", "MixtralForCausalLM", "auto_mapping must be an object with a base_model_class string"),
        ("auto_mapping", {"parent_library": "transformers"}, "auto_mapping must be an object with a base_model_class"),
        ("base_model_name_or_path", 3, "base_model_name_or_path must be a string, got int"),
    ],
)
def test_an_adapter_config_naming_its_base_wrongly_is_refused_by_name(field, value, said, hf_checkpoints, tmp_path):
    import json

    engine = _lora_engine(hf_checkpoints)
    engine.add_adapter("a", adapter_tensors(engine, 0.1, seed=0))
    write_peft_adapter(engine.model, tmp_path, slot=0)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg | {field: value}))
    before = _slots(engine)
    with pytest.raises(CheckpointError, match=rf"adapter_config\.json: {re.escape(said)}"):
        engine.add_adapter("a", tmp_path)
    assert all(torch.equal(before[k], v) for k, v in _slots(engine).items())


# -- empty prompts in rollouts -------------------------------------------------------------------------------------


def _generator(tmp_path, env, max_model_len: int = 32):
    from moerl.presets import init_model
    from moerl.rollout.generator import Generator
    from moerl.run_config import AlgoSection, RolloutSection

    init_model("qwen3_moe", "tiny", tmp_path / "model", seed=0)
    engine = LLMEngine(tmp_path / "model", EngineConfig(max_num_seqs=8, max_model_len=max_model_len), torch.float32)
    rollout = RolloutSection(max_tokens=4, max_model_len=max_model_len)
    return Generator(env, engine, rollout, AlgoSection(), seed=0, eval_problems=0, lora=False)


def test_an_empty_prompt_in_a_rollout_is_named_without_the_context_hint(tmp_path):
    """Single-turn: a rejected rollout stops the step naming its prompt; an empty one is not told to raise the
    context window (the control: a prompt too long for it still is)."""
    from moerl.envs import make_env
    from moerl.envs.base import Problem

    gen = _generator(tmp_path, make_env("arithmetic", max_operand=4, ops="+", num_terms=2))
    with pytest.raises(ConfigError, match=r"^rollout of '' failed: request 1: empty prompt$"):
        gen.generate([Problem("1+1=", 2), Problem("", 0)], gen.sampling(2, 1.0, 2, seed=0))
    with pytest.raises(ConfigError, match=r"does not fit the context window .*\(raise rollout\.max_model_len\?\)$"):
        gen.generate([Problem("1+1=", 2), Problem("1+" * 20, 0)], gen.sampling(2, 1.0, 2, seed=0))


def test_an_empty_prompt_fails_its_multi_turn_episodes_alone(tmp_path):
    """Multi-turn: the episodes of an empty prompt end as failed (reward 0, the error kept, its group dropped by
    training), not as cut by the context window, and the other episodes take their turns (the control: a prompt too
    long for the context still ends "context")."""
    from moerl.envs.base import Problem
    from moerl.envs.tool import CalculatorToolEnv

    gen = _generator(tmp_path, CalculatorToolEnv(max_turns=2))
    good = CalculatorToolEnv().problems(1, seed=0)[0]
    problems = [good, Problem("", good.answer), Problem("1+" * 20, good.answer)]
    episodes = gen.generate(problems, gen.sampling(3, 1.0, 2, seed=0))
    by_group = {g: [e for e in episodes if e.group == g] for g in range(3)}
    assert all(e.finish_reason != "error" and len(e.tokens) > e.num_prompt for e in by_group[0])
    assert all(e.finish_reason == "error" and e.reward == 0.0 for e in by_group[1])
    assert all(re.fullmatch(r"request \d+: empty prompt", e.reward_error) for e in by_group[1])
    assert all(e.finish_reason == "context" for e in by_group[2])
