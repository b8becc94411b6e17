"""What a plan of a GPU run counts that a CPU run does not hold (found on the first GPU run, an H200: the plan of a
small full step 17% over the measured peak, a LoRA one under it): CUDA's fused RMSNorm keeps the input and an fp32
reciprocal RMS per row where torch's CPU composite keeps fp32 copies (moerl's own CPU norm, its output alone), and
cuBLAS keeps a workspace for each thread that runs GEMMs on the device."""

import pytest
import torch
import torch.nn.functional as F

from moerl.cpu.training import FusedRMSNorm
from moerl.device import gpu_paths
from moerl.model.norms import RMSNorm
from moerl.plan.fake import Shapes
from moerl.plan.memory import Memory

ROWS, DIM = 32, 64


def _kept_by_a_norm(gpu: bool, weight_dtype: torch.dtype = torch.bfloat16, fused: bool = True) -> tuple[int, tuple]:
    """Bytes a planned RMSNorm's forward leaves alive (its output and what its backward keeps) on a bf16 input that is
    already held, and the shapes its backward gives."""
    with Shapes(), gpu_paths() if gpu else torch.enable_grad():
        norm = (FusedRMSNorm if fused else RMSNorm)(DIM, 1e-6)  # a trainer's on a CPU: the fused one
        norm.weight = torch.nn.Parameter(torch.ones(DIM, dtype=weight_dtype))
        x = torch.randn(ROWS, DIM, dtype=torch.bfloat16, requires_grad=True)
        with Memory({"weights": [norm.weight], "activations": [x]}) as memory:
            before = memory.now.bytes["activations"]
            y = norm(x)
            kept = memory.now.bytes["activations"] - before
        x_grad, w_grad = torch.autograd.grad(y.float().sum(), [x, norm.weight])
        return kept, (tuple(x_grad.shape), x_grad.dtype, tuple(w_grad.shape), w_grad.dtype)


def test_a_planned_gpu_norm_keeps_its_output_and_an_fp32_rms_per_row():
    kept, grads = _kept_by_a_norm(gpu=True)
    # CUDA's _fused_rms_norm: the output in the input's dtype, the reciprocal RMS [rows, 1] in fp32; its backward keeps
    # the input (held already), the weight and that RMS
    assert kept == ROWS * DIM * 2 + ROWS * 4
    assert grads == ((ROWS, DIM), torch.bfloat16, (DIM,), torch.bfloat16)


def test_the_cpus_norm_keeps_another_amount_so_the_gpu_count_is_a_different_path():
    """The CPU trainer's RMSNorm (``moerl.cpu.training``, where its kernels build) keeps nothing beyond its output for
    the backward (the input and the weight are held already); torch's composite, where they do not, keeps at least an
    fp32 copy of the input; CUDA's fused kernel keeps its output and an fp32 RMS a row: three counts, a plan takes the
    one its run takes."""
    from moerl.cpu.kernels import kernel

    cpu, grads = _kept_by_a_norm(gpu=False)
    gpu, _ = _kept_by_a_norm(gpu=True)
    assert grads == ((ROWS, DIM), torch.bfloat16, (DIM,), torch.bfloat16)
    if kernel() is not None:
        assert cpu == ROWS * DIM * 2 and gpu == cpu + ROWS * 4
    composite, grads = _kept_by_a_norm(gpu=False, fused=False)  # the plain norm, as where the kernels do not build
    assert composite >= gpu + ROWS * DIM * 4  # at least an fp32 copy of the input more
    assert grads == ((ROWS, DIM), torch.bfloat16, (DIM,), torch.bfloat16)


def test_a_norm_whose_weight_dtype_differs_takes_the_composite_on_cuda_too():
    # aten.rms_norm's dispatch: a weight in another dtype than the input cannot take the fused kernel
    mixed, _ = _kept_by_a_norm(gpu=True, weight_dtype=torch.float32)
    fused, _ = _kept_by_a_norm(gpu=True)
    assert mixed > fused


def test_a_planned_gpu_norm_without_a_weight_is_fused():
    with Shapes(), gpu_paths():
        x = torch.randn(ROWS, DIM, dtype=torch.bfloat16, requires_grad=True)
        with Memory({"activations": [x]}) as memory:
            before = memory.now.bytes["activations"]
            y = F.rms_norm(x, (DIM,), None, 1e-6)
            kept = memory.now.bytes["activations"] - before
        (g,) = torch.autograd.grad(y.float().sum(), [x])
    assert kept == ROWS * DIM * 2 + ROWS * 4 and g.shape == x.shape


@pytest.mark.parametrize("gpu", [True, False])
def test_a_gpu_ranks_plan_holds_cublas_workspaces_for_its_two_gemm_threads(gpu):
    from moerl.config import load_config
    from moerl.plan.rank import GEMM_THREADS, gemm_workspace, trace_rank
    from moerl.presets import preset_config
    from moerl.run_config import RunConfig

    hf, cfg = preset_config("qwen3_moe", "tiny")
    rows = ["policy.micro_batch_size=8", "policy.max_tokens_per_micro_batch=0"]  # a small step: 8 x 64 tokens
    run = load_config(RunConfig, None, ["policy.mode=full", "rollout.max_model_len=64", *rows])
    trace = trace_rank(cfg, run, 0, hf, gpu=gpu)
    workspaces = GEMM_THREADS * gemm_workspace((9, 0))
    assert workspaces == 64 * 2**20  # measured on an H200: a step's first GEMMs in a process made 64 MiB
    held = (trace.peak.bytes["activations"], trace.end.bytes["activations"], trace.sync.bytes["activations"])
    if gpu:  # at the peak, after the step and through the sync that follows
        assert all(b >= workspaces for b in held), held
    else:  # the CPU has none (and the tiny step's own activations are far below it)
        assert all(b < workspaces for b in held), held
