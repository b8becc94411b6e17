"""The compiled decode step (EngineConfig.compile_decode) against the eager engine: same tokens, logprobs within
1e-5 (fp32) and the same routing, while the batch shrinks through the buckets and the block tables grow; weight
updates reach the compiled graph (negative control: the generation under the old weights fails the comparison).
The dense expert path the graph takes is checked eagerly against the grouped one."""

import json
import re
import time

import pytest
import torch

from moerl import dynamo
from moerl.cpu import install, kernel_module
from moerl.cpu.kernels import graph_panels, kernel, packs
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.engine import compiled as compiled_decode
from moerl.errors import ConfigError
from moerl.model.mx import apply_mxfp8
from moerl.model.swap import replace_module
from moerl.presets import init_model

# GPT-OSS tiny, two layers: sinks, a sliding and a full layer, expert biases, clamped SwiGLU
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}


def _requests(n: int = 12) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 100, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g) for _ in range(n)]
    # lengths 5..38: the batch shrinks from 12 rows through the buckets; tables grow from 1 to 4 blocks of 16
    return [
        Request(p.tolist(), SamplingParams(max_tokens=5 + 3 * i, temperature=1.0, ignore_eos=True, seed=i))
        for i, p in enumerate(prompts)
    ]


def _compare(a, b, tol: float = 1e-5) -> float:
    """Max logprob difference of two generations with the same tokens and routing."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert torch.equal(cx.routed_experts, cy.routed_experts)
            worst = max(worst, float((cx.logprobs - cy.logprobs).abs().max()))
    assert worst < tol, worst
    return worst


def test_compiled_decode_matches_eager_and_sees_weight_updates():
    """One compiled engine (one compilation, ~50 s on 2 cores from a cold cache) covers both expert paths in the
    graph: layer 0 dense, layer 1 the grouped GEMM as one opaque op (the packed kernel's, where it builds); one graph
    for every bucket and table width."""
    from torch._dynamo.utils import counters

    model = init_model("gpt_oss", "tiny", overrides=TWO_LAYERS, dtype=torch.float32)
    cfg = {"max_num_seqs": 16, "max_model_len": 64}
    eager = LLMEngine(model, EngineConfig(**cfg), dtype=torch.float32)
    reference = eager.generate(_requests())
    assert not eager.compile_decode()  # compile_decode False: stays eager
    # "auto": eager (bit for bit the eager engine) until told to compile, timing its decode forwards meanwhile
    fast = LLMEngine(model, EngineConfig(**cfg, compile_decode="auto"), dtype=torch.float32)
    assert _compare(reference, fast.generate(_requests()), tol=1e-30) == 0 and fast.decode_seconds > 0
    assert fast.compiled is None and fast.compile_decode() and fast.compiled is not None
    assert model.moe_layer_ids == [0, 1] and model.layers[0].mlp.dense  # small experts: dense (GraphMoE's)
    grouped = model.layers[1].mlp.experts
    model.layers[1].mlp.dense = False  # before the first decode step compiles the graph
    # and on panels, as an fp32 CPU engine's larger experts are (the CPU backend's): the kernel as an op in the graph
    if kernel() is not None:
        grouped = kernel_module(grouped)
        replace_module(model, "layers.1.mlp.experts", grouped)
    packed = getattr(grouped, "has_panels", False)
    assert packed == (kernel() is not None and packs(grouped.down_proj.transpose(1, 2), False))
    graphs = counters["stats"]["unique_graphs"]
    _compare(reference, fast.generate(_requests()))
    assert counters["stats"]["unique_graphs"] - graphs == 1
    if packed:  # the graph reads the panels: spoiled (the weights unchanged), its generation differs
        panels = graph_panels(grouped, "down")
        kept = panels.clone()
        with torch.inference_mode():  # made in the engine's step
            panels.zero_()
        with pytest.raises(AssertionError):
            _compare(reference, fast.generate(_requests()))
        with torch.inference_mode():
            panels.copy_(kept)

    # new weights reach the graph (they are its inputs, not constants): one expert matrix and the head change
    updates = {
        name: p.detach() + 0.05 * torch.randn(p.shape)
        for name, p in model.named_parameters()
        if name.endswith(f"layers.{model.moe_layer_ids[0]}.mlp.experts.down_proj") or name == "lm_head.weight"
    }
    assert len(updates) == 2
    fast.update_weights(updates, version=1)  # the engines share ``model``: both now hold the new weights
    after = fast.generate(_requests())
    _compare(eager.generate(_requests()), after)
    # negative control: the stale weights' generation fails the same comparison
    with pytest.raises(AssertionError):
        _compare(reference, after)
    # told off (compile_decode: auto's trial found it no faster): the eager step again, bit for bit the eager engine
    assert fast.compile_decode(False) is False and fast.compiled is None
    assert _compare(eager.generate(_requests()), fast.generate(_requests()), tol=1e-30) == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_dense_experts_equal_the_grouped_path(arch):
    """The dense expert path (every expert on every token, gate zero off the chosen ones) against the grouped one,
    fp32, eager: within 1e-5 (biases and GPT-OSS's clamped SwiGLU included); negative control: a gate weight
    put on an expert the token did not choose moves the output by far more."""
    model = init_model(arch, "tiny", dtype=torch.float32)
    moe = model.layers[model.moe_layer_ids[0]].mlp
    with torch.no_grad():
        for p in moe.experts.parameters():
            if p.ndim == 2:  # biases are zero after init: give them values
                p.copy_(torch.randn(p.shape) * 0.1)
        x = torch.randn(40, model.config.hidden_size)
        weights, idx = moe.router(x)
        grouped = moe.experts._grouped(x, idx, weights)
        assert (moe.experts._dense(x, idx, weights) - grouped).abs().max() < 1e-5
        wrong = idx.clone()
        wrong[0, 0] = (idx[0, 0] + 1) % model.config.num_experts
        while wrong[0, 0] in idx[0]:
            wrong[0, 0] = (wrong[0, 0] + 1) % model.config.num_experts
        assert (moe.experts._dense(x, wrong, weights) - grouped).abs().max() > 1e-3


def test_buckets_pad_the_batch_to_few_sizes():
    sizes = {compiled_decode.bucket(n) for n in range(1, 129)}
    assert sizes == set(compiled_decode.BUCKETS)
    assert all(compiled_decode.bucket(n) >= max(n, 2) for n in range(1, 300))
    assert compiled_decode.bucket(129) == 192


def test_compile_decode_refusals(tmp_path):
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    with pytest.raises(ConfigError, match=r"EngineConfig.compile_decode='yes': allowed: True, False, 'auto'"):
        EngineConfig(compile_decode="yes")
    with pytest.raises(ConfigError, match=r"EngineConfig.compile_decode=1: allowed: True, False, 'auto'"):
        EngineConfig(compile_decode=1)  # not taken for True
    with pytest.raises(ConfigError, match=r"'rollout.compile_decode'='sometimes': allowed: auto, true, false"):
        load_config(RunConfig, None, ["rollout.compile_decode=sometimes"])
    assert load_config(RunConfig, None, []).rollout.compile_decode == "auto"  # the default
    assert load_config(RunConfig, None, ["rollout.engine=vllm"]).rollout.compile_decode == "auto"  # vLLM: its own
    assert EngineConfig(compile_decode=True, max_loras=1).max_loras == 1  # LoRA engines compile too
    over = ["rollout.compile_decode=true", "policy.mode=full"]
    assert load_config(RunConfig, None, over).rollout.compile_decode is True
    with pytest.raises(ConfigError, match=r"'rollout.compile_decode'=True: only with engine: native"):
        load_config(RunConfig, None, [*over, "rollout.engine=vllm"])
    assert load_config(RunConfig, None, [*over, "policy.mode=lora"]).rollout.compile_decode is True
    assert load_config(RunConfig, None, [*over, "policy.mode=mxfp8"]).rollout.compile_decode is True


def test_compiled_mxfp8_decode_matches_the_eager_mxfp8_engine(monkeypatch):
    """An MXFP8 engine (experts and projections quantize both operands, block 32, E8M0 / E4M3) decodes through the
    graph as eager: layer 0's experts on the dense path with MX operands, layer 1's as the grouped op; same tokens
    and routing, fp32 logprobs within 1e-3: an fp32 rounding difference before a cast to E4M3 can move a value by
    one E4M3 step (5.5e-5 measured; the plain operands of the test below miss by > 1e-3 on the experts alone).
    The graph takes the weights quantized outside it, kept between steps: after a sync it computes with the new
    ones, and skipping the step that re-quantizes them (negative control) leaves it on the old ones."""
    model = init_model("gpt_oss", "tiny", overrides=TWO_LAYERS, dtype=torch.float32)
    apply_mxfp8(model, "rceil", keep=True)  # an engine's
    cfg = {"max_num_seqs": 16, "max_model_len": 64}
    eager = LLMEngine(model, EngineConfig(**cfg), dtype=torch.float32)
    reference = eager.generate(_requests())
    fast = LLMEngine(model, EngineConfig(**cfg, compile_decode=True), dtype=torch.float32)
    assert model.layers[0].mlp.dense
    model.layers[1].mlp.dense = False
    _compare(reference, fast.generate(_requests()), tol=1e-3)

    # a sync of layer 0's down experts, which only the graph's dense path reads quantized along dim 2 (the eager
    # prefill re-quantizes what it reads itself)
    (name,) = [n for n, _ in model.named_parameters() if n.endswith("layers.0.mlp.experts.down_proj")]
    g = torch.Generator().manual_seed(5)
    new = model.get_parameter(name).detach() + 0.05 * torch.randn(model.get_parameter(name).shape, generator=g)
    fast.update_weights({name: new}, version=1)
    with monkeypatch.context() as m:
        m.setattr(compiled_decode, "refresh_kept", lambda *args: None)
        stale = fast.generate(_requests())
    after = fast.generate(_requests())
    expected = eager.generate(_requests())
    _compare(expected, after, tol=1e-3)
    with pytest.raises(AssertionError):
        _compare(expected, stale, tol=1e-3)


def test_the_mxfp8_dense_path_quantizes_as_the_grouped_one():
    """Eager: MXFP8 experts' dense path (every expert, MX operands) against their grouped GEMMs within 1e-5;
    negative control: the dense path with plain operands (the base class's) misses by far more."""
    model = init_model("qwen3_moe", "tiny", dtype=torch.float32)
    apply_mxfp8(model, "rceil")
    moe = model.layers[model.moe_layer_ids[0]].mlp
    with torch.no_grad():
        x = torch.randn(40, model.config.hidden_size)
        weights, idx = moe.router(x)
        grouped = moe.experts._grouped(x, idx, weights)
        assert (moe.experts._dense(x, idx, weights) - grouped).abs().max() < 1e-5
        moe.experts._operand = lambda t, dim: t  # the unquantized operands
        assert (moe.experts._dense(x, idx, weights) - grouped).abs().max() > 1e-3


LORA_LAYERS = {"num_hidden_layers": 2}  # one layer per expert path in the graph: half the compile of four


def _lora_engine_model(layout: str, overrides: dict = LORA_LAYERS):
    """The tiny Qwen3-MoE (two layers) with two random adapters (every projection and the experts) in slots 0, 1."""
    from moerl.model.lora import LoraConfig, attach_lora, lora_modules

    model = init_model("qwen3_moe", "tiny", overrides=overrides, dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=4, alpha=8, layout=layout, slots=2), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_the_paths_of_mixed_adapter_slots_equal_the_reference_loop(layout):
    """Eager, fp32: a mix of per-token slots (two adapters and none) on the experts' grouped path (rows grouped by
    (slot, expert), no host read) and on the dense path (every slot's deltas masked: what the compiled step runs),
    against the reference loop (per expert, per slot) within 1e-5; the linear layers' masked slots against the
    slot's own merged weight. Negative control: the slots shifted by one token miss by far more."""
    model = _lora_engine_model(layout)
    ctx = model.adapter_ctx
    slots = torch.tensor([0, 1, -1, 1, 0, -1, 0, 1, 1, 0])
    x = torch.randn(len(slots), model.config.hidden_size)
    moe = model.layers[model.moe_layer_ids[0]].mlp
    q = model.layers[0].self_attn.q_proj
    with torch.no_grad():
        weights, idx = moe.router(x)
        ctx.set(slots, len(slots), 1)
        merged = [q.weight + q.lora.delta_weight(s) for s in (0, 1)] + [q.weight]
        want_q = torch.stack([x[i] @ merged[s].T for i, s in enumerate(slots.tolist())])
        want = moe.experts._loop(x, idx, weights)
        for control in (False, True):
            ctx.set(slots.roll(1) if control else slots, len(slots), 1)
            for got in (moe.experts._grouped(x, idx, weights), moe.experts._dense(x, idx, weights)):
                worst = float((got - want).abs().max())
                assert (worst > 1e-3) if control else (worst < 1e-5), worst
            worst = float((q(x) - want_q).abs().max())
            assert (worst > 1e-3) if control else (worst < 1e-5), worst
        ctx.set(None, 1, 1)


@pytest.mark.parametrize("packed", [False, True])
def test_compiled_lora_decode_matches_the_eager_lora_engine(packed):
    """A LoRA engine (two adapters in slots, requests asking for either or none) decodes through one graph as eager,
    its adapted experts on the dense path in half the layers and as the grouped op, rows grouped by (slot, expert),
    in the others (``packed``: an engine's own CPU layout with experts the kernel streams, both layers' experts and
    their adapters' deltas in ``moe_decode``'s one op): same tokens and routing, fp32 logprobs within 1e-5; one
    graph for the buckets 16 down to 2 (the bucket of 16 rows once shared a symbol with the cache's 16-token blocks
    and was compiled again for 8); negative control: the compiled engine with the requests' adapters swapped
    (a <-> b) fails the same comparison."""
    from torch._dynamo.utils import counters

    from moerl.model.lora import slot_tensors

    overrides = LORA_LAYERS | ({"hidden_size": 256, "moe_intermediate_size": 384} if packed else {})
    donor = _lora_engine_model("per_expert", overrides)
    cfg = {"max_num_seqs": 16, "max_model_len": 64, "max_loras": 2, "max_lora_rank": 4}

    def requests(names=("a", "b", None)):
        return [Request(r.prompt, r.params, adapter=names[i % 3]) for i, r in enumerate(_requests())]

    outs = []
    for compiled in (False, True):  # each engine its own copy of the base (seeded: the same weights)
        model = init_model("qwen3_moe", "tiny", overrides=overrides, dtype=torch.float32)
        if packed:
            install(model)  # the CPU backend, as an engine that loads its own model installs it
        engine = LLMEngine(model, EngineConfig(**cfg, compile_decode=compiled), dtype=torch.float32)
        experts = [engine.model.layers[i].mlp.experts for i in engine.model.moe_layer_ids]
        assert all(getattr(e, "has_panels", False) == packed for e in experts)
        engine.add_adapter("a", slot_tensors(donor, 0))
        engine.add_adapter("b", slot_tensors(donor, 1))
        for i in engine.model.moe_layer_ids[1::2]:  # layer 1's adapted experts as the grouped op
            engine.model.layers[i].mlp.dense = False
        graphs = counters["stats"]["unique_graphs"]
        outs.append(engine.generate(requests()))
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert _compare(*outs) < 1e-5
    with pytest.raises(AssertionError):  # tokens, routing or logprobs differ with the other adapter
        _compare(outs[0], engine.generate(requests(("b", "a", None))))


def test_auto_keeps_a_bound_eager_step_and_true_compiles_it(tmp_path):
    """An engine whose decode steps run as bound kernel calls (``moerl.cpu.direct``, faster than its graph here):
    ``compile_decode: auto`` stays eager when told to compile; ``compile_decode: True`` compiles as asked. The control:
    the same engine without the bound step (``direct`` None) compiles under auto."""
    path = tmp_path / "tiny"
    init_model("qwen3_moe", "tiny", path, overrides={"num_hidden_layers": 2})
    cfg = {"max_num_seqs": 4, "max_model_len": 32}
    auto = LLMEngine(path, EngineConfig(**cfg, compile_decode="auto"), dtype=torch.float32)
    if not auto.direct.runs():
        pytest.skip(f"the bound step does not run here: {auto.direct.why}")
    assert not auto.compile_decode() and auto.compiled is None
    auto.direct = None
    assert auto.compile_decode() and auto.compiled is not None
    asked = LLMEngine(path, EngineConfig(**cfg, compile_decode=True), dtype=torch.float32)
    assert asked.compiled is not None


def test_compiling_pays_past_the_measured_break_even():
    """``compile_decode: auto`` compiles when the steps left save more than the compilation costs: at 0.12 of the
    decode time saved and 30 s to compile, 1 s of decoding a step pays from 250 steps left on, not at 249."""
    assert compiled_decode.pays(250, 1.0) and not compiled_decode.pays(249, 1.0)
    assert not compiled_decode.pays(10_000, 0.0)


def test_the_loop_compiles_the_decode_step_when_auto_finds_it_pays(warm_model, tmp_path, monkeypatch, capfd):
    """A run with rollout.compile_decode: auto (the compilation priced at 0 s here) reads the engine's decode
    seconds after its first three steps, tells it to compile, says so, and its rollouts then come from the compiled
    step (the step ran; the trainer's fp32 logprobs match them); timed over the next two steps, a compiled step
    slower than eager (slowed here) sends the engine back to eager. Priced as measured (30 s), the same run stays
    eager. Engines in processes answer the same commands: tests/test_process_engines.py."""
    from run_helpers import metric_rows, run_cfg

    from moerl.cpu.direct import DirectDecode
    from moerl.engine.compiled import CompiledDecode
    from moerl.loop import train

    steps, told = [], []
    step, compile_decode = CompiledDecode.step, LLMEngine.compile_decode
    monkeypatch.setattr(DirectDecode, "runs", lambda self: False)  # an engine auto would compile (see below)
    monkeypatch.setattr(CompiledDecode, "step", lambda self, *a: steps.append(time.sleep(0.05)) or step(self, *a))
    monkeypatch.setattr(LLMEngine, "compile_decode", lambda self, on=True: told.append(on) or compile_decode(self, on))
    train(run_cfg(tmp_path / "eager", warm_model, "full", steps=4, **{"rollout.max_tokens": 6}))
    assert "compiling the engine's decode step" not in capfd.readouterr().err and not steps and not told

    monkeypatch.setattr(compiled_decode, "COMPILE_SECONDS", 0.0)
    train(run_cfg(tmp_path / "run", warm_model, "full", steps=7, **{"rollout.max_tokens": 6}))
    said = capfd.readouterr().err
    assert "moerl: compiling the engine's decode step (rollout.compile_decode: auto; 3 steps left" in said
    assert steps and told == [True, False]
    assert re.search(r"the engine's decode step, compiled, decoded 0\.\d\dx as fast as eager: back to eager", said)
    # the step that compiles says so before and after, once: a long first compiled step is not taken for a hang
    assert (
        said.count("moerl: compiling the engine's decode step now, in the first call (rollout.compile_decode: auto)")
        == 1
    )
    assert len(re.findall(r"moerl: compiled the engine's decode step: the first call took \d+\.\d s", said)) == 1
    rows = [r for r in metric_rows(tmp_path / "run") if "loss" in r]
    assert len(rows) == 7 and all(r["mismatch_k3_r3"] < 1e-6 for r in rows)  # fp32: compiled within 1e-5 of eager

    # the first call's seconds are remembered (one graph); a run priced at them (0 s here, where 30 s kept the first
    # run eager) compiles, and says how it priced it
    took = float(re.search(r"the first call took (\d+\.\d) s", said).group(1))
    ((key, seconds),) = json.loads(dynamo.ledger_path().read_text()).items()
    assert abs(seconds - took) <= 0.06
    dynamo._remember(key, 0.0)
    monkeypatch.setattr(compiled_decode, "COMPILE_SECONDS", 30.0)
    train(run_cfg(tmp_path / "again", warm_model, "full", steps=5, **{"rollout.max_tokens": 6}))
    said = capfd.readouterr().err
    assert "each repay the 0.0 s it took when it last compiled here)" in said, said


def test_a_compiled_decode_step_faster_than_eager_is_kept(warm_model, tmp_path, monkeypatch, capfd):
    """The other side of the trial: eager decode steps slowed (in the eager step's own view of the cache, or in the
    bound step, inside the timed forward), the compiled step decodes faster and stays on for the rest of the run."""
    from run_helpers import run_cfg

    from moerl.cpu.direct import DirectDecode
    from moerl.engine.kv_cache import StepView
    from moerl.loop import train

    told = []
    init, compile_decode, bound = StepView.__init__, LLMEngine.compile_decode, DirectDecode.step

    def slow_eager(self, *args, graph=False, **kwargs):
        if not graph:  # the eager steps' views (prefill's too, which is not timed)
            time.sleep(0.05)
        init(self, *args, graph=graph, **kwargs)

    def slow_bound(self, *args):
        time.sleep(0.05)
        return bound(self, *args)

    monkeypatch.setattr(StepView, "__init__", slow_eager)
    monkeypatch.setattr(DirectDecode, "step", slow_bound)
    monkeypatch.setattr(DirectDecode, "runs", lambda self: False)  # an engine auto would compile (see below)
    monkeypatch.setattr(LLMEngine, "compile_decode", lambda self, on=True: told.append(on) or compile_decode(self, on))
    monkeypatch.setattr(compiled_decode, "COMPILE_SECONDS", 0.0)
    train(run_cfg(tmp_path / "run", warm_model, "full", steps=7, **{"rollout.max_tokens": 6}))
    said = capfd.readouterr().err
    assert re.search(r"the engine's decode step, compiled, decodes \d+\.\d\dx as fast as eager: kept", said), said
    assert told == [True]


def test_the_pools_the_compiled_step_writes_reach_the_graph_static():
    """cudagraph trees skip a graph whose mutated inputs are neither static nor recorded (so CUDA graphs would never
    run): the KV pools the step writes reach the graph marked static, as a backend that keeps the graph's inputs
    sees them. Negative control: the same engine's pools unmarked arrive unmarked."""
    seen = []

    def keep(gm, example_inputs):
        seen.extend(example_inputs)
        return gm.forward

    def pool_marks(mark: bool) -> list:
        seen.clear()
        model = init_model("qwen3_moe", "tiny", overrides={"num_hidden_layers": 2}, dtype=torch.float32)
        engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64, compile_decode=True))
        if not mark:
            for pool in engine.cache.pools():
                del pool._dynamo_static_input_type
        torch._dynamo.reset()
        engine.compiled._graph = torch.compile(engine.compiled._forward, dynamic=True, backend=keep)
        engine.generate(_requests(2))
        shape = engine.cache.pools()[0].shape
        pools = [t for t in seen if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape)]
        return [getattr(t, "_dynamo_static_input_type", None) for t in pools]

    assert pool_marks(True) == ["unguarded"] * 4  # 2 layers' keys and values
    assert pool_marks(False) == [None] * 4


def test_the_grouped_gemm_enters_a_cuda_graph_only_where_it_has_its_kernel(monkeypatch):
    """Experts too large for the dense path take the grouped op into the compiled step on CUDA in bf16 on sm90
    (its kernel reads no offsets on the host), and the dense path in fp32 or on an sm80 GPU (torch's per-group
    fallback reads them on the host, which no CUDA graph can capture)."""
    import simdevice
    from simdevice import SimCuda

    big = {"num_hidden_layers": 1, "moe_intermediate_size": 256}  # 1.6 MFLOP a token over every expert
    chosen = {}
    for dtype, capability in ((torch.bfloat16, (9, 0)), (torch.float32, (9, 0)), (torch.bfloat16, (8, 0))):
        monkeypatch.setattr(simdevice, "CAPABILITY", capability)
        with SimCuda():
            model = init_model("qwen3_moe", "tiny", overrides=big, dtype=dtype).to("cuda")
            engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64, compile_decode=True))
            chosen[(dtype, capability)] = engine.model.layers[0].mlp.dense
    assert chosen == {(torch.bfloat16, (9, 0)): False, (torch.float32, (9, 0)): True, (torch.bfloat16, (8, 0)): True}
    cpu = LLMEngine(init_model("qwen3_moe", "tiny", overrides=big), EngineConfig(max_model_len=64, compile_decode=True))
    assert not cpu.model.layers[0].mlp.dense  # the CPU's grouped GEMM has no such limit


def test_an_fp32_cpu_decode_graph_is_compiled_not_taken_from_inductors_disk_cache():
    """An fp32 CPU decode graph handed back by inductor's on-disk graph cache ran 0.6x the one it compiles (tiny,
    BENCHMARKS.md, issue 42's fourteenth session): compiled twice (dynamo reset between), the fp32 engine's step
    never hits that cache, where a bf16 engine's second compile does (the control: the counter sees hits)."""
    from torch._dynamo.utils import counters

    def cache_hits(dtype: torch.dtype) -> int:
        model = init_model("qwen3_moe", "tiny", overrides={"num_hidden_layers": 1}, dtype=dtype)
        counters.clear()
        for _ in range(2):
            torch._dynamo.reset()
            engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=32, compile_decode=True))
            engine.generate([Request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])
        return counters["inductor"]["fxgraph_cache_hit"]

    assert cache_hits(torch.float32) == 0
    assert cache_hits(torch.bfloat16) > 0


def _graph_count(engine) -> "torch._dynamo.testing.CompileCounter":
    """The compiled step's graph traced by a backend that counts what dynamo traces (and runs it eager)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    engine.compiled._graph = dynamo.unducked(torch.compile(engine.compiled._forward, dynamic=True, backend=counter))
    return counter


def _shrinking(n: int = 4) -> list[Request]:
    """Prompts of 10 tokens ending after 2, 3, 4 and 12 tokens: decode batches of 4, 3, 2 and 1 rows (padded to
    buckets 4 and 2, or not), block tables of 1 then 2 blocks."""
    return [
        Request(list(range(5, 15)), SamplingParams(max_tokens=(2, 3, 4, 12)[i], ignore_eos=True, seed=i))
        for i in range(n)
    ]


def test_inputs_that_alias_as_cudas_do_reach_one_graph(monkeypatch):
    """On CUDA a step's inputs arrive as views of one buffer (``moerl.device.to_device``); forced so on the CPU, the
    compiled step still traces one graph for 4, 3, 2 and 1 rows and tables of 1 and 2 blocks: it copies them into
    buffers of its own per padded shape, reused step after step. The control: the inputs passed on as the step did
    before (views where no row pads, new tensors where rows pad) trace the graph again."""
    from moerl.device import packed_copy
    from moerl.engine import engine as engine_module

    model = init_model("qwen3_moe", "tiny", overrides={"num_hidden_layers": 2}, dtype=torch.float32)
    monkeypatch.setattr(engine_module, "to_device", packed_copy)

    def as_they_came(ids, positions, tables, adapters):
        rows = compiled_decode.bucket(ids.shape[0]) - ids.shape[0]
        if rows:
            ids = torch.cat([ids, ids.new_zeros(rows, 1)])
            positions = torch.cat([positions, positions.new_zeros(rows, 1)])
            tables = torch.cat([tables, tables.new_full((rows, tables.shape[1]), engine.cache.scratch_block)])
        return [ids, positions, tables, adapters]

    graphs = {}
    for how in ("copied", "as they came"):
        engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64, compile_decode=True))
        if how == "as they came":
            engine.compiled._inputs = as_they_came
        counter = _graph_count(engine)
        seen, graph = [], engine.compiled._graph
        engine.compiled._graph = lambda *inputs, graph=graph: seen.append(tuple(map(id, inputs))) or graph(*inputs)
        engine.generate(_shrinking())
        graphs[how] = counter.frame_count
        if how == "copied":  # each padded shape's inputs the same tensors every step
            assert len(seen) > 10 and len(set(seen)) == len(engine.compiled._static) == 2, set(seen)
    assert graphs["copied"] == 1 and graphs["as they came"] > 1, graphs


def test_a_compiled_decode_step_waits_for_the_device_once(monkeypatch):
    """On the simulated device (torch.compile runs the step's code eager under it) a compiled decode step reads
    nothing on the host (its view of the cache is made with its write rows, no search for them), and the engine's
    step waits for the device once: tokens, logprobs, logit sums and R3 rows in one copy. The control: a view that
    searches for its write rows (the step before) reads the device inside every compiled step."""
    from simdevice import SimCuda

    def syncs(view=None) -> tuple[list[int], float]:
        with SimCuda() as sim:
            # bf16: CUDA's grouped GEMM has its kernel (fp32 falls back to a loop over offsets read on the host)
            model = init_model("qwen3_moe", "tiny", overrides={"num_hidden_layers": 2}, dtype=torch.bfloat16)
            cfg = EngineConfig(
                max_num_seqs=4, max_model_len=64, compile_decode=True, compile_scope="step", capture_routing=True
            )
            engine = LLMEngine(model.to("cuda"), cfg)
            if view is not None:
                monkeypatch.setattr(compiled_decode, "StepView", view)
            inside, step = [], engine.compiled.step

            def counted(*args):
                before = sum(sim.syncs.values())
                out = step(*args)
                inside.append(sum(sim.syncs.values()) - before)
                return out

            engine.compiled.step = counted
            engine.generate(_shrinking()[:2])  # warm: the first step
            sim.syncs.clear()
            steps = engine.steps
            engine.generate(_shrinking())
            return inside, sum(sim.syncs.values()) / (engine.steps - steps)

    inside, per_step = syncs()
    assert len(inside) > 10 and set(inside) == {0} and per_step == 1, (inside, per_step)

    class SearchingView(compiled_decode.StepView):
        def __init__(self, *args, write_rows=None, **kwargs):
            super().__init__(*args, **kwargs)

    inside, per_step = syncs(SearchingView)
    assert min(inside) >= 1 and per_step > 1, (inside, per_step)


def test_a_step_compiled_layer_by_layer_runs_one_graph_for_every_layer(monkeypatch):
    """``compile_scope="layer"`` (a deep model's, CUDA's): four MoE layers run one inductor graph, for every bucket and
    table width, with LoRA slots mixed per row; same tokens and routing as the eager engine, fp32 logprobs within
    1e-5. Negative control: a view that takes its layer's pools by the layer's number (what the whole-step graph
    does) makes a graph per layer."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from moerl.model.lora import slot_tensors

    four = {"num_hidden_layers": 4}
    donor = _lora_engine_model("shared_outer", four)
    cfg = {"max_num_seqs": 16, "max_model_len": 64, "max_loras": 2, "max_lora_rank": 4, "lora_layout": "shared_outer"}

    def engine(**more) -> LLMEngine:
        model = init_model("qwen3_moe", "tiny", overrides=four, dtype=torch.float32)
        made = LLMEngine(model, EngineConfig(**cfg, **more), dtype=torch.float32)
        made.add_adapter("a", slot_tensors(donor, 0))
        made.add_adapter("b", slot_tensors(donor, 1))
        return made

    def requests():
        return [Request(r.prompt, r.params, adapter=("a", "b", None)[i % 3]) for i, r in enumerate(_requests())]

    reference = engine().generate(requests())
    torch._dynamo.reset()  # the layer graph's code as no earlier test left it
    layered = engine(compile_decode=True, compile_scope="layer")
    assert layered.compiled.scope == "layer" and not isinstance(layered.compiled._graph, compiled_decode.StepGraphs)
    graphs = counters["stats"]["unique_graphs"]
    assert _compare(reference, layered.generate(requests())) < 1e-5
    assert counters["stats"]["unique_graphs"] - graphs == 1

    class ByNumber(compiled_decode.StepView):
        def __init__(self, *args, layer_pools=None, **kwargs):
            super().__init__(*args, **kwargs)

    for view, want in ((compiled_decode.StepView, 1), (ByNumber, 4)):
        monkeypatch.setattr(compiled_decode, "StepView", view)
        counted = engine(compile_decode=True, compile_scope="layer")
        counter = CompileCounter()
        torch._dynamo.reset()
        counted.compiled._layer_graph = torch.compile(counted.compiled._layer, dynamic=True, backend=counter)
        counted.generate(requests())
        assert counter.frame_count == want, (view, counter.frame_count)


def test_scopes_by_depth_and_device_and_the_scope_refusals():
    """``compile_scope="auto"``: the whole step up to STEP_GRAPH_MAX_LAYERS layers on the CPU, a layer graph past
    them and on CUDA; a model whose indexer layers share their choice takes the step (a layer graph is refused by
    name); an unknown scope is refused by name."""
    from types import SimpleNamespace

    from test_model_config import INDEXED

    from moerl.model.config import ModelConfig
    from moerl.presets import preset_config

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    shallow, deep = (
        SimpleNamespace(config=preset_config("qwen3_moe", "tiny", {"num_hidden_layers": n})[1]) for n in (2, 9)
    )
    assert compiled_decode.STEP_GRAPH_MAX_LAYERS == 8
    scope = compiled_decode.decode_scope
    assert (scope(shallow, cpu), scope(deep, cpu), scope(shallow, cuda)) == ("step", "layer", "layer")
    assert scope(deep, cpu, "step") == "step" and scope(shallow, cpu, "layer") == "layer"
    shared = SimpleNamespace(config=ModelConfig(**INDEXED, index_shared_layers=[1]))  # GLM-5's shared indexer
    assert scope(shared, cuda) == "step"
    with pytest.raises(ConfigError, match="compile_scope='layer' with index_shared_layers"):
        scope(shared, cpu, "layer")
    with pytest.raises(ConfigError, match="EngineConfig.compile_scope.*allowed: 'auto', 'step', 'layer'"):
        EngineConfig(compile_scope="model")


def test_on_cuda_the_layered_step_is_captured_once_a_shape_and_replays_without_a_sync(monkeypatch):
    """On the simulated device (its CUDA graphs record a capture's ops and replay them on the same tensors;
    torch.compile runs eager under it), bf16 with R3 and mixed LoRA slots: the step is captured once per padded
    shape, replays with no host sync inside (one a step, the engine's copy back), gives what the whole-step engine
    gives bit for bit, and follows a weight update. Negative control: a view that searches for its write rows (a
    host sync) cannot be captured: the simulated CUDA refuses it, as CUDA refuses a sync while capturing."""
    from simdevice import CaptureError, SimCuda

    from moerl.model.lora import slot_tensors

    donor = _lora_engine_model("per_expert")
    cfg = {"max_num_seqs": 4, "max_model_len": 64, "compile_decode": True, "max_loras": 2, "max_lora_rank": 4}

    def requests():
        return [Request(r.prompt, r.params, adapter=("a", "b", None)[i % 3]) for i, r in enumerate(_shrinking())]

    with SimCuda() as sim:

        def engine(scope: str) -> LLMEngine:
            model = init_model("qwen3_moe", "tiny", overrides=LORA_LAYERS, dtype=torch.bfloat16).to("cuda")
            made = LLMEngine(model, EngineConfig(**cfg, compile_scope=scope))
            for slot, name in enumerate("ab"):
                made.add_adapter(name, {k: v.to(torch.bfloat16) for k, v in slot_tensors(donor, slot).items()})
            return made

        whole, layered = engine("step"), engine("auto")
        graphs = layered.compiled._graph
        assert layered.compiled.scope == "layer" and isinstance(graphs, compiled_decode.StepGraphs)
        inside, step = [], graphs.step

        def counted(*args):
            before = sum(sim.syncs.values())
            out = step(*args)
            inside.append(sum(sim.syncs.values()) - before)
            return out

        graphs.step = counted
        assert _compare(whole.generate(requests()), layered.generate(requests()), tol=1e-30) == 0
        assert graphs.captures == len(layered.compiled._static) == 2 and set(inside) == {0}
        sim.syncs.clear()
        steps = layered.steps
        layered.generate(requests())  # replays only
        assert graphs.captures == 2 and sum(sim.syncs.values()) == layered.steps - steps
        g = torch.Generator().manual_seed(5)
        update = {
            n: torch.randn(p.shape, generator=g).to(p.dtype) * 0.02
            for n, p in whole.model.named_parameters()
            if n.endswith("q_proj.weight")
        }
        for made in (whole, layered):
            made.update_weights(update, version=1)
        assert _compare(whole.generate(requests()), layered.generate(requests()), tol=1e-30) == 0

        class SearchingView(compiled_decode.StepView):
            def __init__(self, *args, write_rows=None, **kwargs):
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(compiled_decode, "StepView", SearchingView)
        with pytest.raises(CaptureError, match="nonzero.*while capturing a CUDA graph"):
            engine("layer").generate(requests())
