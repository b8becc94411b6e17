"""The native engine: fidelity to a full forward, sampling, batching and memory, bad requests."""

import pytest
import torch
from hf_models import ARCHS

from moerl.engine import EngineConfig, LLMEngine, Request, RequestError, SamplingParams
from moerl.errors import CheckpointError, ConfigError
from moerl.presets import init_model


def k3(d: torch.Tensor) -> float:
    return (d.exp() - 1 - d).mean().item()


def full_forward_check(model, out, temperature=1.0, adapters=None):
    """k3 KL of engine vs full-forward logprobs and whether the routed experts match, for one completion."""
    prompt, c = out.prompt_token_ids, out.outputs[0]
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        ref = model(ids, capture=True, adapters=adapters)
    logits = ref.logits[0, len(prompt) - 1 : -1].float() / (temperature or 1.0)
    lp = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
    routed_ok = torch.equal(ref.routed[0, :-1].to(c.routed_experts.dtype), c.routed_experts)
    return k3(lp - c.logprobs), routed_ok


def engine_vs_full_forward(engine) -> tuple[float, bool]:
    """Three prompts (3, 9 and 14 tokens) sampled at 0.8 for 10 tokens against a full forward of each finished
    sequence: (the largest k3 of the engine's logprobs, whether every token's experts are the forward's)."""
    from moerl.engine import Request, SamplingParams

    prompts = [torch.randint(4, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 14)]
    outs = engine.generate(
        [Request(p, SamplingParams(temperature=0.8, max_tokens=10, seed=i)) for i, p in enumerate(prompts)]
    )
    checks = [full_forward_check(engine.model, out, temperature=0.8) for out in outs]
    return max(kl for kl, _ in checks), all(ok for _, ok in checks)


def _prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_logprobs_and_routing_match_a_full_forward_fp32(arch, hf_checkpoints):
    # chunked prefill (8 tokens a step), prompts across block edges, n=2 sharing a prompt, sliding windows of 6
    engine = LLMEngine(
        hf_checkpoints[arch][0],
        EngineConfig(max_num_seqs=6, max_model_len=64, block_size=4, max_num_batched_tokens=8),
        dtype=torch.float32,
    )
    requests = [
        Request(p, SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=i))
        for i, p in enumerate(_prompts(4, [3, 9, 14, 5]))
    ]
    outs = engine.generate(requests)
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            kl, routed_ok = full_forward_check(
                engine.model, type(out)(out.request_id, out.prompt_token_ids, [c], 0), temperature=0.8
            )
            assert kl <= 1e-6, f"k3 {kl}"
            assert routed_ok
            assert c.routed_experts.shape == (
                len(out.prompt_token_ids) + len(c.token_ids) - 1,
                len(engine.model.moe_layer_ids),
                engine.model.config.top_k,
            )
            assert c.routed_experts.dtype == torch.uint8
    assert engine.scheduler.blocks.num_free == engine.cache.num_blocks  # every block came back


def test_engine_bf16_logprobs_close(hf_checkpoints):
    engine = LLMEngine(hf_checkpoints["Qwen3MoeForCausalLM"][0], EngineConfig(max_num_seqs=8, max_model_len=64))
    outs = engine.generate(_prompts(8, [5, 11]), SamplingParams(max_tokens=16, seed=1))
    kls = [full_forward_check(engine.model, o)[0] for o in outs]
    assert max(kls) <= 1e-3  # measured ~1e-5: bf16 batched decode vs one full bf16 forward


def test_greedy_matches_argmax_and_seeds_repeat(hf_checkpoints):
    engine = LLMEngine(
        hf_checkpoints["MixtralForCausalLM"][0], EngineConfig(max_num_seqs=4, max_model_len=64), dtype=torch.float32
    )
    prompt = _prompts(1, [7])[0]
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    ids = torch.tensor([prompt + greedy.token_ids])
    with torch.no_grad():
        argmax = engine.model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert greedy.token_ids == argmax
    assert engine.generate([prompt], SamplingParams(top_k=1, max_tokens=10, seed=3))[0].outputs[0].token_ids == argmax
    a = engine.generate([prompt] * 3, SamplingParams(max_tokens=10, seed=7))
    b = engine.generate([prompt] * 3, SamplingParams(max_tokens=10, seed=7))
    c = engine.generate([prompt], SamplingParams(max_tokens=10, seed=8))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert a[0].outputs[0].token_ids != c[0].outputs[0].token_ids


def test_sampled_tokens_follow_the_distribution_per_row_generators_and_shared():
    """The batched inverse-CDF sampler: 40k draws of a 6-token distribution (temperature 0.7, one token masked by
    top-k) land within 0.01 of its probabilities (total variation), from per-row seeded generators and from the
    engine's own alike; a zero-probability token is never drawn; the same generators repeat the same tokens. Negative
    control: the distribution at temperature 1 lies beyond the tolerance."""
    from moerl.engine.sampler import sample, sequence_generator

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 4000
    params = [SamplingParams(temperature=0.7, top_k=5)] * rows
    want = torch.cat([(logits[:5] / 0.7).softmax(-1), torch.zeros(1)])
    for seeded in (True, False):
        counts = torch.zeros(6)
        for step in range(10):
            gens = [sequence_generator(step, i) if seeded else None for i in range(rows)]
            tokens, logp = sample(logits.expand(rows, 6), params, gens, [0] * rows, None, torch.Generator())
            counts += torch.bincount(tokens, minlength=6)
            assert torch.allclose(logp, (logits / 0.7).log_softmax(-1)[tokens])  # logprobs before top-k
        freq = counts / counts.sum()
        assert counts[5] == 0
        assert 0.5 * (freq - want).abs().sum() < 0.01, (freq, want)
        assert 0.5 * (freq - logits.softmax(-1)).abs().sum() > 0.05  # negative control
    again = [sequence_generator(0, i) for i in range(8)], [sequence_generator(0, i) for i in range(8)]
    first, second = (sample(logits.expand(8, 6), params[:8], g, [0] * 8, None, torch.Generator())[0] for g in again)
    assert torch.equal(first, second)


def test_a_batch_of_greedy_and_sampled_rows_samples_each_as_alone():
    """Greedy rows (temperature 0) beside seeded sampled ones: each greedy row takes its argmax, each sampled row
    the token its generator gives in a batch of sampled rows alone (the sampled rows' own path); the control: the
    sampled rows' tokens are not all their argmax."""
    from moerl.engine.sampler import sample, sequence_generator

    logits = torch.randn(12, 40, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0) for i in range(12)]
    gens = [sequence_generator(7, i) for i in range(12)]
    tokens, logp = sample(logits, params, gens, [0] * 12, None, torch.Generator())
    sampled = [i for i in range(12) if i % 3]
    alone = sample(logits[sampled], [params[i] for i in sampled], [sequence_generator(7, i) for i in sampled],
                   [0] * len(sampled), None, torch.Generator())[0]  # fmt: skip
    greedy = [i for i in range(12) if i % 3 == 0]
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1)) and torch.equal(tokens[sampled], alone)
    assert not torch.equal(tokens[sampled], logits[sampled].argmax(-1))
    assert torch.allclose(logp, logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(12, 40), (64, 128), (9, 32000)])
def test_the_samplers_one_call_draws_the_torch_ops_tokens(rows, vocab, dtype, monkeypatch):
    """A CPU step without top-k / top-p or held-back tokens samples in one kernel call (``moerl_sample``): against
    the torch ops it replaces (the kernel not built), the same tokens from the same uniforms, greedy and sampled rows
    mixed, at temperatures 0.7 and 1.3, and logprobs within 1e-5 (the sums in another order; fp32 and bf16 logits, a
    32k vocabulary on two threads). The control: the logprobs of another temperature lie beyond it."""
    import moerl.engine.sampler as sampler

    if sampler.kernel() is None:
        pytest.skip("the kernels do not build here")
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(dtype)
    params = [SamplingParams(temperature=(0.0, 0.7, 1.3)[i % 3]) for i in range(rows)]

    def run(temps=params):
        gens = [sampler.sequence_generator(11, i) if i % 2 else None for i in range(rows)]
        return sampler.sample(logits, temps, gens, [0] * rows, None, torch.Generator().manual_seed(3))

    tokens, logp = run()
    with monkeypatch.context() as m:
        m.setattr(sampler, "kernel", lambda: None)
        want_tokens, want_logp = run()
    assert torch.equal(tokens, want_tokens) and torch.allclose(logp, want_logp, rtol=0, atol=1e-5)
    hotter = run([SamplingParams(temperature=p.temperature * 1.01 or 0.0) for p in params])[1]
    assert not torch.allclose(hotter, want_logp, rtol=0, atol=1e-5)


def _whole_vocabulary_scan(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The oracle: a float64 cumulative sum over the whole vocabulary and one search in it."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point[:, None], right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [40, 1024, 5000, 151936])
def test_the_two_level_search_draws_the_whole_vocabulary_scans_tokens(vocab):
    """``inverse_cdf`` (block sums, then a scan inside one block: no [M, V] float64 tensor) picks the tokens the
    float64 scan of the whole vocabulary picks for the same uniforms, masked (zero-probability) tokens never; a row
    of NaN gets a token in range. The control: uniforms moved by 1% of the mass pick other tokens."""
    from moerl.engine.sampler import inverse_cdf

    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[::4, ::3] = float("-inf")  # every fourth row: a third of its tokens masked out, as top-k / top-p do
    probs = logits.softmax(-1)
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-12], dtype=torch.float64)  # the ends of the range
    picked = inverse_cdf(probs, u)
    assert torch.equal(picked, _whole_vocabulary_scan(probs, u))
    assert bool((probs.gather(1, picked[:, None]) > 0).all())
    moved = _whole_vocabulary_scan(probs, (u + 1e-2).clamp(max=1 - 2**-53))
    assert not torch.equal(picked, moved)
    nan = torch.full((2, vocab), float("nan"))
    assert bool(((inverse_cdf(nan, u[:2]) >= 0) & (inverse_cdf(nan, u[:2]) < vocab)).all())


def test_top_p_keeps_the_nucleus(hf_checkpoints):
    engine = LLMEngine(
        hf_checkpoints["Qwen3MoeForCausalLM"][0], EngineConfig(max_num_seqs=8, max_model_len=64), dtype=torch.float32
    )
    prompt = _prompts(1, [6])[0]
    out = engine.generate([Request(prompt, SamplingParams(top_p=0.05, max_tokens=1, n=16, seed=0))])[0]
    with torch.no_grad():
        probs = engine.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
    ordered, order = probs.sort(descending=True)
    keep = int(((ordered.cumsum(0) - ordered) < 0.05).sum())  # the smallest prefix reaching 5% of the mass
    nucleus = set(order[:keep].tolist())
    assert keep < 20
    assert {c.token_ids[0] for c in out.outputs} <= nucleus


def test_stops_min_tokens_and_lengths(tmp_path):
    init_model("qwen3_moe", "tiny", tmp_path, seed=0)
    engine = LLMEngine(tmp_path, EngineConfig(max_num_seqs=8, max_model_len=64))
    eos = engine.tokenizer.eos_token_id
    prompt = "12+7="
    free = engine.generate([prompt], SamplingParams(max_tokens=20, seed=0, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    # the context window cuts a completion before max_tokens: its finish reason says so ("context", not "length")
    n = len(engine.tokenizer(prompt)["input_ids"])
    small = LLMEngine(tmp_path, EngineConfig(max_num_seqs=8, max_model_len=n + 6))
    window = small.generate([prompt], SamplingParams(max_tokens=20, seed=0, ignore_eos=True))[0].outputs[0]
    assert window.finish_reason == "context" and window.token_ids == free.token_ids[:6]
    fits = small.generate([prompt], SamplingParams(max_tokens=6, seed=0, ignore_eos=True))[0].outputs[0]
    assert fits.finish_reason == "length" and fits.token_ids == free.token_ids[:6]  # max_tokens itself: length
    stop_tok = free.token_ids[4]
    cut = engine.generate([prompt], SamplingParams(max_tokens=20, seed=0, ignore_eos=True, stop_token_ids=[stop_tok]))[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]
    text = free.text
    stop_str = text[6:8]
    s = engine.generate([prompt], SamplingParams(max_tokens=20, seed=0, ignore_eos=True, stop=[stop_str]))[0]
    assert s.outputs[0].finish_reason == "stop" and s.outputs[0].text == text[: text.index(stop_str)]
    # min_tokens: eos can never be sampled before it
    outs = engine.generate(
        [prompt] * 4,
        SamplingParams(max_tokens=12, min_tokens=12, temperature=3.0, seed=2, stop_token_ids=[free.token_ids[0]]),
    )
    for o in outs:
        toks = o.outputs[0].token_ids
        assert len(toks) == 12 and eos not in toks[:-1] and free.token_ids[0] not in toks[:-1]


def test_continuous_batching_with_a_small_cache(hf_checkpoints):
    cfg = EngineConfig(max_num_seqs=3, max_model_len=32, block_size=4)
    engine = LLMEngine(hf_checkpoints["OlmoeForCausalLM"][0], cfg, dtype=torch.float32)
    assert engine.kv_cache_bytes == engine.cache.nbytes > 0
    outs = engine.generate(_prompts(10, [4, 13, 7]), SamplingParams(max_tokens=9, seed=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 9 for o in outs)
    for o in outs[:3]:
        assert full_forward_check(engine.model, o)[0] <= 1e-6
    # a budget for one full-length sequence at a time still serves every request
    per_block = engine.cache.nbytes // engine.cache.num_blocks
    tight = LLMEngine(
        engine.model, EngineConfig(max_num_seqs=8, max_model_len=32, block_size=4, kv_cache_bytes=per_block * 8)
    )
    assert tight.cache.num_blocks == 8
    again = tight.generate(_prompts(10, [4, 13, 7]), SamplingParams(max_tokens=9, seed=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 9 for o in again)


def test_n_samples_prefill_once_and_share_the_prompt(hf_checkpoints):
    engine = LLMEngine(
        hf_checkpoints["Qwen3MoeForCausalLM"][0],
        EngineConfig(max_num_seqs=8, max_model_len=64, block_size=4),
        dtype=torch.float32,
    )
    calls = []
    forward = engine.model.forward
    engine.model.forward = lambda *a, **k: calls.append(a[0].shape) or forward(*a, **k)
    prompt = _prompts(1, [10])[0]
    out = engine.generate([Request(prompt, SamplingParams(max_tokens=4, n=4, seed=0))])[0]
    engine.model.forward = forward
    assert calls[0] == (1, 10)  # one prefill row for the four samples
    assert all(shape[0] == 4 and shape[1] == 1 for shape in calls[1:])
    group_blocks = engine.scheduler.blocks_needed(engine._group(0, Request(prompt, SamplingParams(max_tokens=4, n=4))))
    assert group_blocks < 4 * engine.scheduler.blocks_needed(
        engine._group(0, Request(prompt, SamplingParams(max_tokens=4)))
    )
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    rows = [c.routed_experts[: len(prompt)] for c in out.outputs]
    assert all(torch.equal(r, rows[0]) for r in rows)


def test_update_weights_keeps_router_fp32_bit_for_bit_and_tags_version(hf_checkpoints):
    engine = LLMEngine(hf_checkpoints["Qwen3MoeForCausalLM"][0], EngineConfig(max_num_seqs=2, max_model_len=32))
    name = "layers.0.mlp.router.weight"
    new = torch.randn_like(engine.model.get_parameter(name), dtype=torch.float32)
    engine.update_weights({name: new, "norm.weight": torch.ones(64)}, version=7)
    assert engine.model.get_parameter(name).dtype == torch.float32
    assert torch.equal(engine.model.get_parameter(name), new)
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].weight_version == 7
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.0\.mlp\.nope'"):
        engine.update_weights({"layers.0.mlp.nope": new}, version=8)
    with pytest.raises(CheckpointError, match=r"'norm\.weight' has shape \(3,\), the model expects \(64,\)"):
        engine.update_weights({"norm.weight": torch.ones(3)}, version=8)
    assert engine.weight_version == 7


def test_an_fp32_engine_keeps_large_experts_k_major_and_decodes_what_the_checkpoint_computes(tmp_path):
    """Experts of over 256 KiB each in fp32 (streaming their weights bounds decode): the engine's own model stores
    them K-major (``moerl.cpu.experts.k_major``: shapes and values unchanged, each GEMM's weight operand contiguous)
    and decodes from their packed panels (the CPU backend's ``KernelExperts``, made again after a sync); its logprobs
    and experts are a full forward's of the checkpoint loaded in its own layout (k3 <= 1e-6 fp32). A weight sync
    writes through the layout: one expert perturbed by update_weights moves the logprobs past the tolerance (the
    control), and the original weights synced back restore parity."""
    from moerl.bridges import load_model
    from moerl.cpu.kernels import kernel, pack
    from moerl.model.grouped import streams_weights

    ckpt = tmp_path / "big_experts"
    big = {"num_hidden_layers": 2, "hidden_size": 256, "moe_intermediate_size": 384}  # 768 / 384 KiB an expert
    init_model("qwen3_moe", "tiny", ckpt, overrides=big)
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=4, max_model_len=64), dtype=torch.float32)
    experts = engine.model.layers[0].mlp.experts
    assert streams_weights(experts.gate_up_proj) and streams_weights(experts.down_proj)
    assert experts.gate_up_proj.transpose(1, 2).is_contiguous() and experts.down_proj.transpose(1, 2).is_contiguous()
    packed = getattr(experts, "has_panels", False)
    assert packed == (kernel() is not None)  # decode's GEMMs from packed panels where the kernel builds
    reference = load_model(ckpt, dtype=torch.float32)  # as the trainer holds it: [E, 2I, H] contiguous
    assert reference.layers[0].mlp.experts.gate_up_proj.is_contiguous()
    assert torch.equal(reference.layers[0].mlp.experts.gate_up_proj, experts.gate_up_proj)

    def against_reference() -> tuple[float, bool]:
        prompts = [torch.randint(4, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 14)]
        outs = engine.generate(
            [Request(p, SamplingParams(temperature=0.8, max_tokens=10, seed=i)) for i, p in enumerate(prompts)]
        )
        checks = [full_forward_check(reference, out, temperature=0.8) for out in outs]
        return max(kl for kl, _ in checks), all(ok for _, ok in checks)

    kl, routed_ok = against_reference()
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)
    name = "layers.1.mlp.experts.gate_up_proj"
    original = reference.get_parameter(name).detach().clone()
    engine.update_weights({name: original + 0.05 * torch.randn_like(original)}, version=1)
    assert engine.model.get_parameter(name).transpose(1, 2).is_contiguous()  # copied into the layout, not around it
    assert against_reference()[0] > 1e-6
    if packed:  # the panels were made again from the synced weight
        layer1 = engine.model.layers[1].mlp.experts
        assert torch.equal(layer1._packed["gate_up"][1], pack(layer1.gate_up_proj.transpose(1, 2), True))
    engine.update_weights({name: original}, version=2)
    kl, routed_ok = against_reference()
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


def test_prompt_longer_than_context_fails_alone(hf_checkpoints):
    engine = LLMEngine(hf_checkpoints["Qwen3MoeForCausalLM"][0], EngineConfig(max_num_seqs=4, max_model_len=16))
    outs = engine.generate([[5] * 8, [6] * 16, [7] * 30, [8] * 4], SamplingParams(max_tokens=4))
    assert [o.error is None for o in outs] == [True, False, False, True]
    assert "prompt of 16 tokens does not fit the context window (EngineConfig.max_model_len=16)" in outs[1].error
    assert outs[1].outputs == [] and len(outs[0].outputs[0].token_ids) == 4 and len(outs[3].outputs[0].token_ids) == 4
    clipped = engine.generate([[5] * 14], SamplingParams(max_tokens=10))[0].outputs[0]
    assert len(clipped.token_ids) == 2 and clipped.finish_reason == "context"  # ran into the context window


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("temperature", -0.5, "must be >= 0"),
        ("top_p", 0.0, r"must lie in \(0, 1\]"),
        ("top_p", 1.5, r"must lie in \(0, 1\]"),
        ("max_tokens", 0, "must be >= 1"),
        ("n", 0, "must be >= 1"),
        ("top_k", -1, "must be >= 0"),
        ("min_tokens", 50, r"must lie in \[0, max_tokens=16\]"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value, rule):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}={value!r}: {rule}"):
        SamplingParams(**{field: value})


def test_an_empty_prompt_fails_alone_and_the_others_generate(hf_checkpoints):
    """An empty prompt (nothing to start from) is rejected on its own, as a prompt too long for the context is: the
    other requests give what they give without it, bit for bit; the cache is left clean."""
    engine = LLMEngine(hf_checkpoints["Qwen3MoeForCausalLM"][0], EngineConfig(max_num_seqs=2, max_model_len=32))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    outs = engine.generate([[5, 6], [], [7, 8, 9], torch.tensor([], dtype=torch.long)], greedy)
    alone = engine.generate([[5, 6], [7, 8, 9]], greedy)
    for i in (1, 3):
        assert outs[i].error == f"request {i}: empty prompt" and outs[i].error_kind == "rejected"
        assert outs[i].outputs == [] and outs[i].prompt_token_ids == []
    for out, want in zip([outs[0], outs[2]], alone, strict=True):
        assert out.error is None and out.outputs[0].token_ids == want.outputs[0].token_ids
        assert torch.equal(out.outputs[0].logprobs, want.outputs[0].logprobs)
    assert engine.scheduler.blocks.num_free == engine.cache.num_blocks


def test_bad_requests_raise_before_anything_runs(hf_checkpoints):
    engine = LLMEngine(hf_checkpoints["Qwen3MoeForCausalLM"][0], EngineConfig(max_num_seqs=2, max_model_len=32))
    with pytest.raises(RequestError, match=r"request 0: prompt token 500 outside the vocabulary \[0, 128\)"):
        engine.generate([[5, 500]])
    with pytest.raises(RequestError, match="adapter 'x' asked for, but EngineConfig.max_loras=0"):
        engine.generate([Request([5, 6], adapter="x")])
    assert engine.scheduler.blocks.num_free == engine.cache.num_blocks


def test_engine_config_errors(hf_checkpoints):
    path = hf_checkpoints["Qwen3MoeForCausalLM"][0]
    with pytest.raises(ConfigError, match=r"EngineConfig\.kv_cache_bytes=1000: one sequence of max_model_len=64"):
        LLMEngine(path, EngineConfig(max_model_len=64, kv_cache_bytes=1000))
    with pytest.raises(ConfigError, match=r"EngineConfig\.max_num_seqs=0: must be >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"max_model_len=100000: exceeds the model's max_position_embeddings"):
        LLMEngine(path, EngineConfig(max_model_len=100000))


def test_where_a_compiler_runs_the_kernels_build():
    """The kernel tests skip where no C compiler exists; where one does, ``kernels.c`` must build: a compile error
    fails here (with the compiler's words) instead of skipping every kernel test. The control: a compiler that is
    not one (``false``) leaves no kernel and says so."""
    import os
    import shutil
    import subprocess
    import sys

    import moerl.cpu.kernels as packed

    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("no C compiler here")
    assert packed.kernel() is not None, packed.build_error
    code = "import moerl.cpu.kernels as packed; assert packed.kernel() is None; print(repr(packed.build_error))"
    env = os.environ | {"CC": "false"}  # the build's tag names its compiler: no kernel built by gcc is found
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
