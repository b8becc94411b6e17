"""The CPU backend (``moerl/cpu/``) switched off and on: with ``MOERL_CPU_KERNELS=0`` an engine and a trainer of the
same checkpoint hold the model's plain modules alone (torch's paths); with it on, the backend's modules, and the
results of both match those torch paths within fp32 round-off. And ``moerl/model/`` never imports the backend."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import stepped_grads
from safetensors.torch import load_file, save_file
from test_packing import ragged_batch

from moerl.cpu.kernels import kernel
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.presets import init_model
from moerl.trainer import OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import sft_loss

HERE = Path(__file__).resolve().parent
PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 42, 43], [7, 7, 8], [11, 12, 60, 61, 62, 63]]


def backend_modules(model: torch.nn.Module) -> set[str]:
    """The classes of ``model``'s modules that are the CPU backend's."""
    return {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("moerl.cpu")}


def run(ckpt: str, out: str, perturb: float = 1.0) -> None:
    """Decode the prompts (seeded sampling, fp32, routing captured) and take one full fp32 training step with R3
    replay; write the tokens, logprobs, chosen experts and the stepped gradients to ``out`` (safetensors) and the
    step's loss and gradient norm, and which backend modules each model holds, beside it (json). ``perturb``: one
    expert weight scaled by it first (a control)."""
    torch.manual_seed(0)
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=4, max_model_len=48, capture_routing=True), torch.float32)
    with torch.no_grad():
        engine.model.layers[0].mlp.experts.down_proj[1].mul_(perturb)
    reqs = [Request(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i)) for i, p in enumerate(PROMPTS)]
    tensors = {}
    for i, o in enumerate(engine.generate(reqs)):
        got = o.outputs[0]
        tensors |= {f"tokens.{i}": torch.tensor(got.token_ids), f"logprobs.{i}": got.logprobs}
        tensors[f"routed.{i}"] = got.routed_experts
    policy = Policy(ckpt, PolicyConfig(mode="full", dtype="float32", micro_batch_size=5, optim=OptimConfig(lr=1e-2)))
    with torch.no_grad():
        policy.model.layers[0].mlp.experts.down_proj[1].mul_(perturb)
    grads = stepped_grads(policy)
    stats = policy.train_step(ragged_batch(replay_of=policy.model), sft_loss, temperature=0.7)
    tensors |= {f"grad.{n}": g for n, g in grads.items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)
    seen = {"engine": sorted(backend_modules(engine.model)), "trainer": sorted(backend_modules(policy.model))}
    Path(out).with_suffix(".json").write_text(json.dumps({**seen, "loss": stats["loss"], "norm": stats["grad_norm"]}))


def _results(out: Path) -> tuple[dict, dict]:
    return load_file(str(out)), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.skipif(kernel() is None, reason="the kernels do not build here: the backend is off in any case")
def test_the_backend_switched_off_runs_torchs_paths_and_on_matches_them(tmp_path):
    """Engine and trainer in a process with ``MOERL_CPU_KERNELS=0``: no module of the backend in either model (the
    torch paths), and in this one, the backend on, its modules in both. On against off, fp32: the same sampled tokens
    and chosen experts, logprobs within 1e-5 (the kernels sum in another order), the training loss within 1e-6 (the
    forward is torch's ops in both), the gradient norm and each stepped gradient within 1e-5 of the largest (the
    fused backward sums in fp32 in another order; measured: logprobs 4.8e-7, gradients 7.4e-7, loss and norm equal).
    The control: one expert weight 1% off on the side of the backend moves them past those tolerances (measured
    1.1e-4 and 6.8e-3)."""
    ckpt = tmp_path / "tiny"
    init_model("qwen3_moe", "tiny", ckpt, seed=2)
    off = tmp_path / "off.safetensors"
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_cpu_backend as t; t.run({str(ckpt)!r}, "
    code += f"{str(off)!r})"
    env = os.environ | {"MOERL_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    want, off_seen = _results(off)
    assert off_seen["engine"] == [] and off_seen["trainer"] == []

    def compare(perturb: float) -> tuple[float, float]:
        on = tmp_path / f"on{perturb}.safetensors"
        run(str(ckpt), str(on), perturb)
        got, seen = _results(on)
        assert {"KernelAttention", "KernelExperts", "KernelLinear", "KernelRMSNorm"} <= set(seen["engine"])
        assert seen["trainer"] == ["FusedAttention", "FusedRMSNorm"]
        logprobs = max((got[k] - want[k]).abs().max().item() for k in want if k.startswith("logprobs"))
        grads = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want if k[:5] == "grad.")
        if perturb == 1.0:
            assert all(torch.equal(got[k], want[k]) for k in want if k.startswith(("tokens", "routed")))
            assert abs(seen["loss"] - off_seen["loss"]) <= 1e-6
            assert abs(seen["norm"] - off_seen["norm"]) <= 1e-5 * off_seen["norm"]
        return logprobs, grads

    logprobs, grads = compare(1.0)
    assert logprobs <= 1e-5 and grads <= 1e-5, (logprobs, grads)
    logprobs, grads = compare(1.01)
    assert logprobs > 1e-5 and grads > 1e-5, (logprobs, grads)


def test_the_model_package_never_imports_the_backend():
    """No module of ``moerl/model/`` imports ``moerl.cpu`` (or anything in it), at its top or inside a function:
    the backend is swapped in from outside."""
    found = []
    for path in sorted((HERE.parent / "moerl" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n == "moerl.cpu" or n.startswith("moerl.cpu.")]
    assert found == []


def test_the_model_package_never_asks_whether_it_is_compiled():
    """No module of ``moerl/model/`` calls ``is_compiling()``: a graph's form of an op is registered beside it
    (``torch.compiler.substitute_in_graph``) or swapped in by whoever compiles, not chosen inside the model."""
    found = []
    for path in sorted((HERE.parent / "moerl" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "is_compiling":
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
