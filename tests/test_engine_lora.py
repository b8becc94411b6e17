"""Multi-adapter LoRA in the engine: in-memory and PEFT adapters, both expert layouts, fused vs naive."""

import json

import pytest
import torch
from hf_models import build_hf_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from moerl.bridges import load_model
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.errors import CheckpointError, ConfigError, RequestError
from moerl.model.lora import LoraConfig, attach_lora, lora_modules, merged_state_dict, slot_tensors

ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 7, 8]]


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts")


def _trained_adapter(path, layout, rank, seed, targets=TARGETS):
    """A model with one random (trained-looking) adapter: its moerl tensors and its merged-weight twin."""
    model = load_model(path, dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=rank, alpha=2 * rank, layout=layout, targets=list(targets)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    merged = load_model(path, dtype=torch.float32)
    merged.load_state_dict(merged_state_dict(model))
    return slot_tensors(model), merged


def _logprob_k3(model, out) -> float:
    prompt, c = out.prompt_token_ids, out.outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    d = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1) - c.logprobs
    return (d.exp() - 1 - d).mean().item()


# k3 of an engine's logprobs against its fp32 merged model: fp32 measured 0 .. 1e-8; bf16 (the adapters in bf16
# too) measured <= 1e-5, against >= 9e-3 for the base model where an adapter was asked for (the negative control)
K3 = {"float32": 1e-6, "bfloat16": 1e-3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("engine_layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("fused", [True, False])
def test_several_adapters_in_one_batch_equal_their_merged_models(engine_layout, fused, dtype, hf_checkpoints):
    """Requests with either adapter or none in one batch: each equals its fp32 merged model within the dtype's
    tolerance, and the adapter's effect is beyond it. In bf16 the fp32 scale buffers used to promote the mixed
    batch's rows to fp32 and fail the grouped GEMM."""
    path = hf_checkpoints[ARCH][0]
    shared, merged_shared = _trained_adapter(path, "shared_outer", rank=4, seed=1)
    adapters = {"s": (shared, merged_shared)}
    if engine_layout == "per_expert":
        adapters["p"] = _trained_adapter(path, "per_expert", rank=8, seed=2)
    engine = LLMEngine(
        path,
        EngineConfig(
            max_num_seqs=8, max_model_len=48, max_loras=3, max_lora_rank=8, lora_layout=engine_layout, fused_lora=fused
        ),
        dtype=getattr(torch, dtype),
    )
    for name, (tensors, _) in adapters.items():
        engine.add_adapter(name, tensors)
    names = [*adapters, None]
    requests = [
        Request(p, SamplingParams(temperature=1.0, max_tokens=10, seed=i), adapter=names[i % len(names)])
        for i, p in enumerate(PROMPTS * 2)
    ]
    base = load_model(path, dtype=torch.float32)
    for req, out in zip(requests, engine.generate(requests), strict=True):
        oracle = base if req.adapter is None else adapters[req.adapter][1]
        assert _logprob_k3(oracle, out) <= K3[dtype], f"adapter {req.adapter}"
        if req.adapter is not None:
            assert _logprob_k3(base, out) > K3[dtype], "the adapter's effect is beyond the tolerance"


def test_fused_and_naive_engine_paths_agree(hf_checkpoints):
    path = hf_checkpoints[ARCH][0]
    tensors, _ = _trained_adapter(path, "per_expert", rank=4, seed=3)
    outs = []
    for fused in (True, False):
        engine = LLMEngine(
            path,
            EngineConfig(max_num_seqs=4, max_model_len=48, max_loras=1, max_lora_rank=4, fused_lora=fused),
            dtype=torch.float32,
        )
        engine.add_adapter("a", tensors)
        outs.append(
            engine.generate([Request(p, SamplingParams(temperature=0, max_tokens=8), adapter="a") for p in PROMPTS])
        )
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.outputs[0].logprobs - b.outputs[0].logprobs).abs().max() <= 1e-5


def _peft_model(arch, tmp_path, seed=0):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    hf = build_hf_model(arch)
    hf.save_pretrained(tmp_path / "base")
    cfg = PeftLoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(hf, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    return peft_model.eval()


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_peft_adapter_directory_reproduces_peft(arch, tmp_path):
    peft_model = _peft_model(arch, tmp_path)
    engine = LLMEngine(
        tmp_path / "base",
        EngineConfig(max_num_seqs=4, max_model_len=48, max_loras=1, max_lora_rank=8),
        dtype=torch.float32,
    )
    engine.add_adapter("peft", tmp_path / "adapter")
    outs = engine.generate(
        [Request(p, SamplingParams(temperature=0.7, max_tokens=8, seed=0), adapter="peft") for p in PROMPTS]
    )
    for out in outs:
        prompt, c = out.prompt_token_ids, out.outputs[0]
        with torch.no_grad():
            logits = peft_model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        d = (logits / 0.7).log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1) - c.logprobs
        assert (d.exp() - 1 - d).mean().item() <= 1e-6


def test_per_expert_linear_peft_layout_matches_merged_transformers(tmp_path):
    """The pre-v5 PEFT layout (experts.{e}.gate_proj / up_proj / down_proj as linear layers), checked against
    transformers running weights merged by hand."""
    hf = build_hf_model(ARCH)
    hf.save_pretrained(tmp_path / "base")
    cfg = hf.config
    e, h, i, r, alpha = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, 2, 4.0
    gen = torch.Generator().manual_seed(0)
    tensors, merged = {}, {k: v.clone() for k, v in hf.state_dict().items()}
    for layer in (0, 2):  # the MoE layers of the test config (layer 1 is dense)
        for x in range(e):
            for proj, d_in, d_out in (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)):
                a, b = torch.randn(r, d_in, generator=gen) * 0.3, torch.randn(d_out, r, generator=gen) * 0.3
                prefix = f"base_model.model.model.layers.{layer}.mlp.experts.{x}.{proj}"
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
                delta = alpha / r * b @ a
                if proj == "down_proj":
                    merged[f"model.layers.{layer}.mlp.experts.down_proj"][x] += delta
                else:
                    rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
                    merged[f"model.layers.{layer}.mlp.experts.gate_up_proj"][x, rows] += delta
    (tmp_path / "adapter").mkdir()
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors")
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha})
    )
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    oracle.load_state_dict(merged)
    engine = LLMEngine(
        tmp_path / "base",
        EngineConfig(max_num_seqs=2, max_model_len=48, max_loras=1, max_lora_rank=4),
        dtype=torch.float32,
    )
    engine.add_adapter("old", tmp_path / "adapter")
    out = engine.generate([Request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8), adapter="old")])[0]
    assert _logprob_k3(oracle, out) <= 1e-6


def test_adapter_errors(hf_checkpoints):
    path = hf_checkpoints[ARCH][0]
    tensors, _ = _trained_adapter(path, "per_expert", rank=4, seed=4)
    engine = LLMEngine(path, EngineConfig(max_num_seqs=2, max_model_len=32, max_loras=1, max_lora_rank=4))
    with pytest.raises(RequestError, match=r"request 0: unknown adapter 'nope'; loaded adapters: none"):
        engine.generate([Request([5, 6], adapter="nope")])
    bad = dict(tensors)
    bad["layers.0.self_attn.q_proj.lora_A"] = torch.zeros(4, 32)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'layers\.0\.self_attn\.q_proj\.lora_A' has shape \(4, 32\), "
        r"this model needs \('r', 64\)",
    ):
        engine.add_adapter("bad", bad)
    wide = dict(tensors)
    wide["layers.0.self_attn.q_proj.lora_A"] = torch.zeros(6, 64)
    with pytest.raises(CheckpointError, match=r"has rank 6 > EngineConfig.max_lora_rank=4"):
        engine.add_adapter("wide", wide)
    stray = dict(tensors)
    stray["layers.0.mlp.router.lora_A"] = torch.zeros(4, 64)
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.0\.mlp\.router\.lora_A' targets no adapted module"):
        engine.add_adapter("stray", stray)
    engine.add_adapter("ok", tensors)
    with pytest.raises(ConfigError, match=r"adapter 'second': all 1 adapter slots are in use \(ok\)"):
        engine.add_adapter("second", tensors)
    shared_engine = LLMEngine(
        path, EngineConfig(max_num_seqs=2, max_model_len=32, max_loras=1, max_lora_rank=4, lora_layout="shared_outer")
    )
    with pytest.raises(CheckpointError, match=r"has a factor per expert .* this engine's slots are shared_outer"):
        shared_engine.add_adapter("per_expert", tensors)
    with pytest.raises(CheckpointError, match=r"adapter_config\.json does not exist"):
        engine.add_adapter("missing", path)
