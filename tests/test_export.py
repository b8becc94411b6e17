"""Export from the trainer: PEFT adapter directories peft loads, and merged HF checkpoints transformers loads."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from moerl.bridges import export_model
from moerl.bridges.peft import read_peft_adapter, write_peft_adapter
from moerl.errors import CheckpointError
from moerl.model.lora import LoraConfig, lora_modules, merged_state_dict
from moerl.trainer import Policy, PolicyConfig

IDS = torch.tensor([[5, 9, 14, 3, 22, 40, 41, 42, 43, 44, 45, 46], [7, 7, 8, 9, 10, 11, 60, 61, 62, 63, 64, 65]])


def peft_logits(path, targets, out_dir):
    """A policy trained with adapters on ``targets`` (per-expert layout), written for PEFT to ``out_dir`` and loaded
    by peft onto transformers' model: (the policy, moerl's logits with the adapter, peft's, moerl's without it)."""
    from peft import PeftModel

    pol = _trained_policy(path, "per_expert", targets)
    write_peft_adapter(pol.model, out_dir)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out_dir).eval()
    with torch.no_grad():
        return pol, pol.model(IDS, adapters=0).logits, peft_model(IDS).logits, pol.model(IDS).logits


def _trained_policy(path, layout, targets, rank=4, expert_rank_norm=False):
    pol = Policy(
        path,
        PolicyConfig(
            mode="lora",
            dtype="float32",
            lora=LoraConfig(
                rank=rank, alpha=2 * rank, layout=layout, targets=targets, expert_rank_norm=expert_rank_norm
            ),
        ),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lora in lora_modules(pol.model).values():
            for p in lora.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return pol


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM", "MixtralForCausalLM"])
def test_peft_export_reproduces_moerl_logits_in_peft(arch, layout, hf_checkpoints, tmp_path):
    from peft import PeftModel

    path = hf_checkpoints[arch][0]
    pol = _trained_policy(
        path, layout, ["q_proj", "k_proj", "v_proj", "o_proj", "experts"], expert_rank_norm=layout == "per_expert"
    )
    write_peft_adapter(pol.model, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours = pol.model(IDS, adapters=0).logits
        theirs = peft_model(IDS).logits
        plain = pol.model(IDS).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - plain).abs().max().item() > 1e-3
    # and our reader takes it back: the same function, now in the per-expert layout
    again = read_peft_adapter(tmp_path / "adapter", pol.model)
    assert again["layers.0.mlp.experts.gate_up_A"].shape[0] == pol.model.config.num_experts


def test_merged_export_reloads_in_transformers(hf_checkpoints, tmp_path):
    path = hf_checkpoints["Qwen2MoeForCausalLM"][0]
    pol = _trained_policy(path, "shared_outer", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "experts"])
    export_model(pol.model, tmp_path / "merged", state_dict=merged_state_dict(pol.model))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(IDS).logits - pol.model(IDS, adapters=0).logits).abs().max().item() <= 1e-4


def test_peft_export_refuses_dense_mlp_adapters(hf_checkpoints, tmp_path):
    pol = _trained_policy(hf_checkpoints["Qwen3MoeForCausalLM"][0], "per_expert", ["q_proj", "gate_proj", "experts"])
    with pytest.raises(CheckpointError, match=r"adapter on 'layers\.1\.mlp\.gate_proj' cannot be written for PEFT"):
        write_peft_adapter(pol.model, tmp_path / "adapter")
