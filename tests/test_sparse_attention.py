"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the lightning indexer narrows each query to its index_topk
best keys, in training forwards and in the engine (its keys paged beside MLA's), derived from the config and tensor
names with no bridge file, at fp32 parity with transformers; its weights get no training signal (as transformers
defines it) and stay as loaded in every mode."""

import dataclasses

import pytest
import torch
from hf_models import VOCAB, build_hf_model
from mixer_checks import assert_matches_transformers, assert_packed_sequences_stay_apart, moved, worst_sample

from moerl.bridges import load_model
from moerl.bridges import prove as derived
from moerl.model.transformer import MoEModel

DSA_ARCHS = ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"]
FP32_TOL = 1e-4  # logits against transformers in fp32 (as the other families' parity tests)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's tiny random checkpoint with its attention and indexer projections sharp (the 0.02 init leaves
    every key's index score near the others': the selection would hardly matter)."""
    root = tmp_path_factory.mktemp("dsa")
    out = {}
    for arch in DSA_ARCHS:
        hf = build_hf_model(arch)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(derived.SHARP):
                    p.mul_(8)
        hf.save_pretrained(root / arch)
        out[arch] = (root / arch, hf)
    return out


def _ids(b=2, t=24, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _indexers(model):
    return [layer.self_attn.indexer for layer in model.layers if layer.self_attn.indexer is not None]


SHARED = {"DeepseekV32ForCausalLM": [], "GlmMoeDsaForCausalLM": [1]}  # layers keeping an earlier layer's choice


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_sparse_attention_matches_transformers_with_a_control_per_knob(arch, checkpoints):
    """24 tokens, 4 kept a query: logits within fp32 1e-4 of transformers, the same experts chosen (R3's rows
    unchanged by the indexer). Each knob set wrong misses: another top-k, dense attention, the indexer's rotary
    pairs the other way, its key norm, its per-head weights; GLM-5's shared layer (no indexer of its own) attending
    to every key instead of the ones the layer before chose."""
    path, hf = checkpoints[arch]
    model = load_model(path, dtype=torch.float32)
    shared = SHARED[arch]
    assert model.config.index_topk == 4 and model.config.index_shared_layers == shared
    assert len(_indexers(model)) == model.config.num_layers - len(shared)
    ids = _ids()
    want = assert_matches_transformers(model, hf, ids)

    def rebuilt(**change) -> float:
        off = MoEModel(dataclasses.replace(model.config, **change), torch.float32)
        off.load_state_dict(model.state_dict())
        with torch.no_grad():
            return float((off(ids).logits - want).abs().max())

    interleave = model.config.index_rope_interleave
    assert rebuilt(index_topk=5) > FP32_TOL
    assert rebuilt(index_topk=64) > FP32_TOL  # every key kept: dense attention
    assert rebuilt(index_rope_interleave=not interleave) > FP32_TOL

    assert moved(model, ids, want, lambda: [i.k_norm.bias.add_(0.5) for i in _indexers(model)]) > FP32_TOL
    assert moved(model, ids, want, lambda: [i.weights_proj.weight.mul_(-1) for i in _indexers(model)]) > FP32_TOL
    for i in shared:
        attention = model.layers[i].self_attn
        attention.reuses_keys = False  # dense: the mask every key passes
        with torch.no_grad():
            assert (model(ids).logits - want).abs().max() > FP32_TOL
        attention.reuses_keys = True


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_each_packed_sequence_chooses_among_its_own_keys(arch, checkpoints):
    """Packed sequences and a left-padded row give each sequence's own logits: a query's top-k is taken over the
    keys of its own sequence (control: without sequence numbers it chooses among the first's keys too)."""
    model = load_model(checkpoints[arch][0], dtype=torch.float32)
    assert_packed_sequences_stay_apart(model, first=19, second=13, pad=4, left=7)


@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_the_engine_pages_the_indexer_keys_and_decodes_as_a_full_forward(arch, checkpoints, monkeypatch):
    """fp32, chunked prefill (8 tokens a step), blocks of 4, n=2 samples sharing a prompt, prompts of 3-14 tokens
    sampled for 12 more (up to 26 keys, 4 kept): every sample's logprobs within k3 1e-6 of one full forward of its
    tokens, its routed experts equal. Negative control: an engine that does not store the indexer keys it computes
    (its pool stays zero) misses."""
    from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
    from moerl.engine.kv_cache import StepView

    cfg = EngineConfig(max_num_seqs=6, max_model_len=64, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(checkpoints[arch][0], cfg, dtype=torch.float32)
    pools = [i for i in engine.cache.attention if engine.cache.index[i].shape[1]]  # a pool per indexer layer
    assert pools == [i for i in engine.cache.attention if i not in SHARED[arch]]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (3, 9, 14, 5)]
    requests = [Request(p, SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=i)) for i, p in enumerate(prompts)]

    kl, routed_ok = worst_sample(engine, engine.generate(requests))
    assert kl <= 1e-6 and routed_ok, kl
    assert engine.scheduler.blocks.num_free == engine.cache.num_blocks
    real = StepView.update_index

    def forgetful(self, layer, keys):
        self.cache.index[layer].zero_()
        return real(self, layer, torch.zeros_like(keys))

    monkeypatch.setattr(StepView, "update_index", forgetful)
    kl, routed_ok = worst_sample(engine, engine.generate(requests))
    assert kl > 1e-6 or not routed_ok


@pytest.mark.parametrize("mode", ["full", "lora", "mxfp8"])
@pytest.mark.parametrize("arch", DSA_ARCHS)
def test_a_sparse_attention_model_trains_in_every_mode_with_its_indexer_as_loaded(arch, mode, checkpoints):
    """SFT steps on one batch lower the loss by 15% in each mode (LoRA on the latent attention's projections and the
    experts, MXFP8 on their GEMMs); the indexer's weights, which no loss reaches, stay bit for bit as loaded and
    carry no adapter."""
    if mode == "mxfp8":
        pytest.importorskip("torchao")
    from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
    from moerl.trainer.losses import sft_loss

    path, _ = checkpoints[arch]
    dtype = "bfloat16" if mode == "mxfp8" else "float32"
    policy = Policy(path, PolicyConfig(mode=mode, dtype=dtype, optim=OptimConfig(lr=1e-2)))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if ".indexer." in n}
    assert before and not [n for n in before if "lora" in n]
    ids = torch.randint(4, VOCAB, (4, 20), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids))
    steps = 10 if mode == "lora" else 5  # rank-8 adapters move the loss less a step (measured: 4.63 -> 3.81 in 10)
    losses = [policy.train_step(batch, sft_loss)["loss"] for _ in range(steps)]
    assert losses[-1] < 0.85 * losses[0], losses
    after = {n: p.detach() for n, p in policy.model.named_parameters() if ".indexer." in n}
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    if mode == "lora":
        names = {n for n, _ in policy.model.named_parameters()}
        assert "layers.0.self_attn.q_b_proj.lora.lora_A" in names
        assert not [n for n in names if ".indexer." in n and "lora" in n]


def test_vllm_engines_refuse_sparse_attention_families_by_name(checkpoints):
    """moerl has no fp32-router vLLM model for them: a vLLM engine is refused before vLLM starts, naming it."""
    from moerl.engine import EngineConfig
    from moerl.errors import ConfigError
    from moerl.rollout import make_engine

    for arch in DSA_ARCHS:
        with pytest.raises(ConfigError, match=rf"rollout.engine=vllm with {arch}: moerl has no fp32-router vLLM"):
            make_engine("vllm", checkpoints[arch][0], EngineConfig())


def test_a_shared_indexer_layer_without_an_earlier_choice_is_refused_by_name(checkpoints):
    """A forward that reaches GLM-5's shared layer with no indexer layer run before it (a pipeline stage starting
    there, which the stage split already refuses) stops naming the layer instead of attending to every key."""
    from moerl.errors import ConfigError

    model = load_model(checkpoints["GlmMoeDsaForCausalLM"][0], dtype=torch.float32)
    first = model.layers[0]
    model.layers[0] = torch.nn.Identity()  # another stage's layer: skipped by the forward
    x = torch.randn(1, 6, model.config.hidden_size)
    with pytest.raises(ConfigError, match="layer 1 keeps the keys an earlier indexer layer chose"), torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), hidden=x)
    model.layers[0] = first
