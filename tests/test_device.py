"""The device setting, and the engine, the trainer and weight sync on a simulated CUDA device (``tests/simdevice.py``):
CI has no GPU, so device mixing (a tensor made on the CPU meeting the model's device tensors) is caught here, and the
host syncs per decode step and per trainer step are counted."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import torch
from run_helpers import stepped_grads
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
    kinds = Counter(what for what, _ in sim.syncs.elements())
    # the CPU index is copied to the device from pageable memory; the move to the host and the item() wait for it
    assert kinds == {
        "pageable host -> device copy (a CPU index)": 1,
        "device -> host copy": 1,
        "Tensor.item": 1,
    }, kinds


@pytest.mark.parametrize(
    "call, syncs",
    [
        (lambda x: x.nonzero(), 1),
        (lambda x: x.unique(), 1),
        (lambda x: torch.bincount(x.long()), 1),
        (lambda x: x[x > 0], 1),  # a boolean index: nonzero
        (lambda x: x.repeat_interleave(x.long().clamp(min=0)), 1),
        (lambda x: x.repeat_interleave(x.long().clamp(min=0), output_size=2), 0),
        (lambda x: x.tolist(), 1),
        (lambda x: bool(x.any()), 1),
        (lambda x: torch.searchsorted(x.sort().values, x), 0),
        (lambda x: x.histc(4, 0, 1), 0),
        (lambda x: x.histc(4), 1),  # its range read from the data
        (lambda x: x + torch.ones(4).to(x.device), 1),  # from pageable memory
        (lambda x: x + torch.ones(4).pin_memory().to(x.device, non_blocking=True), 0),
        (lambda x: x + torch.ones(4).pin_memory().to(x.device), 1),  # pinned, but a blocking copy
        (lambda x: x + torch.empty(4, pin_memory=True).to(x.device, non_blocking=True), 0),
        (lambda x: x + torch.tensor([1.0, 2, 3, 4], device=x.device), 1),  # Python data through the host
        (lambda x: x.to("cpu", torch.float64), 1),
        (lambda x: x.float() * 2, 0),
    ],
)
def test_the_simulated_device_counts_the_host_syncs_cuda_makes(call, syncs):
    with SimCuda() as sim:
        x = torch.tensor([0.5, 0.0, 2.0, 0.25]).to("cuda")
        sim.syncs.clear()  # the move above is one
        call(x)
    assert sum(sim.syncs.values()) == syncs, sim.syncs


@pytest.mark.parametrize(
    "dtype, capability, fallback",
    [
        (torch.bfloat16, (9, 0), False),
        (torch.float32, (9, 0), True),
        (torch.bfloat16, (8, 0), True),
    ],
)
def test_cudas_grouped_gemm_syncs_where_it_falls_back_to_a_loop(monkeypatch, dtype, capability, fallback):
    import simdevice

    monkeypatch.setattr(simdevice, "CAPABILITY", capability)
    with SimCuda() as sim:
        x, w = torch.randn(8, 16, device="cuda", dtype=dtype), torch.randn(2, 16, 8, device="cuda", dtype=dtype)
        offs = torch.tensor([3, 8], dtype=torch.int32).to("cuda")
        sim.syncs.clear()
        torch._grouped_mm(x, w, offs=offs)
    assert sum(sim.syncs.values()) == fallback, sim.syncs


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


# per decode step the host waits for the device once: the tokens with their logprobs, each row's logit sum (the
# finite check) and the routed experts (R3 rows) come back in one copy; the step's inputs go in one pinned,
# non-blocking copy. Anything more is a sync on the hot path
DECODE_READS = {"base": 1, "R3 capture": 1, "LoRA, mixed slots, R3": 1}
# per training step: the gradients' finite check and norm; per micro-batch: the replay's range check, the packing
# plan, the loss and the loss function's two metrics
TRAIN_READS_PER_STEP, TRAIN_READS_PER_MICRO_BATCH = 3, 5


@pytest.fixture(scope="module")
def by_layers(tmp_path_factory):
    """The tiny Qwen3-MoE with 1 and with 3 layers: a host sync per layer shows as a difference."""
    out = {}
    for layers in (1, 3):
        out[layers] = tmp_path_factory.mktemp(f"layers{layers}")
        init_model("qwen3_moe", "tiny", out[layers], overrides={"num_hidden_layers": layers})
    return out


def _decode_reads(path, case: str, steps: int = 8) -> tuple[float, list]:
    """Host syncs per decode step (bf16: CUDA's grouped GEMM has its kernel for bf16 only) of an engine on the
    simulated device in one of DECODE_READS' cases."""
    lora = case.startswith("LoRA")
    cfg = EngineConfig(max_num_seqs=4, max_model_len=64, capture_routing=case != "base")
    if lora:
        cfg = EngineConfig(**{**_fields(cfg), "max_loras": 2, "max_lora_rank": 4})
    with SimCuda() as sim:
        engine = LLMEngine(load_model(path, dtype=torch.bfloat16, device="cuda"), cfg)
        names = (None,)
        if lora:
            gen = torch.Generator().manual_seed(0)
            shapes = slot_tensors(engine.model, 0)
            engine.add_adapter("a", {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in shapes.items()})
            names = ("a", None)  # every step mixes the adapter with the base model

        def run(tokens):
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            return engine.generate([Request([1, 2, 3], params, adapter=names[i % len(names)]) for i in range(2)])

        run(2)  # warm: prefill
        sim.syncs.clear()
        run(steps + 1)
    return sum(sim.syncs.values()) / (steps + 1), sorted(sim.syncs.items())  # a prefill step reads as a decode step


def _over(reads: dict, budget: float) -> str | None:
    """What breaks the rule (the same reads per step whatever the number of layers, and no more than ``budget``),
    naming where the reads are; None when it holds."""
    (one, where_one), (three, where_three) = reads[1], reads[3]
    if one != three:
        return f"1 layer: {where_one}; 3 layers: {where_three}"
    return None if one <= budget else f"{one} reads > {budget}: {where_one}"


@pytest.mark.parametrize("case", list(DECODE_READS))
def test_a_decode_step_reads_the_device_as_often_whatever_the_layers(by_layers, case):
    problem = _over({n: _decode_reads(path, case) for n, path in by_layers.items()}, DECODE_READS[case])
    assert problem is None, problem


def _train_reads(path, mode: str, micro: int) -> tuple[int, list]:
    """Host syncs of one training step (the second: the first sets up) on the simulated device, bf16, four rows in
    micro-batches of ``micro`` rows."""
    with SimCuda() as sim:
        pol = Policy(path, PolicyConfig(mode=mode, dtype="bfloat16", device="cuda", micro_batch_size=micro))
        batch = _batch(pol.model, rows=4)
        pol.train_step(batch, sft_loss)
        sim.syncs.clear()
        pol.train_step(batch, sft_loss)
    return sum(sim.syncs.values()), sorted(sim.syncs.items())


@pytest.mark.parametrize("mode, micro", [("lora", 2), ("full", 2), ("full", 4), ("mxfp8", 2)])
def test_a_train_step_reads_the_device_per_micro_batch_whatever_the_layers(by_layers, mode, micro):
    budget = TRAIN_READS_PER_STEP + TRAIN_READS_PER_MICRO_BATCH * (4 // micro)  # two micro-batches, or one
    problem = _over({n: _train_reads(path, mode, micro) for n, path in by_layers.items()}, budget)
    assert problem is None, problem


def test_a_sync_added_to_every_layer_fails_the_budget(by_layers, monkeypatch):
    # negative control: one host read in each MoE layer's forward (a shape taken from the data) breaks both budgets
    from moerl.model.moe import Experts

    forward = Experts.forward
    monkeypatch.setattr(Experts, "forward", lambda self, x, idx, w: forward(self, x, idx, w) + 0 * bool(idx.max()))
    decode = _over({n: _decode_reads(path, "R3 capture", steps=2) for n, path in by_layers.items()}, 1)
    assert decode is not None and re.search(r"1 layer: .*3 layers: .*model/moe.py", decode), decode
    train = _over({n: _train_reads(path, "full", 2) for n, path in by_layers.items()}, 13)
    assert train is not None and re.search(r"1 layer: .*3 layers: .*model/moe.py", train), train


def test_fp32_experts_on_cuda_take_torchs_per_group_fallback(tiny):
    # the grouped kernel is bf16's: an fp32 engine on CUDA is right (tests above) but reads offsets per GEMM
    with SimCuda() as sim:
        engine = LLMEngine(load_model(tiny, dtype=torch.float32, device="cuda"), EngineConfig(max_model_len=64))
        engine.generate([Request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))])
    assert any("fallback" in what and where.startswith("model/grouped.py") for what, where in sim.syncs)


def test_a_cpu_index_in_the_engine_step_is_caught(tiny, monkeypatch):
    # negative control: the cache's read rows made on the CPU, as a step that forgot the device would make them
    from moerl.engine import kv_cache

    made = kv_cache.StepView._reads

    def on_the_cpu(self, heads):
        return torch.tensor(made(self, heads).tolist())

    monkeypatch.setattr(kv_cache.StepView, "_reads", on_the_cpu)
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
        with pytest.raises(CudaRuleError, match=r"K and N multiples of 8\), mat_a \(16, 4\) has strides \(4, 1\)"):
            torch._grouped_mm(xd, wd, offs=Groups(kd, 4).offs)  # the control: unpadded, refused
    assert torch.allclose(got.float(), want.float(), atol=0, rtol=2**-7)  # bf16: one rounding of the same sums


# -- the trainer and weight sync ----------------------------------------------------------------------------------


def _batch(model, rows: int = 3) -> Batch:
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows, 10), generator=gen)
    mask = torch.ones(rows, 10, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    replay = torch.randint(0, cfg.num_experts, (rows, 9, len(cfg.moe_layers), cfg.top_k), generator=gen)
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
    from moerl.build import shares_the_trainers_gpu

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


# -- layouts a GPU host cannot hold ---------------------------------------------------------------------------------


def test_trainer_ranks_that_would_share_a_gpu_are_refused_before_any_group_forms(monkeypatch):
    from moerl.parallel.world import init_world, mesh_device

    with SimCuda():  # one GPU
        assert mesh_device("auto", 1) == "cuda" and mesh_device("cuda", 1) == "cuda"
        assert mesh_device("cpu", 4) == "cpu"  # a CPU policy on a GPU host: a CPU mesh, gloo only
        with pytest.raises(ConfigError, match=r"2 trainer ranks on this node, which has 1 CUDA device\(s\)"):
            mesh_device("auto", 2)
        with pytest.raises(ConfigError, match=r"policy\.device='cuda:0' with 2 trainer ranks.*use policy\.device=auto"):
            mesh_device("cuda:0", 2)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr("torch.distributed.init_process_group", None)  # it must not be reached
        with pytest.raises(ConfigError, match=r"2 trainer ranks on this node"):
            init_world(dp=2, device="auto")
    with pytest.raises(ConfigError, match=r"policy\.device='cuda': this host has no CUDA device"):
        mesh_device("cuda", 1)


def test_a_cpu_policy_on_a_gpu_host_joins_a_gloo_group_and_a_cpu_mesh(tmp_path):
    # a real process group (one rank of a launch) on the simulated one-GPU host, in a process of its own
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import torch.distributed as dist\n"
        "from simdevice import SimCuda\n"
        "from moerl.parallel.world import init_world\n"
        "with SimCuda():\n"
        "    world = init_world(device='cpu')\n"
        "    print(world.mesh.device_type, dist.get_backend(), world.size)\n"
        "    dist.destroy_process_group()\n"
    )
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["cpu", "gloo", "1"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_broadcast_group_on_one_gpu_is_refused_by_name():
    from moerl.rollout.pool import one_rank_per_gpu

    one_rank_per_gpu([("the trainer", "GPU-a"), ("rollout engine 0", "GPU-b"), ("rollout engine 1", None)])
    with pytest.raises(ConfigError, match=r"the trainer and rollout engine 1 .* are on one GPU \(GPU-a\).*cuda_ipc"):
        one_rank_per_gpu(
            [("the trainer", "GPU-a"), ("rollout engine 0", "GPU-b"), ("rollout engine 1 (pid 7)", "GPU-a")]
        )
    with SimCuda():  # the id an engine reports: its GPU's UUID
        from moerl.device import gpu_id

        assert gpu_id("cuda:0") == "GPU-simulated-0" and gpu_id("cpu") is None


def test_the_trainers_expert_lora_runs_in_bf16_on_cudas_grouped_kernel_with_fp32_masters(tiny):
    # CUDA's grouped GEMM has its kernel for bf16 only: the fp32 factors are cast into the bf16 GEMMs (no per-group
    # fallback), their gradients and the optimizer stay fp32. Against the CPU's fp32 LoRA GEMMs: bf16 logprobs
    # within 0.03 (0.004 measured); negative control: the adapters off move them by ~0.7
    def build(device: str) -> Policy:
        torch.manual_seed(0)
        pol = Policy(tiny, PolicyConfig(mode="lora", dtype="bfloat16", device=device, micro_batch_size=2))
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # adapters that matter (B starts at zero)
            for _, p in sorted(pol.trainable.items()):
                p.add_((torch.randn(p.shape, generator=gen) * 0.1).to(p.device))
        return pol

    ref = build("cpu")
    batch = _batch(ref.model)
    want, off = ref.forward_logprobs(batch)[0], ref.forward_logprobs(batch, reference=True)[0]
    with SimCuda() as sim:
        pol = build("cuda")
        got = pol.forward_logprobs(batch)[0]
        sim.syncs.clear()
        grads = stepped_grads(pol)
        pol.train_step(batch, sft_loss)
        experts = {n: p for n, p in pol.trainable.items() if ".experts.lora." in n}
        assert experts and all(p.dtype == grads[n].dtype == torch.float32 for n, p in experts.items())
    assert not [where for what, where in sim.syncs if "fallback" in what]
    real = batch.attention_mask.bool()
    assert float((got - want)[real].abs().max()) < 0.03 < float((off - want)[real].abs().max())
