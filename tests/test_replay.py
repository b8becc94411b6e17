"""Routing capture and replay (R3): replay reproduces, other indices change, router gradients flow."""

import pytest
import torch
from hf_models import ARCHS, VOCAB

from moerl.bridges import load_model
from moerl.errors import ReplayError


def _ids(b=2, t=16):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_captured_indices_reproduces_logits_exactly(arch, dtype, hf_checkpoints):
    model = load_model(hf_checkpoints[arch][0], dtype=dtype)
    ids = _ids()
    with torch.no_grad():
        captured = model(ids, capture=True)
        replayed = model(ids, replay=captured.routed)
        replayed_short = model(ids, replay=captured.routed[:, :-1])  # [T-1] rows, as the engine records them
    assert torch.equal(replayed.logits, captured.logits)
    assert torch.equal(replayed.routed, captured.routed)
    assert torch.equal(replayed_short.logits, captured.logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_other_indices_changes_logits(arch, hf_checkpoints):
    model = load_model(hf_checkpoints[arch][0], dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        captured = model(ids, capture=True)
        other = (captured.routed + 1) % model.config.num_experts  # still k distinct experts per token
        changed = model(ids, replay=other)
    assert torch.equal(changed.routed, other)
    assert (changed.logits - captured.logits).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_router_weights_get_gradients_under_replay(arch, hf_checkpoints):
    model = load_model(hf_checkpoints[arch][0], dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        routed = model(ids, capture=True).routed
    logits = model(ids, replay=routed).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for i in model.moe_layer_ids:
        grad = model.layers[i].mlp.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0, f"layer {i} router got no gradient"


def test_replay_gate_weights_follow_the_forward_scores():
    """Under replay the gates come from this forward's own router scores at the replayed experts."""
    from moerl.model import ModelConfig, MoEModel

    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=32,
        num_experts=4,
        top_k=2,
        moe_intermediate_size=8,
        moe_layers=[0],
        norm_topk_prob=True,
    )
    model = MoEModel(cfg)
    model.init_weights(std=0.5, generator=torch.Generator().manual_seed(0))
    router = model.layers[0].mlp.router
    x = torch.randn(5, 16)
    idx = torch.tensor([[0, 3]] * 5)
    weights, got = router(x, replay=idx)
    probs = (x @ router.weight.T).softmax(-1)
    expected = probs[:, [0, 3]] / probs[:, [0, 3]].sum(-1, keepdim=True)
    assert torch.equal(got, idx)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)


def test_minus_one_rows_route_themselves(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        captured = model(ids, capture=True)
        partial = captured.routed.clone()
        partial[0, 3:] = -1
        out = model(ids, replay=partial)
    assert torch.equal(out.routed, captured.routed)
    assert torch.equal(out.logits, captured.logits)


def test_replay_wrong_shape_names_the_shape(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    ids = _ids()
    routed = model(ids, capture=True).routed
    with pytest.raises(ReplayError, match=r"replay has shape \(2, 16, 1, 2\).*L_moe=2"):
        model(ids, replay=routed[:, :, :1])
    with pytest.raises(ReplayError, match=r"T=16 or T-1=15"):
        model(ids, replay=routed[:, :10])


def test_replay_out_of_range_names_the_layer(hf_checkpoints):
    model = load_model(hf_checkpoints["Qwen3MoeForCausalLM"][0], dtype=torch.float32)
    ids = _ids()
    routed = model(ids, capture=True).routed.clone()
    routed[1, 4, 1, 0] = 8
    # Qwen3 test config: layer 1 is dense, so MoE column 1 is model layer 2
    with pytest.raises(ReplayError, match=r"replay\[\.\.\., 1, :\] \(model layer 2\) holds expert 8, outside \[0, 8\)"):
        model(ids, replay=routed)
