"""LoRA on attention, dense MLPs, shared and routed experts: merged-weight equivalence, fused vs naive, slots."""

import pytest
import torch
from hf_models import VOCAB

from moerl.bridges import load_model
from moerl.errors import ConfigError
from moerl.model.lora import (
    LoraConfig,
    LoraExperts,
    LoraLinear,
    attach_lora,
    lora_candidates,
    lora_modules,
    merged_state_dict,
)

TOL = 1e-5  # fp32


def _randomize_lora(model, seed=0):
    """B starts at zero (a no-op adapter); give every slot random A and B so the adapters matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _model(hf_checkpoints, arch, layout, slots=1, **kw):
    model = load_model(hf_checkpoints[arch][0], dtype=torch.float32)
    everything = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "experts",
    ]
    targets = [t for t in everything if t in lora_candidates(model)]  # attention, dense MLP, shared, experts
    attach_lora(model, LoraConfig(rank=4, alpha=8, layout=layout, slots=slots, targets=targets, **kw))
    _randomize_lora(model)
    return model


def _ids(b=3, t=12):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize(
    "arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"]
)
def test_lora_equals_merged_weights(arch, layout, hf_checkpoints):
    model = _model(hf_checkpoints, arch, layout)
    merged = load_model(hf_checkpoints[arch][0], dtype=torch.float32)
    merged.load_state_dict(merged_state_dict(model, slot=0))
    ids = _ids()
    with torch.no_grad():
        ours = model(ids, adapters=0).logits
        ref = merged(ids).logits
        base = model(ids).logits  # adapters=None: the base model
    assert (ours - ref).abs().max().item() <= TOL
    assert (ours - base).abs().max().item() > 1e-3  # the adapters do something


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_fused_and_naive_expert_lora_agree(layout, hf_checkpoints):
    model = _model(hf_checkpoints, "Qwen3MoeForCausalLM", layout, slots=3)
    ids = _ids(b=4)
    adapters = torch.tensor([0, 2, -1, 1])
    with torch.no_grad():
        fused = model(ids, adapters=adapters).logits
        model.set_expert_path(grouped=False)
        naive = model(ids, adapters=adapters).logits
    assert (fused - naive).abs().max().item() <= TOL


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_each_sequence_gets_its_own_adapter(layout, hf_checkpoints):
    model = _model(hf_checkpoints, "Qwen2MoeForCausalLM", layout, slots=3)
    ids = _ids(b=4)
    adapters = torch.tensor([0, 2, -1, 1])
    with torch.no_grad():
        mixed = model(ids, adapters=adapters).logits
        for row, slot in enumerate(adapters.tolist()):
            alone = model(ids[row : row + 1], adapters=None if slot < 0 else slot).logits
            assert (mixed[row] - alone[0]).abs().max().item() <= TOL, f"row {row} (slot {slot})"


def test_fresh_adapter_is_a_no_op(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=4, layout="shared_outer"))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids, adapters=0).logits, model(ids).logits)  # B = 0 at init


def test_lora_grads_reach_adapters_not_base(hf_checkpoints):
    model = _model(hf_checkpoints, "Qwen3MoeForCausalLM", "shared_outer")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora." in name)
    ids = _ids()
    logits = model(ids, adapters=0).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".lora." in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_rank_normalisation_and_rslora_scale(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    attach_lora(model, LoraConfig(rank=8, alpha=16, rslora=True, expert_rank_norm=True, targets=["q_proj", "experts"]))
    mods = lora_modules(model)
    experts = mods["layers.0.mlp.experts"]
    assert experts.down_A.shape[2] == 4  # 8 // top_k=2
    assert experts.scale[0].item() == pytest.approx(16 / 4**0.5)
    assert mods["layers.0.self_attn.q_proj"].scale[0].item() == pytest.approx(16 / 8**0.5)


def test_unknown_target_lists_candidates(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"\['w1'\] match no module.*candidates:.*experts.*q_proj"):
        attach_lora(model, LoraConfig(targets=["q_proj", "w1"]))


def test_rank_below_one(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"lora\.rank=0: must be >= 1"):
        attach_lora(model, LoraConfig(rank=0))


def test_attach_lora_swaps_modules_and_keeps_the_base_tensors(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        base = model(ids).logits
    before = dict(model.named_parameters())
    attach_lora(model, LoraConfig(rank=4))
    assert type(model.layers[0].self_attn.q_proj) is LoraLinear
    assert type(model.layers[model.moe_layer_ids[0]].mlp.experts) is LoraExperts
    after = dict(model.named_parameters())
    assert all(after[name] is p for name, p in before.items())  # the same tensors under the same names
    assert set(after) - set(before) == {n for n in after if ".lora." in n}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base)  # adapters off: the base model's numbers exactly


def test_lora_and_mxfp8_refuse_each_other_and_a_second_attach(hf_checkpoints):
    from moerl.model.mx import apply_mxfp8

    path = hf_checkpoints["Qwen3MoeForCausalLM"][0]
    ids = _ids()
    mx = load_model(path, dtype=torch.float32)
    apply_mxfp8(mx)
    with torch.no_grad():
        before = mx(ids).logits
    with pytest.raises(ConfigError, match=r"lora: layers\.0\.self_attn\.q_proj is a MXLinear.*separate modes"):
        attach_lora(mx, LoraConfig(rank=4))
    with torch.no_grad():
        assert torch.equal(mx(ids).logits, before)  # a refused attach changes nothing
    assert not lora_modules(mx)
    lora = load_model(path, dtype=torch.float32)
    attach_lora(lora, LoraConfig(rank=4))
    with pytest.raises(ConfigError, match=r"mxfp8: layers\.0\.self_attn\.q_proj is a LoraLinear.*separate modes"):
        apply_mxfp8(lora)
    with pytest.raises(ConfigError, match=r"lora: layers\.0\.self_attn\.q_proj is a LoraLinear.*attach once"):
        attach_lora(lora, LoraConfig(rank=4))
    assert type(lora.layers[0].self_attn.q_proj) is LoraLinear


def test_a_swap_takes_over_only_from_its_base_class():
    from moerl.model.linear import Linear
    from moerl.model.swap import swapped

    with pytest.raises(TypeError, match=r"LoraExperts does not extend Linear.*cannot take over"):
        swapped(Linear(2, 2), LoraExperts)
    base = Linear(2, 2)
    new = swapped(base, LoraLinear)
    assert type(new) is LoraLinear and new.weight is base.weight and new.bias is base.bias
