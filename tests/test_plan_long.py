"""``moerl plan`` at real lengths (issue 67): it counts the chunked logits and the recomputed blocks (it traces the
code they run), names the option that makes a run fit, and searches with it. Qwen3-30B-A3B's real shapes, LoRA,
micro-batch 1, expert parallel over 8 x 80 GB."""

import pytest

from moerl.config import load_config
from moerl.plan.plan import Machine, plan, render
from moerl.plan.rank import micro_rows
from moerl.run_config import RunConfig

QWEN3 = ["model.path=qwen3-30b-a3b", "parallel.ep=8", "policy.micro_batch_size=1"]


def _plan(*over: str, gpu_gb: int = 80):
    run = load_config(RunConfig, None, [*QWEN3, *over])
    return plan(run, Machine(8, memory=gpu_gb * 10**9), workers=1)


def test_a_16k_lora_step_that_keeps_its_activations_is_told_the_setting_that_fits():
    p = _plan("rollout.max_model_len=16384")
    assert not p.fits and p.proposal is None and p.option == ("policy.activation_checkpointing=full", None)
    text = render(p)
    assert "verdict: does not fit" in text and "with policy.activation_checkpointing=full: fits on this layout" in text


def test_a_32k_lora_step_with_its_blocks_recomputed_fits():
    p = _plan("rollout.max_model_len=32768", "policy.activation_checkpointing=full")
    assert p.fits, render(p)
    acts = p.roles[0].trace.peak.bytes["activations"]
    # the chunked head holds one 2048-token chunk of 152k-vocabulary logits, never all 32k tokens' (18.5 GiB)
    assert acts < 30 * 2**30, acts / 2**30


def test_the_limit_line_names_what_is_left_to_try():
    """Where even the recomputed blocks do not fit (24 GB GPUs), the limit names the options not taken yet."""
    p = _plan("rollout.max_model_len=16384", "policy.logits_chunk=0", gpu_gb=24)
    assert not p.fits and p.option is None
    line = next(t for t in p.limits if "holds" in t and "of activations" in t)
    assert "policy.activation_checkpointing=full (now none)" in line and "policy.logits_chunk=2048 (now 0" in line
    assert "parallel.cp above 1 (each sequence's tokens split over that many ranks)" in line


@pytest.mark.parametrize(
    ("size", "budget", "length", "rows"), [(8, 0, 128, 8), (0, 4096, 128, 32), (8, 4096, 1024, 4), (0, 4096, 4096, 1)]
)
def test_a_planned_micro_batch_holds_what_the_run_lets_in(size, budget, length, rows):
    over = [f"policy.micro_batch_size={size}", f"policy.max_tokens_per_micro_batch={budget}"]
    run = load_config(RunConfig, None, [*over, f"rollout.max_model_len={length}"])
    assert micro_rows(run) == rows
