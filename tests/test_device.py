"""The device setting, and the engine, the trainer and weight sync on a simulated CUDA device (``tests/simdevice.py``):
CI has no GPU, so device mixing (a tensor made on the CPU meeting the model's device tensors) is caught here, and the
host syncs per decode step and per trainer step are counted."""

from __future__ import annotations

import pytest
import torch
from simdevice import DeviceMixError, SimCuda

from moerl.bridges import load_model
from moerl.config import load_config
from moerl.device import resolve_device
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.errors import ConfigError
from moerl.model.lora import slot_tensors
from moerl.presets import init_model
from moerl.run_config import RunConfig
from moerl.trainer import Batch, Policy, PolicyConfig
from moerl.trainer.sft import sft_loss

FP32_LOGPROBS = 1e-5  # fp32: the device path takes torch._grouped_mm where the CPU path takes a padded bmm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_model("qwen3_moe", "tiny", path)
    return path


# -- the setting ----------------------------------------------------------------------------------------------------


def test_auto_is_cuda_where_present_else_the_cpu():
    want = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cpu:1", "gpu"])
def test_a_device_moerl_does_not_run_on_is_refused_by_key(name):
    with pytest.raises(ConfigError, match=rf"policy\.device='{name}': allowed: auto, cpu, cuda, cuda:N"):
        load_config(RunConfig, None, [f"policy.device={name}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_on_a_host_without_it_is_refused_where_the_policy_is_built(tiny):
    cfg = PolicyConfig(mode="full", dtype="float32", device="cuda")  # the name is fine: the run may go elsewhere
    with pytest.raises(ConfigError, match=r"policy\.device='cuda': this host has no CUDA device.*use policy\.device"):
        Policy(tiny, cfg)


def test_vllm_engines_place_themselves():
    with pytest.raises(ConfigError, match=r"rollout\.device.*native engines only"):
        load_config(RunConfig, None, ["rollout.engine=vllm", "rollout.device=cuda"])


# -- the simulation catches what CUDA refuses ---------------------------------------------------------------------


def test_the_simulated_device_refuses_what_cuda_refuses_and_allows_what_it_allows():
    with SimCuda() as sim:
        x = torch.ones(4, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda and sim.on_device(x)
        assert sim.on_device(x + torch.tensor(2.0))  # a CPU scalar is fine
        assert sim.on_device(x[torch.tensor([0, 2])])  # so is a CPU index
        assert sim.on_device(torch.arange(3, device=x.device)) and not sim.on_device(torch.arange(3))
        with pytest.raises(DeviceMixError, match=r"aten\.add\.Tensor.*CPU tensor\(s\) of shape \(4,\)"):
            x + torch.ones(4)
        with pytest.raises(DeviceMixError, match=r"index_select.*shape \(2,\)"):
            x.index_select(0, torch.tensor([0, 1]))
        host = x.cpu()
        assert not sim.on_device(host) and host.device == torch.device("cpu")
        assert x.sum().item() == 4.0
    assert sum(n for (what, _), n in sim.syncs.items()) == 2  # the copy to the host and the item()


# -- the engine -----------------------------------------------------------------------------------------------------


def _engine_requests() -> list[Request]:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    return [
        Request([1, 2, 3, 4, 5], greedy, adapter="a"),
        Request([6, 7, 8], greedy),
        Request([9, 10, 11, 12], SamplingParams(max_tokens=5, seed=3, n=2, top_p=0.9), adapter="a"),
    ]


def _run_engine(tiny, device: str):
    model = load_model(tiny, dtype=torch.float32, device=device)
    cfg = EngineConfig(max_num_seqs=8, max_model_len=64, max_loras=1, max_lora_rank=4, capture_routing=True)
    engine = LLMEngine(model, cfg)
    gen = torch.Generator().manual_seed(0)
    adapter = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in slot_tensors(engine.model, 0).items()}
    engine.add_adapter("a", adapter)
    return engine, engine.generate(_engine_requests())


def test_the_engine_runs_on_the_device_as_on_the_cpu(tiny):
    _, on_cpu = _run_engine(tiny, "cpu")
    with SimCuda() as sim:
        engine, on_dev = _run_engine(tiny, "cuda")
        assert sim.on_device(engine.cache.k[0]) and sim.on_device(engine.model.lm_head.weight)
    for a, b in zip(on_cpu[:2], on_dev[:2], strict=True):  # greedy: the same tokens, logprobs and experts
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert torch.allclose(ca.logprobs, cb.logprobs, atol=FP32_LOGPROBS, rtol=0)
        assert torch.equal(ca.routed_experts, cb.routed_experts)
    assert len(on_dev[2].outputs) == 2 and all(len(c.token_ids) == 5 for c in on_dev[2].outputs)


def test_a_decode_step_reads_the_device_three_times(tiny):
    # per decode step the host reads: the routed experts (R3 rows), which sampled rows are finite, and the tokens
    # with their logprobs. Anything more is a sync added to the hot path.
    model = load_model(tiny, dtype=torch.float32)
    with SimCuda() as sim:
        engine = LLMEngine(model.to("cuda"), EngineConfig(max_num_seqs=4, max_model_len=64, capture_routing=True))
        engine.generate([Request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))])  # warm: prefill
        sim.syncs.clear()
        steps = 8
        engine.generate([Request([1, 2, 3], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))])
    per_step = sum(sim.syncs.values()) / (steps + 1)  # the prefill's step reads as a decode step does
    assert per_step <= 3, sorted(sim.syncs.items())


def test_a_cpu_index_in_the_engine_step_is_caught(tiny, monkeypatch):
    # negative control: the cache's read rows made on the CPU, as a step that forgot the device would make them
    from moerl.engine import kv_cache

    made = kv_cache.StepView.__init__

    def on_the_cpu(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.read_rows = torch.tensor(self.read_rows.tolist())

    monkeypatch.setattr(kv_cache.StepView, "__init__", on_the_cpu)
    with SimCuda(), pytest.raises(DeviceMixError, match=r"index_select"):
        _run_engine(tiny, "cuda")


def test_the_kv_cache_takes_its_share_of_the_free_device_memory(tiny):
    from moerl.engine.kv_cache import bytes_per_block

    model = load_model(tiny, dtype=torch.float32)
    per_block = bytes_per_block(model.config, 16, torch.float32)
    with SimCuda(free_memory=per_block * 40) as sim:
        model = model.to("cuda")
        cfg = EngineConfig(max_num_seqs=64, max_model_len=64, kv_cache_memory=0.5)  # 64 x 4 blocks by default
        assert LLMEngine(model, cfg).cache.num_blocks == 20  # half of 40 blocks' worth of free memory
        assert LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64)).cache.num_blocks == 8  # fits whole
        sim.free_memory = per_block * 6
        with pytest.raises(ConfigError, match=r"kv_cache_memory=0.5 of 0.00 GiB free on cuda:0: one sequence of"):
            LLMEngine(model, cfg)
    with pytest.raises(ConfigError, match=r"EngineConfig\.kv_cache_memory=0: must lie in \(0, 1\]"):
        EngineConfig(kv_cache_memory=0)


def test_a_rank_4_adapter_in_bf16_takes_the_grouped_gemm_padded(tiny):
    # CUDA's grouped GEMM refuses bf16 K or N that are not multiples of 8 (a rank-4 adapter); the simulation applies
    # that rule, and moerl pads with zeros: the numbers are the CPU path's
    from simdevice import CudaRuleError

    from moerl.model.grouped import Groups, group_mm

    gen = torch.Generator().manual_seed(0)
    keys = torch.tensor([0] * 5 + [2] * 7 + [3] * 4)
    x, w = torch.randn(16, 4, generator=gen).bfloat16(), torch.randn(4, 4, 12, generator=gen).bfloat16()
    want = group_mm(x, w, Groups(keys, 4))  # the CPU's padded bmm
    with SimCuda() as sim:
        xd, wd, kd = x.to("cuda"), w.to("cuda"), keys.to("cuda")
        got = group_mm(xd, wd, Groups(kd, 4))
        assert sim.on_device(got) and got.shape == (16, 12)
        with pytest.raises(CudaRuleError, match=r"K and N multiples of 8, got K=4, N=12"):
            torch._grouped_mm(xd, wd, offs=Groups(kd, 4).offs)  # the control: unpadded, refused
    assert torch.allclose(got.float(), want.float(), atol=0, rtol=2**-7)  # bf16: one rounding of the same sums


# -- the trainer and weight sync ----------------------------------------------------------------------------------


def _batch(model) -> Batch:
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    replay = torch.randint(0, cfg.num_experts, (3, 9, len(cfg.moe_layers), cfg.top_k), generator=gen)
    return Batch(ids, mask, mask.clone(), replay)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("mode", ["lora", "full", "mxfp8"])
def test_a_train_step_on_the_device_is_the_cpu_step(tiny, mode, packing):
    cfg = PolicyConfig(mode=mode, dtype="float32", packing=packing, micro_batch_size=2)
    torch.manual_seed(0)  # the same adapters
    ref = Policy(tiny, PolicyConfig(**{**_fields(cfg), "device": "cpu"}))
    batch = _batch(ref.model)
    want_lp = ref.forward_logprobs(batch)[0]
    want = ref.train_step(batch, sft_loss)
    with SimCuda() as sim:
        torch.manual_seed(0)
        pol = Policy(tiny, PolicyConfig(**{**_fields(cfg), "device": "cuda"}))
        assert sim.on_device(next(iter(pol.trained.values())))
        lp = pol.forward_logprobs(batch)[0]
        got = pol.train_step(batch, sft_loss)
    assert not sim.on_device(lp)  # results come back where the batch came from
    assert torch.allclose(lp, want_lp, atol=FP32_LOGPROBS, rtol=0)
    assert got["loss"] == pytest.approx(want["loss"], abs=FP32_LOGPROBS)
    in_layers = {where: n for (_, where), n in sim.syncs.items() if where.startswith("model/moe.py")}
    assert not in_layers, in_layers  # no host sync inside an MoE layer


def test_a_full_sync_reaches_a_device_engine_with_the_fp32_router_bit_for_bit(tiny):
    from moerl.sync import sync_policy

    with SimCuda() as sim:
        pol = Policy(tiny, PolicyConfig(mode="full", dtype="float32", device="cuda"))
        pol.train_step(_batch(pol.model), sft_loss)
        engine = LLMEngine(load_model(tiny, dtype=torch.float32, device="cuda"), EngineConfig(max_model_len=64))
        sync_policy(pol, engine, version=1)
        router = f"layers.{pol.model.moe_layer_ids[0]}.mlp.router.weight"
        got = engine.model.get_parameter(router)
        assert sim.on_device(got) and got.dtype == torch.float32
        assert torch.equal(got.cpu(), pol.master.master[router].detach().cpu())


def _fields(cfg: PolicyConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__slots__}


def test_an_engine_that_releases_its_cache_between_calls_generates_the_same(tiny):
    reqs = [Request([1, 2, 3], SamplingParams(max_tokens=6, seed=i, n=2)) for i in range(3)]
    kept = LLMEngine(tiny, EngineConfig(max_num_seqs=8, max_model_len=64), dtype=torch.float32)
    released = LLMEngine(tiny, EngineConfig(max_num_seqs=8, max_model_len=64, release_cache=True), dtype=torch.float32)
    assert released.cache.k[0].numel() == 0  # no memory until it generates
    for _ in range(2):  # and the second call starts from a zeroed cache again
        a, b = kept.generate(reqs), released.generate(reqs)
        assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
        pairs = [(c, d) for x, y in zip(a, b, strict=True) for c, d in zip(x.outputs, y.outputs, strict=True)]
        assert all(torch.equal(c.logprobs, d.logprobs) for c, d in pairs)
        assert all(t.numel() == 0 for t in released.cache.k + released.cache.v)
    with pytest.raises(ConfigError, match=r"release_cache=True with compile_decode=True: not built"):
        EngineConfig(release_cache=True, compile_decode=True)


def test_an_engine_on_the_trainers_gpu_releases_its_cache_while_the_trainer_steps():
    from moerl.loop import shares_the_trainers_gpu

    def cfg(*over):
        return load_config(RunConfig, None, ["policy.device=cuda", "rollout.device=cuda", *over])

    with SimCuda():
        assert shares_the_trainers_gpu(cfg())
        assert not shares_the_trainers_gpu(cfg("rollout.placement=process"))  # its own process: its own memory
        assert not shares_the_trainers_gpu(cfg("rollout.compile_decode=true", "policy.mode=full"))
    assert not shares_the_trainers_gpu(load_config(RunConfig, None, ["policy.device=cpu", "rollout.device=cpu"]))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_an_rl_run_on_the_device_trains_and_its_checkpoint_resumes_on_the_cpu(warm_model, tmp_path, mode):
    # rollouts, rewards, logprobs, the step, the sync and the checkpoint, all on the simulated device: any CPU tensor
    # that meets a device one on the way fails the run; the checkpoint it writes is device-free
    from run_helpers import metric_rows, run_cfg

    from moerl.loop import train

    on_device = {"policy.device": "cuda", "rollout.device": "cuda", "env.eval_problems": 4}
    with SimCuda() as sim:
        train(run_cfg(tmp_path, warm_model, mode, steps=2, **on_device))
    rows = [r for r in metric_rows(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == r["loss"] for r in rows)  # finite, both steps
    assert not any(where.startswith("model/moe.py") for _, where in sim.syncs)  # none inside an MoE layer
    train(
        run_cfg(tmp_path, warm_model, mode, steps=3, **{**on_device, "policy.device": "cpu", "rollout.device": "cpu"}),
        resume=True,
    )
    assert [r["step"] for r in metric_rows(tmp_path) if "loss" in r] == [1, 2, 3]
