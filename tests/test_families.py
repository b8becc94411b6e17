"""The families added by bridge files alone (Ernie-4.5-MoE, HunYuan-MoE-V1, DeepSeek-V2, GraniteMoe, FlexOlmo,
PhiMoE, DBRX, LongCat-Flash), each a tiny real-shaped config with its features on: fp32 logits within 1e-4 of
transformers with the same router choices, and a negative control per family (its new knob turned off misses the
tolerance); export round-trips into transformers; the engine's logprobs and routing equal a full forward; replay
reproduces the logits and other indices change them."""

import pytest
import torch
from hf_models import HYBRID_ARCHS, NEW_ARCHS, VOCAB, hf_router_choices, save_hf_model
from test_engine import engine_vs_full_forward
from transformers import AutoModelForCausalLM

from moerl.bridges import export_model, load_model, supported
from moerl.engine import EngineConfig, LLMEngine
from moerl.errors import ConfigError
from moerl.rollout import make_engine

FP32_TOL = 1e-4


def _off(arch: str, model) -> None:
    """Turn the family's new knob off, in place (the negative control)."""
    layers = list(model.layers)
    if arch == "Ernie4_5_MoeForCausalLM":  # rotate-half instead of interleaved pairs
        for layer in layers:
            layer.self_attn.interleave = False
    elif arch == "HunYuanMoEV1ForCausalLM":  # q/k norms before the rotation
        for layer in layers:
            layer.self_attn.qk_norm_after_rope = False
    elif arch == "DeepseekV2ForCausalLM":  # groups scored by their top-2 sum (V3) instead of their best expert
        for i in model.moe_layer_ids:
            layers[i].mlp.router.group_score = "top2_sum"
    elif arch == "GraniteMoeForCausalLM":
        model.config.logits_scaling = 1.0
    elif arch == "FlexOlmoForCausalLM":  # the post-feed-forward norm left out
        for layer in layers:
            layer.post_feedforward_layernorm = torch.nn.Identity()
    elif arch == "PhimoeForCausalLM":  # sparsemixer without its mask
        for i in model.moe_layer_ids:
            layers[i].mlp.router.sparsemixer_eps = 1e9
    elif arch == "DbrxForCausalLM":  # the top-k weights not renormalised
        for i in model.moe_layer_ids:
            layers[i].mlp.router.norm_topk_prob = False
    elif arch == "JetMoeForCausalLM":  # the query heads paired with key heads in the order GQA groups them
        for layer in layers:
            layer.self_attn.forward = _slot_major(layer.self_attn)
    elif arch == "LongcatFlashForCausalLM":  # the kv latent unscaled (mla_lora_scale)
        for layer in layers:
            layer.self_attn.latent_scale = None
    else:
        raise AssertionError(arch)


def _slot_major(moa):
    """JetMoE's negative control: ``moa``'s forward with its query heads taken slot-major (slot j's head h as head
    j * kv_heads + h, which GQA would pair with key head (j * kv_heads + h) // k), not transformers' repeat."""
    from moerl.model.moa import MixtureOfAttention

    def attend_swapped(q, k, v, mask, scale, sinks):
        b, hq, t, d = q.shape
        q = q.view(b, moa.num_kv_heads, moa.top_k, t, d).transpose(1, 2).reshape(b, hq, t, d)
        return core(q, k, v, mask, scale, sinks)

    core = moa.core
    moa.core = attend_swapped
    return MixtureOfAttention.forward.__get__(moa)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: (root / arch, save_hf_model(arch, root / arch)) for arch in NEW_ARCHS}


def _ids(b=2, t=24, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_new_family_matches_transformers_and_round_trips(arch, checkpoints, tmp_path):
    assert arch in supported()
    path, hf = checkpoints[arch]
    model = load_model(path, dtype=torch.float32)
    ids = _ids()
    ref, ref_choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        out = model(ids, capture=True)
    assert (out.logits - ref).abs().max() <= FP32_TOL
    assert len(ref_choices) == len(model.route_columns) > 0  # JetMoE: its attention's router beside its MoE's
    for layer, choice in enumerate(ref_choices):
        ours = out.routed[:, :, layer].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values), f"MoE layer {layer} chose other experts"

    export_model(model, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(ids).logits - ref).abs().max() <= FP32_TOL

    _off(arch, model)
    with torch.no_grad():
        off = model(ids, capture=True)
    moved = (off.logits - ref).abs().max() > FP32_TOL
    assert moved or not torch.equal(off.routed, out.routed), "the negative control matched transformers"


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_new_family_engine_and_replay(arch, checkpoints):
    path, _ = checkpoints[arch]
    engine = LLMEngine(
        path, EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8), torch.float32
    )
    kl, routed_ok = engine_vs_full_forward(engine)
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)

    model, ids = engine.model, _ids()
    with torch.no_grad():
        own = model(ids, capture=True)
        replayed = model(ids, replay=own.routed)
        assert torch.equal(replayed.logits, own.logits)
        shifted = (own.routed + 1) % model.config.num_experts
        other = model(ids, replay=shifted)
        assert torch.equal(other.routed, shifted)
        # the same replay gives the same bits, so any difference is the replay's (HunYuan: 2e-4, its shared MLP
        # carries most of the output at this init)
        assert (other.logits - own.logits).abs().max() > 1e-5


def test_vllm_engines_refuse_families_without_an_fp32_router_model(checkpoints):
    """vLLM's own class for these would route with bf16 gates: refused by name before vLLM starts."""
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm with Ernie4_5_MoeForCausalLM: .*fp32-router"):
        make_engine("vllm", checkpoints["Ernie4_5_MoeForCausalLM"][0], EngineConfig())


def test_archs_lists_every_family_and_its_engines(capsys):
    from moerl.cli import main

    assert main(["archs"]) in (None, 0)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    derived_in_vllm = {"LagunaForCausalLM", "Cohere2MoeForCausalLM", "Llama4ForCausalLM", "Gemma4ForCausalLM"}
    assert set(lines) == set(supported()) | derived_in_vllm
    for arch in ["Ernie4_5_MoeForCausalLM", "JetMoeForCausalLM", *HYBRID_ARCHS]:
        assert lines[arch].endswith("native engine only")
    for arch in ["Qwen3MoeForCausalLM", "DbrxForCausalLM", *derived_in_vllm]:
        assert lines[arch].endswith("full (also vLLM)"), lines[arch]
    assert lines["LongcatFlashForCausalLM"].endswith("full (also vLLM on a GPU build)")
    assert all(lines[a].split()[1] == "(derived)" for a in derived_in_vllm)


def test_the_router_helper_fails_saying_it_found_none():
    """A model without a *Router / *Gate module (a dense Llama) cannot have its router choices recorded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=VOCAB))  # fmt: skip
    with pytest.raises(Exception, match=r"no router found in LlamaForCausalLM"):
        hf_router_choices(dense, _ids())


@pytest.mark.parametrize("arch", [a for a in NEW_ARCHS if a not in ("DbrxForCausalLM", "JetMoeForCausalLM")])
def test_new_family_peft_export_reproduces_moerl_in_peft(arch, checkpoints, tmp_path):
    """Adapters on o_proj and the experts, written for PEFT (GraniteMoe's experts live under block_sparse_moe in
    transformers): peft on the transformers model gives moerl's logits (fp32 1e-4), far from the base model's."""
    from test_export import peft_logits

    from moerl.bridges.peft import read_peft_adapter

    path, _ = checkpoints[arch]
    pol, ours, theirs, plain = peft_logits(path, ["o_proj", "experts"], tmp_path / "adapter")
    assert (ours - theirs).abs().max() <= 1e-4
    assert (ours - plain).abs().max() > 1e-3
    again = read_peft_adapter(tmp_path / "adapter", pol.model)
    lora = pol.model.layers[pol.model.moe_layer_ids[0]].mlp.experts.lora
    i = pol.model.moe_layer_ids[0]
    assert torch.allclose(again[f"layers.{i}.mlp.experts.gate_up_B"], lora.gate_up_B[0] * lora.scale[0], atol=1e-6)


def test_dbrx_peft_export_takes_attention_adapters_and_refuses_expert_ones(checkpoints, tmp_path):
    """DBRX's experts are three matrices flattened over the experts: PEFT would put one adapter on each whole
    matrix, not one per expert, so moerl's expert adapters are refused by name; its attention's (out_proj) export and
    reproduce moerl's logits in peft (fp32 1e-4)."""
    from test_export import peft_logits

    from moerl.errors import CheckpointError

    path, _ = checkpoints["DbrxForCausalLM"]
    _, ours, theirs, plain = peft_logits(path, ["o_proj"], tmp_path / "adapter")
    assert (ours - theirs).abs().max() <= 1e-4 and (ours - plain).abs().max() > 1e-3
    with pytest.raises(CheckpointError, match=r"LoRA adapter on 'transformer\.blocks\.\{i\}\.ffn\.experts\.mlp\.w1'"):
        peft_logits(path, ["experts"], tmp_path / "experts")


def test_jetmoe_peft_export_refuses_its_experts_and_fused_keys_by_name(checkpoints, tmp_path):
    """JetMoE's MoE experts are a module per projection in transformers (PEFT's target_parameters cannot address
    them) and its keys and values one fused ``kv_proj``: both adapters are refused by name, nothing written."""
    from test_export import peft_logits

    from moerl.errors import CheckpointError

    path, _ = checkpoints["JetMoeForCausalLM"]
    with pytest.raises(CheckpointError, match=r"JetMoeForCausalLM's experts in transformers are a module per"):
        peft_logits(path, ["experts"], tmp_path / "experts")
    with pytest.raises(CheckpointError, match=r"stores that projection fused"):
        peft_logits(path, ["k_proj"], tmp_path / "keys")
    assert not (tmp_path / "experts").exists() and not (tmp_path / "keys").exists()
