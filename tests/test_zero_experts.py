"""Zero-computation experts (LongCat-Flash's): router slots past the real experts whose expert returns its input. The
MoE block at fp32 parity with transformers' LongCat-Flash MoE on the same weights (a control: zero experts that
return nothing miss), no GEMM for a pair routed to one, the grouped / per-expert / dense paths equal, R3 replaying
them and training through them (the config's own checks: tests/test_model_config.py; expert parallelism, where their
pairs stay on the token's rank: tests/test_parallel.py's LongCat-Flash case)."""

import pytest
import torch

from moerl.model.config import ModelConfig
from moerl.model.moe import MoE, Route
from moerl.model.transformer import MoEModel

E, Z, K, H, I = 8, 4, 4, 64, 32  # noqa: E741 - the intermediate size, as the model's config names it
CFG = ModelConfig(
    vocab_size=96, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=48,
    num_experts=E, zero_experts=Z, top_k=K, moe_intermediate_size=I, moe_layers=[1], score_correction_bias=True,
    routed_scaling_factor=2.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def blocks():
    """transformers' LongCat-Flash MoE block with random weights (its selection bias too) and moerl's with the same:
    the router's E + Z rows, the real experts' weights (LongCat stores gate_up rows for the zero slots too, unused)."""
    from transformers import AutoConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    hf_cfg = AutoConfig.for_model(
        "longcat_flash", hidden_size=H, n_routed_experts=E, zero_expert_num=Z, moe_topk=K, expert_ffn_hidden_size=I,
        routed_scaling_factor=2.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ref = LongcatFlashMoE(hf_cfg).eval()
    with torch.no_grad():
        for p in [*ref.parameters(), *ref.buffers()]:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim < 2 else 0.2))
    ours = MoE(CFG)
    with torch.no_grad():
        ours.router.weight.copy_(ref.router.classifier.weight)
        ours.router.e_score_correction_bias.copy_(ref.router.e_score_correction_bias)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj[:E])
        ours.experts.down_proj.copy_(ref.experts.down_proj)
    return ref, ours


def _x(n=64, seed=1):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_the_block_matches_longcat_flash_and_zero_pairs_cost_no_gemm(blocks):
    """64 tokens, 4 of 12 slots a token: moerl's output within fp32 1e-5 of transformers', the same slots chosen,
    some of them zero experts; the grouped GEMMs run only the pairs of real experts. Negative control: zero experts
    that return nothing miss."""
    ref, ours = blocks
    x = _x()
    chosen = []
    hook = ref.router.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    with torch.no_grad():
        want = ref(x[None])[0]
        got, idx = ours(x)
    hook.remove()
    assert torch.equal(idx.sort(-1).values, chosen[0].sort(-1).values)
    zero = idx >= E
    assert zero.any() and (~zero).any()
    assert (got - want).abs().max() <= 1e-5
    route = Route(idx, torch.ones_like(idx, dtype=torch.float32), E, x.dtype, zero=True)
    assert route.token.numel() == int((~zero).sum()) and int(route.expert.max()) < E

    with torch.no_grad():
        weights, _ = ours.router(x)
        routed_only = ours.experts(x, idx, weights)  # the real experts alone: zero experts returning nothing
    assert (routed_only - want).abs().max() > 1e-3


def test_the_grouped_per_expert_and_dense_paths_agree(blocks):
    """The per-expert reference loop and the dense every-expert path (the compiled decode step's) give the grouped
    path's output (fp32 1e-5) with zero experts among the chosen."""
    _, ours = blocks
    x = _x(seed=2)
    with torch.no_grad():
        weights, idx = ours.router(x)
        grouped = ours.experts(x, idx, weights)
        ours.experts.grouped = False
        loop = ours.experts(x, idx, weights)
        ours.experts.grouped = True
        dense = ours.experts._dense(x, idx, weights)
    assert (idx >= E).any()
    assert (loop - grouped).abs().max() <= 1e-5 and (dense - grouped).abs().max() <= 1e-5


def test_r3_replays_zero_experts():
    """A model's captured routing, zero experts among it, replayed into the same model with its selection bias moved
    (other experts chosen, the same gate weights for any given one) gives the first forward's logits (fp32 1e-5); a
    replayed index past the zero slots is refused naming it."""
    from moerl.errors import ReplayError

    model = MoEModel(CFG, torch.float32)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(ids, capture=True)
        assert (first.routed >= E).any()
        bias = model.layers[1].mlp.router.e_score_correction_bias
        bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(5)))
        moved = model(ids, capture=True)
        assert not torch.equal(moved.routed, first.routed) and (moved.logits - first.logits).abs().max() > 1e-3
        again = model(ids, replay=first.routed)
    assert (again.logits - first.logits).abs().max() <= 1e-5
    bad = first.routed.clone()
    bad[0, 0, 0, 0] = E + Z
    with pytest.raises(ReplayError, match=rf"holds expert {E + Z}, outside \[0, {E + Z}\)"):
        model(ids, replay=bad)


def test_a_model_with_zero_experts_trains():
    """Fifty AdamW steps of next-token loss on one batch lower it by half: gradients reach the router's zero slots
    (through their gate weights) and the real experts."""
    model = MoEModel(CFG, torch.float32)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if not losses:
            router = model.layers[1].mlp.router.weight.grad
            assert router[E:].abs().sum() > 0 and model.layers[1].mlp.experts.gate_up_proj.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
