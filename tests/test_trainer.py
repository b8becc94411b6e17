"""The trainer: logprobs, the LoRA and full paths, accumulation, schedules, replay, resume, bad input."""

import math

import pytest
import torch
from run_helpers import stepped_grads

from moerl.errors import ConfigError, ReplayError
from moerl.model.lora import LoraConfig
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig, TrainingStopped
from moerl.trainer.checkpoint import load_checkpoint, save_checkpoint
from moerl.trainer.losses import sft_loss
from moerl.trainer.optim import MasterWeights, lr_lambda

ARCH = "Qwen3MoeForCausalLM"


def make_batch(b=4, t=12, seed=0, vocab=100):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    for row in range(1, b):
        mask[row, t - row :] = 0  # right padding of different lengths
    ids = ids * mask
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0  # a 4-token "prompt"
    return Batch(ids, mask, loss_mask)


def policy(hf_checkpoints, mode="lora", **kw):
    cfg = PolicyConfig(mode=mode, dtype=kw.pop("dtype", "float32"), **kw)
    return Policy(hf_checkpoints[ARCH][0], cfg)


def test_forward_logprobs_match_a_manual_forward_and_ignore_micro_batching(hf_checkpoints):
    pol = policy(hf_checkpoints, mode="full", micro_batch_size=1)
    batch = make_batch()
    lp, ent = pol.forward_logprobs(batch, entropy=True)
    with torch.no_grad():
        logits = pol.model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    ref = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    real = batch.attention_mask[:, 1:].bool()
    assert lp.dtype == torch.float32 and lp.shape == batch.input_ids.shape
    assert torch.allclose(lp[:, 1:][real], ref[real], atol=1e-6)
    assert (lp[:, 0] == 0).all() and (lp[~batch.attention_mask.bool()] == 0).all()
    pol.cfg.micro_batch_size = 8
    assert torch.allclose(pol.forward_logprobs(batch)[0], lp, atol=1e-6)
    assert ent is not None and (ent[:, 1:][real] > 0).all()


def test_lora_trains_adapters_only_and_reference_is_adapters_off(hf_checkpoints):
    pol = policy(
        hf_checkpoints,
        mode="lora",
        dtype="bfloat16",
        lora=LoraConfig(rank=4, layout="shared_outer"),
        optim=OptimConfig(lr=5e-3),
    )
    model = pol.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and not model.embed_tokens.weight.requires_grad
    assert all(p.dtype == torch.float32 and p.requires_grad for p in pol.trainable.values())
    assert model.layers[0].mlp.router.weight.dtype == torch.float32
    base_before = {k: v.clone() for k, v in model.state_dict().items() if ".lora." not in k}
    batch = make_batch()
    ref0 = pol.forward_logprobs(batch, reference=True)[0]
    assert torch.equal(pol.forward_logprobs(batch)[0], ref0)  # B = 0: the adapter starts as a no-op
    losses = [pol.train_step(batch, sft_loss)["loss"] for _ in range(15)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base_before.items())  # base untouched
    assert torch.equal(pol.forward_logprobs(batch, reference=True)[0], ref0)
    assert not torch.equal(pol.forward_logprobs(batch)[0], ref0)


def test_full_mode_keeps_fp32_masters_and_a_frozen_reference(hf_checkpoints):
    pol = policy(hf_checkpoints, mode="full", dtype="bfloat16", reference=True, optim=OptimConfig(lr=1e-3))
    batch = make_batch()
    ref0 = pol.forward_logprobs(batch, reference=True)[0]
    losses = [pol.train_step(batch, sft_loss)["loss"] for _ in range(10)]
    assert losses[-1] < losses[0] - 0.3, losses
    name = "layers.0.self_attn.q_proj.weight"
    master = pol.master.master[name]
    assert master.dtype == torch.float32 and pol.model.get_parameter(name).dtype == torch.bfloat16
    assert torch.equal(pol.model.get_parameter(name), master.to(torch.bfloat16))
    router = "layers.0.mlp.router.weight"
    assert pol.model.get_parameter(router).dtype == torch.float32
    assert pol.master.master[router] is pol.model.get_parameter(router)  # the fp32 router is its own master
    assert torch.equal(pol.forward_logprobs(batch, reference=True)[0], ref0)


def test_gradient_accumulation_equals_one_big_batch(hf_checkpoints):
    batch = make_batch(b=6)
    after = []
    for micro in (6, 2):
        pol = policy(hf_checkpoints, mode="full", micro_batch_size=micro, optim=OptimConfig(lr=1e-3))
        pol.train_step(batch, sft_loss)
        after.append(pol.master.master["layers.2.mlp.experts.gate_up_proj"].detach().clone())
    assert torch.allclose(after[0], after[1], atol=1e-6)


def test_lr_schedules():
    f = lr_lambda("cosine", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert lr_lambda("constant", 0, 10, 0.0)(7) == 1.0
    with pytest.raises(ConfigError, match=r"optim.schedule='linear': allowed: constant, cosine"):
        OptimConfig(schedule="linear")  # refused where the config is read, before any schedule is built


def test_replay_reproduces_rollout_routing_and_router_learns(hf_checkpoints):
    from moerl.engine import EngineConfig, LLMEngine, SamplingParams

    pol = policy(hf_checkpoints, mode="full", optim=OptimConfig(lr=1e-2))
    engine = LLMEngine(pol.model, EngineConfig(max_num_seqs=4, max_model_len=40))
    outs = engine.generate([[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], SamplingParams(max_tokens=8, seed=0))
    rows = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    t = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (t - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in rows])
    replay = torch.zeros(2, t - 1, *outs[0].outputs[0].routed_experts.shape[1:], dtype=torch.long)
    for i, o in enumerate(outs):
        replay[i, : len(rows[i]) - 1] = o.outputs[0].routed_experts.long()
    batch = Batch(ids, mask, mask, replay=replay)
    lp = pol.forward_logprobs(batch)[0]
    for i, o in enumerate(outs):
        n = len(o.prompt_token_ids)
        assert torch.allclose(lp[i, n : len(rows[i])], o.outputs[0].logprobs, atol=1e-5)
    other = Batch(ids, mask, mask, replay=(replay + 1) % 8)
    assert not torch.allclose(pol.forward_logprobs(other)[0], lp, atol=1e-3)
    assert torch.equal(pol.forward_logprobs(Batch(ids, mask, mask), replay=replay)[0], lp)  # replay given directly
    router = pol.model.get_parameter("layers.0.mlp.router.weight").detach().clone()
    pol.train_step(batch, sft_loss)
    assert not torch.equal(pol.model.get_parameter("layers.0.mlp.router.weight"), router)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_resume_gives_the_same_next_step_bit_for_bit(mode, hf_checkpoints, tmp_path):
    cfg = dict(
        mode=mode,
        optim=OptimConfig(lr=3e-3, schedule="cosine", warmup_steps=2, total_steps=10),
        lora=LoraConfig(rank=4, dropout=0.1),
        micro_batch_size=2,
    )
    batches = [make_batch(seed=s) for s in range(5)]
    a = policy(hf_checkpoints, **cfg)
    for s in range(3):
        a.train_step(batches[s], sft_loss)
    save_checkpoint(tmp_path / "ckpt", a, state={"data_position": 3})
    cont = [a.train_step(batches[s], sft_loss) for s in (3, 4)]
    torch.manual_seed(12345)  # a fresh process would start elsewhere: the checkpoint must restore the RNG
    b = policy(hf_checkpoints, **cfg)
    state = load_checkpoint(tmp_path / "ckpt", b)
    assert state == {"data_position": 3} and b.step == 3
    resumed = [b.train_step(batches[s], sft_loss) for s in (3, 4)]
    for x, y in zip(cont, resumed, strict=True):
        assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] and x["lr"] == y["lr"]


def test_unknown_mode_and_lora_errors(hf_checkpoints):
    with pytest.raises(ConfigError, match=r"PolicyConfig.mode='qlora': allowed: lora, full, mxfp8"):
        PolicyConfig(mode="qlora")
    with pytest.raises(ConfigError, match=r"\['wq'\] match no module.*candidates:"):
        policy(hf_checkpoints, lora=LoraConfig(targets=["q_proj", "wq"]))
    with pytest.raises(ConfigError, match=r"lora.rank=0: must be >= 1"):
        policy(hf_checkpoints, lora=LoraConfig(rank=0))
    with pytest.raises(ConfigError, match=r"reference logprobs in mode 'full' need PolicyConfig.reference=True"):
        policy(hf_checkpoints, mode="full").forward_logprobs(make_batch(), reference=True)


def test_bad_replay_names_layer_and_shape(hf_checkpoints):
    pol = policy(hf_checkpoints, mode="full")
    batch = make_batch(b=2, t=6)
    batch.replay = torch.zeros(2, 6, 1, 2, dtype=torch.long)
    with pytest.raises(ReplayError, match=r"replay has shape \(2, 6, 1, 2\); this forward needs .*L_moe=2"):
        pol.forward_logprobs(batch)
    batch.replay = torch.zeros(2, 5, 2, 2, dtype=torch.long)
    batch.replay[1, 2, 0, 1] = 11
    with pytest.raises(ReplayError, match=r"model layer 0\) holds expert 11"):
        pol.forward_logprobs(batch)


def test_nan_steps_are_skipped_counted_then_stop_with_a_checkpoint(hf_checkpoints, tmp_path):
    pol = policy(hf_checkpoints, mode="lora", max_nan_steps=3)
    pol.stop_checkpoint_dir = tmp_path / "stopped"
    batch = make_batch()
    good = pol.train_step(batch, sft_loss)
    assert good["skipped"] == 0.0

    def nan_loss(lp, mb, ent):
        loss, m = sft_loss(lp, mb, ent)
        return loss * float("nan"), m

    before = {k: v.clone() for k, v in pol.trainable_state().items()}
    for i in range(2):
        out = pol.train_step(batch, nan_loss)
        assert out["skipped"] == 1.0 and out["nan_skipped"] == i + 1
    assert all(torch.equal(before[k], v) for k, v in pol.trainable_state().items())  # nothing applied
    assert pol.train_step(batch, sft_loss)["skipped"] == 0.0  # a good step resets the streak
    pol.train_step(batch, nan_loss)
    pol.train_step(batch, nan_loss)
    with pytest.raises(TrainingStopped, match=r"3 consecutive steps had a non-finite loss.*checkpoint .* saved to"):
        pol.train_step(batch, nan_loss)
    assert (tmp_path / "stopped" / "checkpoint.safetensors").exists()
    fresh = policy(hf_checkpoints, mode="lora", max_nan_steps=3)
    load_checkpoint(tmp_path / "stopped", fresh)
    assert fresh.step == 2 and fresh.nan_skipped == 5


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_one_forward_gives_the_replayed_and_the_reference_logprobs(layout, hf_checkpoints):
    """LoRA: ``logprobs_with_reference`` runs the batch twice in one forward (adapters off and own routing on the
    reference rows) and equals the two separate forwards (fp32, 1e-6); with the adapters trained away from zero and
    replayed experts unlike the router's, so a row that took the wrong half's adapters or routing would show."""
    pol = policy(hf_checkpoints, mode="lora", lora=LoraConfig(rank=4, layout=layout), optim=OptimConfig(lr=5e-2))
    batch = make_batch()
    for _ in range(3):
        pol.train_step(batch, sft_loss)
    with torch.no_grad():
        b, t, layers, k = pol.model(batch.input_ids, capture=True).routed.shape
    g = torch.Generator().manual_seed(1)
    replay = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(b * (t - 1) * layers)])
    batch.replay = replay.view(b, t - 1, layers, k)
    old, ref = pol.logprobs_with_reference(batch)
    want_old, want_ref = pol.forward_logprobs(batch)[0], pol.forward_logprobs(batch, reference=True)[0]
    assert torch.allclose(old, want_old, atol=1e-6) and torch.allclose(ref, want_ref, atol=1e-6)
    assert (old - ref).abs().max() > 1e-2  # the adapters and the replay matter: the halves are not the same


def _step_gradient(pol, batch) -> tuple[float, torch.Tensor]:
    """One train step's loss and the gradient the optimizer stepped with, all trained tensors as one vector."""
    grads = stepped_grads(pol)
    loss = pol.train_step(batch, sft_loss)["loss"]
    assert grads.keys() == pol.trained.keys()
    return loss, torch.cat([g.flatten().float() for g in grads.values()])


COSINE_BOUND = {"lora": 0.999, "full": 0.999, "mxfp8": 0.98}


@pytest.mark.parametrize("mode", ["lora", "full", "mxfp8"])
def test_a_bf16_step_follows_the_fp32_step_and_learns(mode, hf_checkpoints):
    """bf16 compute (mxfp8: MX GEMMs with bf16 around them) from the same weights and adapters as an fp32 policy,
    on the same batch: the loss within bf16's rounding (1e-2 relative), the gradient the optimizer steps with
    pointing the same way, and three more steps lower the loss. Cosine bounds: measured 0.99993 (LoRA), 0.99996
    (full) and 0.9933 (MXFP8: E4M3 elements keep 3 mantissa bits in the forward and both backward GEMMs).
    Negative control: the fp32 gradient of another batch is far from it (measured |cosine| <= 0.04)."""
    kw = {"micro_batch_size": 2, "optim": OptimConfig(lr=1e-3), "lora": LoraConfig(rank=4)}
    ref = policy(hf_checkpoints, mode="lora" if mode == "lora" else "full", dtype="float32", **kw)
    pol = policy(hf_checkpoints, mode=mode, dtype="bfloat16", **kw)
    with torch.no_grad():  # the same adapter init (LoRA's A) on both sides
        for name, t in ref.trainable.items():
            pol.trainable[name].copy_(t)
    batch, other = make_batch(seed=0), make_batch(seed=1)
    want_loss, want = _step_gradient(ref, batch)
    loss, got = _step_gradient(pol, batch)
    cos = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    assert abs(loss - want_loss) <= 1e-2 * abs(want_loss) and cos >= COSINE_BOUND[mode], (loss, want_loss, cos)
    _, elsewhere = _step_gradient(policy(hf_checkpoints, mode="lora" if mode == "lora" else "full", **kw), other)
    assert float(torch.nn.functional.cosine_similarity(got, elsewhere, dim=0)) < 0.5
    for _ in range(3):
        last = pol.train_step(batch, sft_loss)["loss"]
    assert last < loss, (loss, last)


def test_master_grads_are_each_steps_bf16_grads_widened():
    """fp32 masters take each step's bf16 gradients widened exactly (on a CPU into a buffer kept across steps: the
    second step's values, not the first's), and the model's own gradients are dropped."""
    params = {"w": torch.nn.Parameter(torch.randn(4, 6).bfloat16()), "r": torch.nn.Parameter(torch.randn(3))}
    masters = MasterWeights(params)
    assert masters.master["r"] is params["r"] and masters.master["w"].dtype == torch.float32
    seen = []
    for _ in range(2):
        g = torch.randn(4, 6).bfloat16()
        params["w"].grad = g.clone()
        masters.grads_to_master()
        m = masters.master["w"]
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g.float()) and params["w"].grad is None
        seen.append(m.grad.data_ptr())
        m.grad = None  # as a step drops them once it has stepped
    assert seen[0] == seen[1]
