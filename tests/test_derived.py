"""Zero-code Day-0: with a family's bridge file switched off, the bridge moerl derives from the config and proves
against transformers loads the checkpoint to the hand-written bridge's logits; families whose features the
decoder lacks are refused by name (config fields, tensors) or by the proof (the first layer that differs).
``moerl check-arch`` prints the derived bridge as a file that loads the checkpoint once registered."""

import json

import pytest
import torch
from hf_models import DERIVED_ARCHS, VOCAB, build_hf_model, hf_router_choices

from moerl.bridges import load_model
from moerl.bridges import prove as derived
from moerl.bridges import registry as bridge_registry
from moerl.errors import UnknownArchitectureError

DERIVABLE = [
    "Qwen3MoeForCausalLM",  # per-head q/k norms, per-expert tensors
    "Qwen2MoeForCausalLM",  # shared expert with its sigmoid gate, qkv biases, sliding-window switch off
    "MixtralForCausalLM",  # block_sparse_moe, w1 / w3 / w2 experts, softmax over the top-k logits
    "OlmoeForCausalLM",  # q/k norms over the whole projection, clip_qkv
    "FlexOlmoForCausalLM",  # post-sublayer norms
    "HunYuanMoEV1ForCausalLM",  # gate.wg router, shared_mlp, query_layernorm after the rotation
    "GraniteMoeForCausalLM",  # muP multipliers, input_linear / output_linear experts
    "DeepseekV3ForCausalLM",  # latent attention, sigmoid routing with a selection bias, expert groups, scaling
]


@pytest.fixture
def without_bridge(monkeypatch):
    """Switch a family's bridge file off for one test (and forget derived bridges proven before)."""
    derived._proven.cache_clear()

    def off(arch: str):
        monkeypatch.delitem(bridge_registry.FAMILIES, arch)
        monkeypatch.delitem(bridge_registry._BRIDGES, arch, raising=False)

    yield off
    derived._proven.cache_clear()


def _ids():
    return torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", DERIVABLE)
def test_derived_bridge_reproduces_the_hand_written_one(arch, without_bridge, tmp_path):
    hf = build_hf_model(arch)
    hf.save_pretrained(tmp_path)
    ids = _ids()
    ref, choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        written = load_model(tmp_path, torch.float32)(ids).logits
        without_bridge(arch)
        model = load_model(tmp_path, torch.float32)
        out = model(ids, capture=True)
    assert arch not in bridge_registry._BRIDGES  # loaded through the derived bridge
    assert (out.logits - written).abs().max() <= 1e-5
    assert (out.logits - ref).abs().max() <= 1e-4
    for j, choice in enumerate(choices):
        ours = out.routed[:, :, j].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values)


def test_unknown_config_fields_and_tensors_are_refused_by_name(without_bridge, tmp_path):
    granite = json.loads(build_hf_model("GraniteMoeForCausalLM").config.to_json_string())
    without_bridge("GraniteMoeForCausalLM")
    with pytest.raises(UnknownArchitectureError, match=r"'attention_logit_cap', 'router_temperature' are not under"):
        derived.prove(granite | {"attention_logit_cap": 30.0, "router_temperature": 0.5})
    # a hybrid linear-attention family (derived since issue 26: tests/test_hybrid.py) with a field nobody reads
    from transformers import AutoConfig

    hybrid = AutoConfig.for_model("qwen3_next").to_dict() | {"architectures": ["Qwen3NextForCausalLM"]}
    with pytest.raises(UnknownArchitectureError, match=r"for Qwen3NextForCausalLM: config field\(s\) 'linear_chunk'"):
        derived.prove(hybrid | {"linear_chunk": 64})
    # a name that contradicts the model_type
    qwen = json.loads(build_hf_model("Qwen3MoeForCausalLM").config.to_json_string())
    with pytest.raises(UnknownArchitectureError, match=r"model_type 'qwen3_moe' builds Qwen3MoeForCausalLM"):
        derived.prove(qwen | {"architectures": ["LlamaForCausalLM"]})


def test_the_proof_refuses_what_names_cannot_tell(without_bridge):
    """PhiMoE's sparsemixer routing looks like a softmax router by its names: no variant matches transformers."""
    phimoe = json.loads(build_hf_model("PhimoeForCausalLM").config.to_json_string())
    without_bridge("PhimoeForCausalLM")
    with pytest.raises(UnknownArchitectureError, match=r"no variant matches transformers .*first difference: layer 0"):
        derived.prove(phimoe)


def test_check_arch_prints_a_bridge_file_that_loads_the_checkpoint(without_bridge, tmp_path, capsys, monkeypatch):
    from moerl.cli import main

    arch = "MixtralForCausalLM"
    hf = build_hf_model(arch)
    hf.save_pretrained(tmp_path / "ckpt")
    without_bridge(arch)
    assert main(["check-arch", str(tmp_path / "ckpt")]) in (None, 0)
    source = capsys.readouterr().out
    assert "topk_before_softmax': True" in source and "BRIDGE = derive(" in source
    (tmp_path / "families").mkdir()
    (tmp_path / "families" / "__init__.py").write_text("")
    (tmp_path / "families" / "mixtral_derived.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))  # the file and its line in the table, as for a bridge file
    monkeypatch.setitem(bridge_registry.FAMILIES, arch, "families.mixtral_derived")
    assert bridge_registry.bridge_file(arch) is not None
    ids = _ids()
    with torch.no_grad():
        assert (load_model(tmp_path / "ckpt", torch.float32)(ids).logits - hf(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("case", ["tensor shape", "config size"])
def test_check_arch_refuses_a_checkpoint_its_config_does_not_describe(case, without_bridge, tmp_path, capsys):
    """Names are not enough: a tensor of the wrong shape, or a config whose sizes the tensors do not have (a
    10^9-wide hidden size), fails by name from the headers, with nothing allocated."""
    from safetensors.torch import load_file, save_file

    from moerl.cli import main

    arch = "MixtralForCausalLM"
    build_hf_model(arch).save_pretrained(tmp_path / "ckpt")
    without_bridge(arch)
    weights, config = tmp_path / "ckpt" / "model.safetensors", tmp_path / "ckpt" / "config.json"
    if case == "tensor shape":
        tensors = load_file(weights)
        name = next(n for n in tensors if n.startswith("model.layers.1.") and n.endswith("gate.weight"))
        tensors[name] = tensors[name][:, :-1].clone()
        save_file(tensors, weights, metadata={"format": "pt"})
    else:
        config.write_text(json.dumps(json.loads(config.read_text()) | {"hidden_size": 10**9}))
    assert main(["check-arch", str(tmp_path / "ckpt")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "moerl: error: tensor '" in out.err
    assert ("gate.weight' in model.safetensors has shape" if case == "tensor shape" else "1000000000") in out.err


BAD_VALUES = [
    ("hidden_size", "abc"), ("num_hidden_layers", None), ("num_experts_per_tok", -3), ("rms_norm_eps", 0),
    ("tie_word_embeddings", "yes"), ("sliding_window", 0), ("mlp_only_layers", 1.5), ("num_key_value_heads", 0),
    ("vocab_size", [1, 2]), ("max_position_embeddings", {"a": 1}), ("mlp_layer_types", ["dense", "moe"]),
    ("n_group", 0), ("routed_scaling_factor", -1.0),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_check_arch_names_a_config_value_of_the_wrong_type_or_range(field, value, without_bridge, tmp_path, capsys):
    """Strings, nulls, negatives, lists where sizes go: one line naming the field (``moerl: error: ...``), rc 2,
    whether moerl's check or transformers' own finds it."""
    from moerl.cli import main

    arch = "Qwen3MoeForCausalLM"
    build_hf_model(arch).save_pretrained(tmp_path / "ckpt")
    without_bridge(arch)
    config = tmp_path / "ckpt" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {field: value}))
    assert main(["check-arch", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moerl: error: ") and field in err, err


# the knob each 2026 family needs, set wrong on the loaded model: the tolerance must catch it
KNOBS = {
    "Glm4MoeForCausalLM": ("rope_dim", None),  # partial RoPE -> every dim rotates
    "Glm4MoeLiteForCausalLM": ("rope_interleave", False),  # latent attention's rotary pairs
    "MiniMaxM2ForCausalLM": ("rope_dim", None),  # the partial RoPE spelled rotary_dim -> every dim rotates
    "GraniteMoeSharedForCausalLM": ("embedding_multiplier", 1.0),  # muP
    "ExaoneMoeForCausalLM": ("nope_layers", []),  # the full-attention layer rotates after all
    "HYV3ForCausalLM": ("norm_topk_prob", False),  # the renormalisation no field announces
    "SolarOpenForCausalLM": ("routed_scaling_factor", 1.0),
    "GraniteMoeSWAForCausalLM": ("nope_layers", []),  # layer_rope_theta 0: that layer rotates nothing
    "DeepseekV32ForCausalLM": ("index_rope_interleave", True),  # the indexer's rotary pairs
    "GlmMoeDsaForCausalLM": ("index_rope_interleave", False),
    "GraniteMoeHybridForCausalLM": ("mamba_norm_groups", 2),  # the gated norm over all channels, not per B / C group
    "JambaForCausalLM": ("nope_layers", []),  # its attention rotates nothing, and no field says so
    "NemotronHForCausalLM": ("nope_layers", []),  # nor does Nemotron-H's
    "LagunaForCausalLM": ("router_softcap", 0.0),  # its other knobs: tests/test_laguna.py
    "AfmoeForCausalLM": ("attn_gate_act", "softplus"),  # its norms: tests/test_laguna.py
    "AXK1ForCausalLM": ("routed_scaling_factor", 1.0),
    "Cohere2MoeForCausalLM": ("shared_combine", "sum"),  # its other knobs: tests/test_norm_placements.py
    "MiMoV2FlashForCausalLM": ("attn_value_scale", 1.0),  # its other knobs: tests/test_mimo_v2_flash.py
    "Llama4ForCausalLM": ("router_weight_on_input", False),  # its other knobs: tests/test_llama4.py
    "Gemma4ForCausalLM": ("v_norm", False),  # its other knobs: tests/test_gemma4.py
}


@pytest.mark.parametrize("arch", DERIVED_ARCHS)
def test_families_of_2026_load_with_no_bridge_file(arch, tmp_path):
    """Families published this year built only of knobs moerl computes, under their own field and tensor names
    (DeepSeek-V3 routing, latent attention, muP with a shared MLP, a selection bias kept as a buffer, full q/k
    norms with partial RoPE, sliding layers beside full ones without RoPE): loaded with no bridge file at fp32
    1e-4 of transformers with the same experts chosen; the knob set wrong, or the selection bias zeroed, misses."""
    import dataclasses

    from moerl.model.transformer import MoEModel

    assert arch not in bridge_registry.supported()
    hf = build_hf_model(arch)
    with torch.no_grad():  # sharper attention than the 0.02 init gives, so that where RoPE goes shows
        for name, p in hf.named_parameters():
            if name.endswith(derived.SHARP):
                p.mul_(8)
    hf.save_pretrained(tmp_path)
    ids = _ids()
    ref, choices = hf_router_choices(hf, ids)
    model = load_model(tmp_path, torch.float32)
    with torch.no_grad():
        out = model(ids, capture=True)
        assert (out.logits - ref).abs().max() <= 1e-4
        assert len(choices) == len(model.moe_layer_ids)
        for j, choice in enumerate(choices):
            assert torch.equal(
                out.routed[:, :, j].reshape(-1, model.config.top_k).sort(-1).values, choice.sort(-1).values
            )
        field, wrong = KNOBS[arch]
        off = MoEModel(dataclasses.replace(model.config, **{field: wrong}), torch.float32)
        off.load_state_dict(model.state_dict())
        assert (off(ids).logits - ref).abs().max() > 1e-4, field
        if model.config.score_correction_bias:
            for layer in model.layers:
                if layer.is_moe:
                    layer.mlp.router.e_score_correction_bias.zero_()
            unbiased = model(ids, capture=True).routed
            assert any(
                not torch.equal(unbiased[:, :, j].reshape(-1, model.config.top_k).sort(-1).values, c.sort(-1).values)
                for j, c in enumerate(choices)
            )


def _default_config(model_type: str, **changes) -> dict:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf = AutoConfig.for_model(model_type).to_dict() | {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]}
    return {k: v for k, v in (hf | changes).items() if v is not None or k not in changes}


REFUSED = [  # (model_type, config changes, the feature the refusal names)
    ("longcat_flash", {}, r"LongcatFlashForCausalLM's .* through that architecture's bridge file \(moerl.bridges"),
    ("kimi_linear", {}, "linear-attention layers other than Gated DeltaNet"),
    ("minimax", {}, "lightning linear-attention layers"),
    ("lfm2_moe", {}, "short-convolution layers"),
    ("hy_v4", {}, "hyper-connections"),
    ("deepseek_v4", {}, "hyper-connections"),
    ("qwen4_exp_text", {}, "hyper-connections"),
    ("jetmoe", {}, r"JetMoeForCausalLM's .* through that architecture's bridge file \(moerl.bridges.jetmoe"),
    ("minimax_m3_vl_text", {}, "block-sparse attention"),
    ("deepseek_v4", dict.fromkeys(("hc_mult", "hc_sinkhorn_iters", "hc_eps")), "hash-routed MoE layers.*layer 0"),
    ("qwen3_moe", {"v_head_dim": 32}, "latent-attention field.* 'v_head_dim' without latent-attention tensors"),
    ("granitemoe_swa", {"layer_rope_theta": [1e4 * (1 + i) for i in range(32)]}, "a RoPE per layer is not"),
    ("qwen3_moe", {"index_topk": 4}, "indexer field.*'index_topk'.* without indexer tensors"),
]


@pytest.mark.parametrize(("model_type", "changes", "feature"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_family_needing_what_moerl_lacks_is_refused_naming_the_feature(model_type, changes, feature):
    """Not "fields not understood": the refusal says which feature (zero-computation experts, another linear
    attention, an indexer, ...) the decoder does not compute, from the config or the tensor names."""
    hf = _default_config(model_type, **changes)
    if model_type == "qwen3_moe":
        hf |= {"num_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(UnknownArchitectureError, match=feature):
        derived.prove(hf)


ROPE_PER_KIND = [  # (model_type, config changes): the sliding layers' RoPE differs from the full ones'
    ("mellum", {"layer_types": ["sliding_attention", "full_attention"] * 14, "sliding_window": 4}),
    ("granitemoe_swa", {"layer_rope_theta": [5e5 if i % 4 == 0 else 1e4 for i in range(32)], "sliding_window": 4}),
]


@pytest.mark.parametrize(("model_type", "changes"), ROPE_PER_KIND, ids=[r[0] for r in ROPE_PER_KIND])
def test_a_rope_per_layer_kind_is_derived_and_proven(model_type, changes):
    """Mellum's ``rope_parameters`` keyed by layer kind and GraniteMoeSWA's ``layer_rope_theta`` one theta a kind:
    proven with the sliding layers' own table (the proof's negative control: the same families with one table,
    below, miss)."""
    import dataclasses

    from moerl.bridges.base import HFConfig

    hf = _default_config(model_type, **changes)
    bridge, variant, layout = derived.prove(hf)
    cfg = bridge.config_from_hf(HFConfig(derived.tiny_config(hf), "tiny"))
    assert cfg.sliding_rope is not None and cfg.sliding_rope.theta != cfg.rope.theta
    one_table = dataclasses.replace(layout)
    real = derived.derive

    def without_sliding_rope(hf, layout, variant):  # the sliding layers rotated by the full ones' table
        bridge = real(hf, layout, variant)
        build = bridge.config_from_hf
        return dataclasses.replace(
            bridge, config_from_hf=lambda c: dataclasses.replace(build(c), sliding_rope=None, sliding_rope_dim=None)
        )

    derived.derive = without_sliding_rope
    try:
        with pytest.raises(UnknownArchitectureError, match="no variant matches transformers"):
            derived.prove(hf)
    finally:
        derived.derive = real
    assert one_table == layout


@pytest.mark.parametrize(
    "arch", ["ExaoneMoeForCausalLM", "Glm4MoeLiteForCausalLM", "GraniteMoeSharedForCausalLM", "MiniMaxM2ForCausalLM"]
)
def test_a_derived_family_decodes_in_the_engine_as_its_full_forward(arch, tmp_path):
    """The engine serves a derived family (sliding layers beside NoPE ones through the paged cache, latent
    attention, muP with a shared MLP, a buffer bias): each sampled token's logprobs and experts as a full forward
    of the finished sequence gives them (k3 <= 1e-6 fp32, routing equal)."""
    from test_engine import engine_vs_full_forward

    from moerl.engine import EngineConfig, LLMEngine

    build_hf_model(arch).save_pretrained(tmp_path)
    config = EngineConfig(max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8)
    kl, routed_ok = engine_vs_full_forward(LLMEngine(tmp_path, config, torch.float32))
    assert kl <= 1e-6 and routed_ok, (kl, routed_ok)


def test_the_proof_perturbs_the_buffers_a_checkpoint_holds(monkeypatch):
    """GLM-4.5's selection bias is a buffer (``mlp.gate.e_score_correction_bias``): the proof randomises it like the
    parameters, so a bridge that leaves it out (the model keeps zeros) is refused (left at transformers' zeros on
    both sides, that bridge would pass)."""
    import dataclasses

    hf = json.loads(build_hf_model("Glm4MoeForCausalLM").config.to_json_string())
    real_derive = derived.derive

    def without_bias(hf, layout, variant):  # the selection bias read from the checkpoint but never placed
        bridge = real_derive(hf, dataclasses.replace(layout, correction_bias=None), variant)
        return dataclasses.replace(bridge, ignore=lambda name, cfg: name.endswith("e_score_correction_bias"))

    derived.prove(hf)  # the bridge as derived
    monkeypatch.setattr(derived, "derive", without_bias)
    with pytest.raises(UnknownArchitectureError, match=r"no variant matches transformers .*first difference: layer"):
        derived.prove(hf)


HYBRID_BAD = [  # (config fields, the error's words): the 2026 hybrids' own fields, named when wrong
    ({"attn_layer_period": 8, "attn_layer_offset": 8}, r"'attn_layer_offset' \(8\) must be below 'attn_layer_period'"),
    ({"expert_layer_period": 2, "expert_layer_offset": 3}, r"'expert_layer_offset' \(3\) must be below"),
    ({"mamba_dt_rank": 0}, r"'mamba_dt_rank' must be an int >= 1 or \"auto\", got 0"),
    ({"mamba_dt_rank": "big"}, r"'mamba_dt_rank' must be an int >= 1 or \"auto\", got 'big'"),
    ({"ssm_state_size": -1}, r"'ssm_state_size' must be an int >= 1"),
    ({"use_conv_bias": "no"}, r"'use_conv_bias' must be true or false"),
]


@pytest.mark.parametrize(("fields", "words"), HYBRID_BAD, ids=[next(iter(f)) for f, _ in HYBRID_BAD])
def test_a_hybrids_fields_of_the_wrong_type_or_range_are_named(fields, words):
    from moerl.bridges.derive import check_known
    from moerl.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        check_known({"architectures": ["JambaForCausalLM"], "hidden_size": 64, **fields})


def test_layer_kind_lists_naming_what_no_layer_is_are_refused():
    """Nemotron-H's layer kinds (a list or the older letters) and GLM-5's indexer kinds: an entry that is no kind, or
    a first indexer layer that would keep an earlier one's keys, is a ConfigError naming the field and the entry."""
    from moerl.bridges.base import HFConfig
    from moerl.bridges.derive import _indexer, one_block_kinds, read_layout
    from moerl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'layers_block_type' holds 'ssm'; allowed: linear_attention"):
        one_block_kinds(HFConfig({"layers_block_type": ["mamba", "ssm"]}, "config.json"))
    with pytest.raises(ConfigError, match=r"'hybrid_override_pattern' holds 'Q'; allowed: M, \*, -, E"):
        one_block_kinds(HFConfig({"hybrid_override_pattern": "M-Q"}, "config.json"))
    assert one_block_kinds(HFConfig({"hybrid_override_pattern": "M*-E"}, "c")) == ["mamba", "attention", "mlp", "moe"]
    layout = read_layout(
        {
            "model.layers.0.mlp.gate.weight": (8, 64),
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (40, 64),
            "model.layers.0.self_attn.indexer.wk.weight": (16, 64),
        }
    )
    fields = {"index_topk": 4, "index_n_heads": 2, "index_head_dim": 16}
    for kinds in (["shared", "full"], ["full", "half"], ["full"]):
        with pytest.raises(ConfigError, match="'indexer_types' must list 'full' / 'shared' for each of the 2 layers"):
            _indexer(HFConfig(fields | {"indexer_types": kinds}, "config.json"), layout, {}, 2)
