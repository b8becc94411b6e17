"""A bridge rule's transform reaches LoRA adapters of its module (PEFT import and export) and sees the model
config. The family here stores q_proj rows per head in interleaved rotary order (as a checkpoint converted from
the interleaved convention would): the rule needs ``head_dim`` and ``num_heads`` to undo it."""

import dataclasses

import pytest
import torch

from moerl.bridges import export_model, load_model
from moerl.bridges import registry as bridge_registry
from moerl.bridges.base import Rule
from moerl.bridges.peft import read_peft_adapter, write_peft_adapter
from moerl.errors import CheckpointError
from moerl.model.lora import LoraConfig, attach_lora, lora_modules
from moerl.presets import init_model

ARCH = "InterleavedQwen3MoeForCausalLM"


def _per_head(t: torch.Tensor, cfg, inverse: bool) -> torch.Tensor:
    """Rows of q_proj [..., heads * d, in]: rotate-half order <-> interleaved pairs, within each head."""
    d = cfg.head_dim
    half = torch.arange(d // 2)
    interleaved = torch.stack([half, half + d // 2], dim=-1).flatten()  # row j of a stored head = our row perm[j]
    perm = interleaved.argsort() if inverse else interleaved
    heads = t.shape[-2] // d
    return t.unflatten(-2, (heads, d))[..., perm, :].flatten(-3, -2)


Q_RULE = Rule(
    "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.self_attn.q_proj.weight",
    load=lambda t, cfg: _per_head(t, cfg, inverse=True),
    save=lambda t, cfg: _per_head(t, cfg, inverse=False),
    rows=lambda b, cfg: _per_head(b, cfg, inverse=True),
    rows_save=lambda b, cfg: _per_head(b, cfg, inverse=False),
)


@pytest.fixture
def family(monkeypatch):
    """A Qwen3-MoE variant with the per-head q_proj rule, registered for this test only."""
    base = bridge_registry.bridge_for_arch("qwen3_moe")

    def register(rule: Rule):
        bridge = dataclasses.replace(base, architectures=(ARCH,), rules=(rule, *base.rules))
        monkeypatch.setitem(bridge_registry._BRIDGES, ARCH, bridge)
        return bridge

    return register


def _model_with_adapter(tmp_path):
    model = init_model("qwen3_moe", "tiny", dtype=torch.float32)
    model.hf_config = dict(model.hf_config, architectures=[ARCH])
    attach_lora(model, LoraConfig(rank=4, alpha=4, targets=["q_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_rule_transforms_reach_weights_and_adapters(family, tmp_path):
    family(Q_RULE)
    model = _model_with_adapter(tmp_path)
    export_model(model, tmp_path / "ckpt")
    q = model.layers[0].self_attn.q_proj
    from safetensors import safe_open

    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        stored = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(stored, q.weight)  # the checkpoint holds the other row order
    assert torch.equal(load_model(tmp_path / "ckpt", torch.float32).layers[0].self_attn.q_proj.weight, q.weight)

    out = write_peft_adapter(model, tmp_path / "peft")
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        a_hf = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        b_hf = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    # the contract: the checkpoint's merged weight is the rule's transform of moerl's merged weight
    delta = q.lora.lora_B[0].detach() @ q.lora.lora_A[0].detach() * q.lora.scale[0]
    merged = Q_RULE.save(q.weight.detach() + delta, model.config)
    assert torch.allclose(stored + b_hf @ a_hf, merged, atol=1e-5)
    # negative control: the adapter in moerl's row order (no transform) gives another merged weight
    assert not torch.allclose(stored + delta, merged, atol=1e-2)
    back = read_peft_adapter(out, model)
    assert torch.allclose(back["layers.0.self_attn.q_proj.lora_B"] @ back["layers.0.self_attn.q_proj.lora_A"], delta)


def test_a_transform_without_adapter_rows_is_refused_for_adapters(family, tmp_path):
    family(dataclasses.replace(Q_RULE, rows=None, rows_save=None))
    model = _model_with_adapter(tmp_path)
    with pytest.raises(CheckpointError, match=r"adapter on 'model.layers.\{i\}.self_attn.q_proj.weight'.*rows_save"):
        write_peft_adapter(model, tmp_path / "peft")
    family(Q_RULE)
    out = write_peft_adapter(model, tmp_path / "peft")
    family(dataclasses.replace(Q_RULE, rows=None, rows_save=None))
    with pytest.raises(CheckpointError, match=r"transforms the weight on load .*\(Rule.rows\)"):
        read_peft_adapter(out, model)
