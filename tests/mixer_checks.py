"""Checks the token mixers' tests share (recurrent states, indexers): packed rows keep their sequences apart, the
engine's samples against full forwards, a knob moved off its loaded value."""

import torch
from hf_models import VOCAB

FP32_TOL = 1e-4


def _ids(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


def assert_packed_sequences_stay_apart(model, first: int = 23, second: int = 14, pad: int = 5, left: int = 9) -> None:
    """Two sequences packed in one row (attention_mask 1, 1, ..., 2, 2, ..., 0 padding) give each sequence's own
    logits, as does a left-padded row (fp32 1e-4). Negative control: the same row without sequence numbers lets the
    second sequence see the first (one state through both, or keys chosen among both)."""
    a, b = _ids(first, 5), _ids(second, 6)
    n = first + second
    with torch.no_grad():
        alone = [model(x).logits[0] for x in (a, b)]
        row = torch.cat([a, b, torch.zeros(1, pad, dtype=torch.long)], 1)
        mask = torch.tensor([[1] * first + [2] * second + [0] * pad])
        pos = torch.cat([torch.arange(first), torch.arange(second), torch.zeros(pad, dtype=torch.long)])[None]
        packed = model(row, positions=pos, attention_mask=mask).logits[0]
        assert (packed[:first] - alone[0]).abs().max() <= FP32_TOL
        assert (packed[first:n] - alone[1]).abs().max() <= FP32_TOL
        padded = torch.cat([torch.zeros(1, left, dtype=torch.long), b], 1)
        lmask = torch.tensor([[0] * left + [1] * second])
        lpos = torch.cat([torch.zeros(left, dtype=torch.long), torch.arange(second)])[None]
        out = model(padded, positions=lpos, attention_mask=lmask).logits[0, left:]
        assert (out - alone[1]).abs().max() <= FP32_TOL
        joined = model(row[:, :n]).logits[0]
        assert (joined[first:n] - alone[1]).abs().max() > FP32_TOL


def assert_matches_transformers(model, hf, ids) -> torch.Tensor:
    """moerl's logits for ``ids`` within fp32 1e-4 of transformers' model ``hf``, every MoE layer's experts equal
    (R3's rows); returns transformers' logits."""
    from hf_models import hf_router_choices

    want, choices = hf_router_choices(hf, ids)
    with torch.no_grad():
        out = model(ids, capture=True)
    assert (out.logits - want).abs().max() <= FP32_TOL
    for j, choice in enumerate(choices):
        ours = out.routed[:, :, j].reshape(-1, model.config.top_k)
        assert torch.equal(ours.sort(-1).values, choice.sort(-1).values), f"MoE layer {j} chose other experts"
    return want


def assert_left_padded_rows_match(model, hf) -> None:
    """A left-padded row (its positions from 0 at its first token) beside a full one: every real token's logits of
    ``model`` within fp32 1e-4 of transformers' ``hf`` given the same mask and positions."""
    ids = token_ids(t=24)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, positions=positions, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() <= FP32_TOL


def worst_sample(engine, outs, temperature: float = 0.8) -> tuple[float, bool]:
    """The largest k3 of any sample of ``outs`` against a full forward of its tokens, and whether every sample's
    routed experts equal that forward's."""
    from test_engine import full_forward_check

    checks = [
        full_forward_check(engine.model, type(out)(out.request_id, out.prompt_token_ids, [c], 0), temperature)
        for out in outs
        for c in out.outputs
    ]
    return max(kl for kl, _ in checks), all(ok for _, ok in checks)


def moved(model, ids, want, change) -> float:
    """How far ``model``'s logits for ``ids`` move from ``want`` with ``change()`` applied to its parameters (they
    are restored after)."""
    with torch.no_grad():
        saved = {n: p.clone() for n, p in model.named_parameters()}
        change()
        off = model(ids).logits
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return float((off - want).abs().max())


def assert_engine_states_follow_full_forwards(path, monkeypatch, layers: list[int], state_shape: tuple) -> None:
    """fp32: chunked prefill (8 tokens a step), blocks of 4, n=2 samples sharing a prompt (the second copies the
    prompt's conv window and state), prompts of several lengths: every sample's logprobs within k3 1e-6 of one full
    forward of its tokens, its routed experts equal (R3's rows); every state slot comes back; the recurrent
    ``layers`` hold slots of ``state_shape``. Negative control: samples that do not copy the prompt's state miss."""
    from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
    from moerl.engine.kv_cache import LinearStates

    cfg = EngineConfig(max_num_seqs=6, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(path, cfg, dtype=torch.float32)
    assert sorted(engine.cache.states.state) == layers and engine.cache.states.state[layers[0]].shape[1:] == state_shape
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (3, 9, 14, 5)]
    requests = [Request(p, SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=i)) for i, p in enumerate(prompts)]

    kl, routed_ok = worst_sample(engine, engine.generate(requests))
    assert kl <= 1e-6 and routed_ok, kl
    assert len(engine.cache.states.free) == cfg.max_num_seqs
    monkeypatch.setattr(LinearStates, "copy", lambda self, src, dst: None)
    kl, routed_ok = worst_sample(engine, engine.generate(requests))
    assert kl > 1e-6 or not routed_ok


def sft_losses(path, mode: str, steps: int = 10):
    """The losses of ``steps`` SFT steps on one batch of 4 x 20 tokens (lr 1e-2; MXFP8 in bf16, else fp32) and the
    policy."""
    from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
    from moerl.trainer.losses import sft_loss

    dtype = "bfloat16" if mode == "mxfp8" else "float32"
    policy = Policy(path, PolicyConfig(mode=mode, dtype=dtype, optim=OptimConfig(lr=1e-2)))
    ids = torch.randint(4, VOCAB, (4, 20), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))
    return [policy.train_step(batch, sft_loss)["loss"] for _ in range(steps)], policy


def assert_vllm_and_compiled_decode_refuse(path, arch: str) -> None:
    """A vLLM engine and the compiled decode step refuse a model with recurrent layers, by name."""
    import pytest

    from moerl.engine import EngineConfig, LLMEngine
    from moerl.errors import ConfigError
    from moerl.rollout import make_engine

    with pytest.raises(ConfigError, match=rf"rollout.engine=vllm with {arch}: moerl has no fp32-router vLLM model"):
        make_engine("vllm", path, EngineConfig())
    with pytest.raises(ConfigError, match=r"compile_decode with recurrent layers \(Gated DeltaNet, Mamba\)"):
        LLMEngine(path, EngineConfig(max_num_seqs=2, max_model_len=32, compile_decode=True))


def live_mamba_checkpoint(path, arch: str, sharpen: tuple[str, ...]):
    """A tiny transformers ``arch`` saved to ``path`` with a conv and decays that matter (the 0.02 init leaves the
    conv near zero: x, B and C would hardly depend on the tokens) and the weights named by ``sharpen`` x5; returns
    (path, the transformers model)."""
    from hf_models import build_hf_model

    hf = build_hf_model(arch)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("conv1d.weight", "A_log")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith(sharpen):
                p.mul_(5)
    hf.save_pretrained(path)
    return path, hf


def mixers_of(model, kind: str) -> list:
    """The mixers of ``model``'s layers of ``kind`` (``ModelConfig.layer_types``)."""
    return [layer.self_attn for layer, k in zip(model.layers, model.config.layer_types, strict=True) if k == kind]


def token_ids(b: int = 2, t: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def assert_trains(path, mode: str, adapter: str | None = None):
    """Ten SFT steps on one batch (``sft_losses``) lower the loss in ``mode``: LoRA by 0.1, the others to 0.85 of the
    first; in LoRA the adapter ``adapter`` (a parameter name) is there. Returns the policy (MXFP8 without torchao: a
    skip)."""
    import pytest

    if mode == "mxfp8":
        pytest.importorskip("torchao")
    losses, policy = sft_losses(path, mode)
    assert losses[-1] < (losses[0] - 0.1 if mode == "lora" else 0.85 * losses[0]), losses
    if mode == "lora" and adapter is not None:
        assert adapter in {n for n, _ in policy.model.named_parameters()}
    return policy


def assert_recomputed_step_is_plain(path, mode: str) -> None:
    """Activation checkpointing: a step whose blocks are computed again in the backward gives the plain step's loss,
    gradient norm and every gradient (fp32 1e-6 of each tensor's largest element), R3 on
    (``tests/test_checkpointing.py``'s step)."""
    from test_checkpointing import TOL, _off, _step

    plain, want = _step(path, mode, "none", True)
    stats, got = _step(path, mode, "full", True)
    assert abs(stats["loss"] - plain["loss"]) <= TOL * abs(plain["loss"]) + 1e-9
    assert abs(stats["grad_norm"] - plain["grad_norm"]) <= TOL * plain["grad_norm"]
    assert _off(got, want) <= TOL, _off(got, want)


def model_with(model, **fields):
    """A model of ``model``'s config with ``fields`` set otherwise, holding its weights and buffers (fp32): a knob
    turned wrong for a negative control."""
    import dataclasses

    from moerl.model.transformer import MoEModel

    off = MoEModel(dataclasses.replace(model.config, **fields), torch.float32)
    off.load_state_dict(model.state_dict())
    return off
