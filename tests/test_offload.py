"""``policy.cpu_offload`` (issue 67 part 6): a full fine-tune's fp32 masters, their gradients and the optimizer state
in host memory, the optimizer stepping there, the weights on the device in the compute dtype. On the simulated device
(``tests/simdevice.py``) the offloaded step is the plain one and its state is where it should be; the data-parallel
path (FSDP2's CPUOffloadPolicy) is a case of ``tests/test_parallel.py``; the plan counts host memory apart."""

from __future__ import annotations

import pytest
import torch
from simdevice import SimCuda

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.plan.plan import Machine, _with_option, plan, plan_dtype
from moerl.plan.rank import trace_rank
from moerl.presets import init_model
from moerl.run_config import RunConfig
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.sft import sft_loss


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_model("qwen3_moe", "tiny", path)
    return path


def _batch(cfg) -> Batch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    return Batch(ids, mask, mask.clone())


def _steps(path, offload: bool, lr: float = 1e-2, check=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two bf16 full-mode steps on the simulated device: the losses and the fp32 masters after them (on the host);
    ``check(policy, sim)`` runs on the device's state after the steps."""
    with SimCuda() as sim:
        cfg = PolicyConfig(mode="full", dtype="bfloat16", device="cuda", micro_batch_size=2, cpu_offload=offload,
                           optim=OptimConfig(lr=lr))  # fmt: skip
        pol = Policy(path, cfg)
        batch = _batch(pol.model.config)
        losses = [pol.train_step(batch, sft_loss)["loss"] for _ in range(2)]
        if check is not None:
            check(pol, sim)
        masters = {n: m.detach().cpu().clone() for n, m in pol.master.master.items()}
    return losses, masters


def test_an_offloaded_step_is_the_plain_step_with_its_state_in_host_memory(tiny):
    def placed(pol, sim) -> None:
        masters = pol.master.master
        assert masters and not any(sim.on_device(m) for m in masters.values())
        assert all(m.is_pinned() for m in masters.values())  # copies back to the device need not wait
        assert all(m is not p for m, p in zip(masters.values(), pol.trainable.values(), strict=True))  # routers too
        state = [v for st in pol.optimizer.state.values() for v in st.values() if v.numel() > 1]
        assert len(state) == 2 * len(masters) and not any(sim.on_device(v) for v in state)
        weights = [p for n, p in pol.trainable.items() if ".router." not in n]
        assert all(sim.on_device(p) and p.dtype == torch.bfloat16 for p in weights)
        assert all(p.grad is None for p in (*masters.values(), *pol.trainable.values()))  # dropped after the step

    plain, want = _steps(tiny, False)
    offloaded, got = _steps(tiny, True, check=placed)
    assert offloaded == pytest.approx(plain, rel=1e-7)
    # the same AdamW on the same fp32 values, on the host instead of the (simulated) device: equal up to rounding
    off = max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)
    assert off <= 1e-6, off
    # control: a learning rate 1% off moves the masters far beyond that
    _, other = _steps(tiny, True, lr=1.01e-2)
    assert max(float((other[n] - want[n]).abs().max() / want[n].abs().max()) for n in want) > 1e-4


def test_an_offloaded_checkpoint_resumes_in_a_plain_policy_and_back(tiny, tmp_path):
    """The state in host memory is the state: a checkpoint of an offloaded policy on the device loads into a plain
    policy on the CPU with the same masters and moments, and back into an offloaded one."""
    from moerl.trainer.checkpoint import load_checkpoint, save_checkpoint

    def state(pol) -> dict[str, torch.Tensor]:
        moments = {f"{i}/{k}": v for i, st in pol.optimizer.state_dict()["state"].items() for k, v in st.items()}
        return {n: m.detach().cpu().clone() for n, m in pol.master.master.items()} | moments

    def policy(offload: bool, device: str) -> Policy:
        return Policy(tiny, PolicyConfig(mode="full", dtype="bfloat16", device=device, cpu_offload=offload))

    with SimCuda():
        pol = policy(True, "cuda")
        pol.train_step(_batch(pol.model.config), sft_loss)
        save_checkpoint(tmp_path / "a", pol)
        want = state(pol)
    plain = policy(False, "cpu")
    load_checkpoint(tmp_path / "a", plain)
    got = state(plain)
    assert got.keys() == want.keys() and all(torch.equal(got[k].cpu(), want[k].cpu()) for k in want)
    save_checkpoint(tmp_path / "b", plain)
    with SimCuda() as sim:
        back = policy(True, "cuda")
        load_checkpoint(tmp_path / "b", back)
        assert not any(sim.on_device(m) for m in back.master.master.values())
        again = state(back)
    assert all(torch.equal(again[k].cpu(), want[k].cpu()) for k in want)


def test_offloading_adapters_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"PolicyConfig.cpu_offload=True: with policy.mode=lora: not built"):
        PolicyConfig(mode="lora", cpu_offload=True)


def test_the_plan_counts_offloaded_state_in_host_memory_and_names_the_option():
    """Qwen3-30B-A3B's real shapes, full mode at 16384 tokens with its blocks recomputed, ep 8 on 8 x 80 GB: the
    masters and optimizer state (42 GiB a rank) do not fit beside the step; offloaded, they are counted as host memory
    and the run fits. Asked without the option, the plan names it."""
    over = ["model.path=qwen3-30b-a3b", "policy.mode=full", "parallel.ep=8", "policy.micro_batch_size=1",
            "rollout.max_model_len=16384", "policy.activation_checkpointing=full"]  # fmt: skip
    gpus = Machine(8, memory=80 * 10**9)
    run = load_config(RunConfig, None, over)
    plain = plan(run, gpus, propose=False)
    assert not plain.fits
    # what plan() asks where no layout of the run's own settings fits (the layout search left out: it finds none)
    tracer = lambda cfg, run, ranks, hf: [trace_rank(cfg, run, r, hf) for r in ranks]  # noqa: E731
    assert _with_option(plan_dtype(run), gpus, False, tracer) == ("policy.cpu_offload=true", None)
    offloaded = plan(load_config(RunConfig, None, [*over, "policy.cpu_offload=true"]), gpus, propose=False)
    assert offloaded.fits
    was, now = plain.roles[0].trace.peak.bytes, offloaded.roles[0].trace.peak.bytes
    assert now["masters"] == now["optimizer"] == 0 and was["host"] == 0
    assert now["host"] >= was["masters"] + was["optimizer"]  # and FSDP's shards of the non-expert weights
    assert offloaded.roles[0].need <= plain.roles[0].need - (was["masters"] + was["optimizer"])
