"""Activation checkpointing (``policy.activation_checkpointing``, ``moerl.parallel.checkpointing``): a training step
whose decoder blocks recompute their activations in the backward equals the plain step (fp32: loss, gradient norm,
every gradient), R3 on and off, full and selective, in full and LoRA mode; another replay misses the tolerance. A
recomputed block trains the experts its forward chose even where the recomputation's router would choose others
(control: a checkpoint that lets it choose again trains other experts, or is stopped by torch's own metadata check).
Combinations not built are refused by name. Expert and pipeline parallel: tests/test_parallel.py's ``ac=`` cases."""

import pytest
import torch
from dp_check import fixed_batch
from run_helpers import stepped_grads
from torch.utils.checkpoint import CheckpointError, checkpoint

from moerl.errors import ConfigError
from moerl.parallel.checkpointing import apply_checkpointing
from moerl.presets import init_model
from moerl.trainer import OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import PolicyLossConfig, make_policy_loss

TOL = 1e-6  # fp32, relative to each tensor's largest element: the recomputation runs the same kernels on the same rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_model("qwen3_moe", "tiny", path)
    return path


def _step(path, mode: str, how: str, replay: bool, batch=None) -> tuple[dict, dict]:
    """(the step's loss and gradient norm, every trained tensor's gradient) of one step on dp_check's fixed batch."""
    torch.manual_seed(0)  # the same adapters
    cfg = PolicyConfig(mode=mode, dtype="float32", micro_batch_size=2, activation_checkpointing=how,
                       optim=OptimConfig(lr=1e-2))  # fmt: skip
    pol = Policy(path, cfg)
    mcfg = pol.model.config
    batch = batch or fixed_batch(len(mcfg.route_layers()), mcfg.top_k, mcfg.num_experts)
    batch.extras["old_logprobs"] = pol.forward_logprobs(batch, replay=replay)[0]
    grads = stepped_grads(pol)
    stats = pol.train_step(batch, make_policy_loss(PolicyLossConfig()), replay=replay)
    return stats, dict(grads)


def _off(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and want
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-30)).item() for n in want)


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize(("mode", "how"), [("full", "full"), ("lora", "full"), ("full", "selective")])
def test_a_checkpointed_step_is_the_plain_step(tiny, mode, how, replay):
    plain, want = _step(tiny, mode, "none", replay)
    stats, got = _step(tiny, mode, how, replay)
    assert abs(stats["loss"] - plain["loss"]) <= TOL * abs(plain["loss"]) + 1e-9
    assert abs(stats["grad_norm"] - plain["grad_norm"]) <= TOL * plain["grad_norm"]
    assert _off(got, want) <= TOL, _off(got, want)


def test_another_replay_misses_the_tolerance(tiny):
    """The control: the same checkpointed step with other experts replayed."""
    _, want = _step(tiny, "full", "none", True)
    pol = Policy(tiny, PolicyConfig(mode="full", dtype="float32"))
    mcfg = pol.model.config
    batch = fixed_batch(len(mcfg.moe_layers), mcfg.top_k, mcfg.num_experts)
    batch.replay = torch.where(batch.replay >= 0, (batch.replay + 1) % mcfg.num_experts, batch.replay)
    _, got = _step(tiny, "full", "full", True, batch)
    assert _off(got, want) > 1e3 * TOL


def _expert_rows(model) -> set[tuple[int, int]]:
    """(layer, expert) pairs whose weights got a gradient: the experts the step trained."""
    out = set()
    for i in model.moe_layer_ids:
        g = model.layers[i].mlp.experts.gate_up_proj.grad
        out |= {(i, e) for e in range(g.shape[0]) if bool(g[e].abs().sum() > 0)}
    return out


def test_a_recomputed_block_trains_the_experts_its_forward_chose():
    """Between the forward and the backward the routers move (a stand-in for a recomputation that rounds its scores
    otherwise): the checkpointed step still trains exactly the experts the plain step trains, while a checkpoint
    that lets the routers choose again trains others or is stopped by torch's check of the recomputed tensors."""
    torch.manual_seed(0)
    model = init_model("qwen3_moe", "tiny", overrides={"num_hidden_layers": 2}, dtype=torch.float32).train()
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(1))

    def trained(recompute, perturb: bool = True) -> set | type:
        model.zero_grad(set_to_none=True)
        for layer in model.layers:
            layer.recompute = recompute
        saved = [model.layers[i].mlp.router.weight.detach().clone() for i in model.moe_layer_ids]
        logits = model(ids).logits
        with torch.no_grad():  # other routers for the backward's recomputation
            for i in model.moe_layer_ids if perturb else ():
                model.layers[i].mlp.router.weight.copy_(torch.randn_like(saved[0]))
        try:
            logits.square().mean().backward()
        except CheckpointError:
            return CheckpointError
        finally:
            with torch.no_grad():
                for i, w in zip(model.moe_layer_ids, saved, strict=True):
                    model.layers[i].mlp.router.weight.copy_(w)
            for layer in model.layers:
                layer.recompute = None
        return _expert_rows(model)

    plain = trained(None, perturb=False)  # the reference: no recomputation, the routers left as they are
    apply_checkpointing(model, "full")
    ours = model.layers[0].recompute
    assert trained(ours) == plain

    def choose_again(layer, block, x, cos, sin, mask, replay, chosen):
        return checkpoint(lambda *a: block(*a, None, chosen), x, cos, sin, mask, replay, use_reentrant=False)

    assert trained(choose_again) != plain


def test_combinations_not_built_are_refused_by_name(tiny):
    with pytest.raises(ConfigError, match=r"activation_checkpointing.*policy\.compile=true"):
        PolicyConfig(activation_checkpointing="full", compile=True)
    with pytest.raises(ConfigError, match=r"activation_checkpointing='always'.*allowed: none, full, selective"):
        PolicyConfig(activation_checkpointing="always")
    from test_model_config import INDEXED

    from moerl.model.config import ModelConfig
    from moerl.model.transformer import MoEModel
    from moerl.parallel.layout import LayoutConfig, parallelize
    from moerl.parallel.world import World

    model = MoEModel(ModelConfig(**INDEXED, index_shared_layers=[1]), torch.float32)  # GLM-5's shared indexer
    with pytest.raises(ConfigError, match=r"activation_checkpointing=full with a model whose layers reuse"):
        parallelize(model, World(), LayoutConfig(True, torch.float32, 2, None, "full"))
