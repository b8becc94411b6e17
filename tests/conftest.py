import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# runs here are compared bit for bit: the thread count stays as set (moerl.cores adapts it to other processes' load;
# tests/test_cores.py turns it on)
os.environ.setdefault("MOERL_CORE_SHARE", "0")
# under pytest-xdist (`make test` runs a worker per core): each worker, and every process it starts, computes on one
# thread, so two workers never put more threads than cores on the machine (OpenMP threads that wait for a
# descheduled one spin: a tiny model's run slows down many times over)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# the files whose tests take longest (BENCHMARKS.md "The suite on this host"), first: workers take files in
# collection order (`--dist loadfile --no-loadscope-reorder`), so the longest start early and no worker ends an hour
# on one alone; the other files follow in their own order
SLOW_FILES = [
    "test_vllm.py",
    "test_process_engines.py",
    "test_ray.py",
    "test_examples.py",
    "test_run_end.py",
    "test_parallel.py",
    "test_compiled_decode.py",
    "test_plan.py",
    "test_gpu_check.py",  # one test of 1.5-3 min (the GPU check's dry run): not the suite's last
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: each file's order is kept


from hf_models import ARCHS, save_hf_model  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _compile_ledger(tmp_path, monkeypatch):
    """Each test prices compilations from an empty ledger of its own (moerl.dynamo): what an earlier test or run
    compiled on this machine does not change what ``auto`` decides here."""
    import moerl.dynamo

    monkeypatch.setattr(moerl.dynamo, "ledger_path", lambda: tmp_path / moerl.dynamo.LEDGER)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> (checkpoint dir, transformers model): one saved tiny random model per architecture."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: (root / arch, save_hf_model(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """A tiny Qwen3-MoE that has seen the easy task for a few supervised steps: it gets some answers right."""
    from run_helpers import EASY
    from transformers import AutoTokenizer

    from moerl.bridges import export_model
    from moerl.envs import make_env
    from moerl.presets import init_model
    from moerl.trainer import OptimConfig, Policy, PolicyConfig
    from moerl.trainer.sft import run_sft

    root = tmp_path_factory.mktemp("warm")
    init_model("qwen3_moe", "tiny", root / "base", seed=0)
    env = make_env("arithmetic", **EASY)
    pol = Policy(
        root / "base", PolicyConfig(mode="full", dtype="float32", micro_batch_size=256, optim=OptimConfig(lr=3e-3))
    )
    run_sft(pol, AutoTokenizer.from_pretrained(root / "base"), env.sft_examples(500, seed=0), steps=25, batch_size=64)
    export_model(pol.model, root / "warm", tokenizer_dir=root / "base")
    return root / "warm"


@pytest.fixture
def four_problems(monkeypatch):
    """Training draws from four fixed easy problems, so a step-to-step rise in reward is learning, not luck."""
    from run_helpers import EASY

    from moerl.envs.arithmetic import ArithmeticEnv

    fixed = ArithmeticEnv(**EASY).problems(4, seed=3)
    held_out = ArithmeticEnv.problems
    monkeypatch.setattr(
        ArithmeticEnv,
        "problems",
        lambda self, n, seed, split="train": (fixed * n)[:n] if split == "train" else held_out(self, n, seed, split),
    )
