"""``moerl plan`` on bad input: a size, bandwidth or GPU count it cannot plan for is one named line (exit 2, nothing
printed on stdout); a context window the model does not have is refused by the rule ``moerl train`` meets; the
layout search answers for every GPU count it accepts, however little memory a GPU has."""

import math
import subprocess
import sys

import pytest

from moerl.cli import main
from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.plan.limits import MAX_GPUS, at_rest_floor, candidates, why_none_fits
from moerl.plan.plan import Machine
from moerl.presets import init_model, preset_config
from moerl.run_config import RunConfig


def _plan(*argv: str) -> subprocess.CompletedProcess:
    """``moerl plan`` as a user runs it; the timeout only stops a hang (the search used to run for hours)."""
    args = [sys.executable, "-m", "moerl.cli", "plan", *argv, "--workers", "1"]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--gpu-memory", "1.2.3GB"], "--gpu-memory '1.2.3GB': a size such as 80GB, 141GB or 96GiB"),
        (["--gpu-memory=-80GB"], "--gpu-memory '-80GB': a size such as 80GB, 141GB or 96GiB"),
        (["--gpu-memory", "0GB"], "--gpu-memory '0GB': must be at least 1 byte"),
        (["--gpu-memory", "0.4"], "--gpu-memory '0.4': must be at least 1 byte"),
        (["--gpu-memory", "9" * 400 + "GB"], f"--gpu-memory '{'9' * 400}GB': must be at least 1 byte"),
        (["--link", "0GB/s"], "--link '0GB/s': must be at least 1 byte/s"),
        (["--link", "1..5GB/s"], "--link '1..5GB/s': a size such as 80GB/s, 141GB/s or 96GiB/s"),
        (["--gpus", "0"], "--gpus 0 on --nodes 1: needs whole GPUs per node (gpus >= 1)"),
        (["--gpus", "100000"], f"--gpus 100000: moerl plans for at most {MAX_GPUS} GPUs"),
    ],
)
def test_a_size_bandwidth_or_gpu_count_it_cannot_plan_for_is_named(argv, line, capsys):
    argv = ["plan", "--gpus", "8", *argv] if "--gpus" not in argv else ["plan", *argv]
    assert main([*argv, "--no-proposal", "--workers", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"moerl: error: {line}\n"


def test_the_machine_refuses_what_the_command_line_does():
    """``Machine`` (the API under the flags) refuses the same values, counted in bytes."""
    for kwargs, pattern in (
        ({"memory": 0}, r"--gpu-memory 0 bytes: a GPU's memory must be more than 0"),
        ({"link": 0.0}, r"--link 0.0 bytes/s: a link's bandwidth must be more than 0"),
        ({"link": math.inf}, r"--link inf bytes/s"),
        ({"gpus": MAX_GPUS + 1}, rf"--gpus {MAX_GPUS + 1}: moerl plans for at most {MAX_GPUS} GPUs"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            Machine(**{"gpus": 8} | kwargs)
    assert Machine(MAX_GPUS, memory=1).budget == 0  # the extremes it takes


@pytest.mark.parametrize("gpus", ["8", str(MAX_GPUS)])
def test_the_layout_search_answers_for_any_gpu_count_it_takes_however_small_the_gpus(gpus):
    """A GPU of one byte fits no layout: the search says so (it used to try every layout of up to 65,536 GPUs, the
    listing growing with the square of the count) and names how far it looked."""
    out = _plan("--gpus", gpus, "--gpu-memory", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "verdict: does not fit" in out.stdout and f"no layout of these {gpus} GPUs was found to fit" in out.stdout
    assert (
        f"limit: the weights, masters and optimizer state alone need more than {MAX_GPUS} GPUs of this size (the "
        "most moerl plans for)"
    ) in out.stdout


def _listed(cfg, run, gpus: int) -> list[tuple[int, int, int]]:
    """Every (dp, ep, pp) of at most ``gpus`` ranks the model takes, listed whole and sorted: the definition."""
    per_rank = 2 if run.parallel.schedule == "interleaved_1f1b" else 1
    out = [
        (n // ep // pp, ep, pp)
        for n in range(1, gpus + 1)
        for ep in range(1, n + 1)
        if n % ep == 0 and cfg.num_experts % ep == 0
        for pp in range(1, n // ep + 1)
        if (n // ep) % pp == 0 and pp * per_rank <= cfg.num_layers
    ]
    return sorted(out, key=lambda lay: (math.prod(lay), -lay[1], lay[2]))


@pytest.mark.parametrize("over", [["policy.mode=full"], ["policy.mode=lora", "parallel.schedule=interleaved_1f1b"]])
def test_the_lazy_search_meets_every_layout_in_order_and_skips_only_those_below_the_floor(over):
    run = load_config(RunConfig, None, over)
    cfg = preset_config(run.model.arch, run.model.preset)[1]
    for gpus in (1, 6, 48):
        listed = _listed(cfg, run, gpus)
        assert list(candidates(cfg, run, gpus)) == listed
        floors = sorted({at_rest_floor(cfg, run, lay) for lay in listed})
        kept = []
        for budget in (floors[0] - 1, floors[len(floors) // 2], floors[-1]):
            within = [lay for lay in listed if at_rest_floor(cfg, run, lay) <= budget]
            assert list(candidates(cfg, run, gpus, budget)) == within, (gpus, budget)
            kept.append(len(within))
    assert kept[0] == 0 < kept[1] < kept[2] == len(listed)  # control: the middle budget skips some and keeps some


def test_the_smallest_layout_that_fits_is_proposed_after_at_most_two_plans():
    """On 2 GPUs the search meets ep 2, then dp 2 (the most experts split first): a budget only ep 2 fits gets it,
    one between dp 2's need and ep 2's gets dp 2; one below both stops after those two plans."""
    from moerl.plan.plan import plan

    def run(*over):  # micro-batches of 8 rows: the layouts' needs apart by their state, not one batch's activations
        rows = ["policy.micro_batch_size=8", "policy.max_tokens_per_micro_batch=0"]
        return load_config(RunConfig, None, ["policy.mode=full", *rows, *over])

    def need(*over) -> int:
        return max(r.need for r in plan(run(*over), Machine(2, memory=10**12), propose=False).roles)

    alone, ep2, dp2 = need(), need("parallel.ep=2"), need("parallel.dp=2")
    assert alone > ep2 > dp2  # the figures the budgets below fall between
    for memory, proposal in (((alone + ep2) // 2, (1, 2, 1)), ((ep2 + dp2) // 2, (2, 1, 1)), (dp2 - 1, None)):
        told = plan(run(), Machine(2, memory=memory, usable=1.0))
        assert not told.fits and told.proposal == proposal, memory


def test_why_none_fits_counts_the_gpus_the_state_needs():
    run = load_config(RunConfig, None, ["policy.mode=full"])
    cfg = preset_config(run.model.arch, run.model.preset)[1]
    need = min(at_rest_floor(cfg, run, lay) for lay in candidates(cfg, run, 4) if math.prod(lay) == 4)
    assert need < min(at_rest_floor(cfg, run, lay) for lay in candidates(cfg, run, 2))
    told = why_none_fits(cfg, run, Machine(2, memory=need, usable=1.0), [])
    assert told == [
        "the weights, masters and optimizer state alone need at least 4 GPUs of this size; policy.cpu_offload=true "
        "keeps the masters and optimizer state in host memory"
    ]
    assert why_none_fits(cfg, run, Machine(4, memory=need, usable=1.0), []) == []


def test_a_context_window_longer_than_the_models_is_refused_as_train_refuses_it(tmp_path, capsys):
    """The tiny model's window is 2,048 tokens: one token more, ``moerl train`` stops where its engine starts;
    ``moerl plan`` refuses it by the same rule (``moerl.engine.config.check_context``) and plans the window itself."""
    ckpt = tmp_path / "tiny"
    init_model("qwen3_moe", "tiny", ckpt)
    window = "the model's max_position_embeddings=2048"
    train = ["train", f"model.path={ckpt}", f"run_dir={tmp_path / 'run'}", "train.steps=1", "env.eval_problems=0"]
    assert main([*train, "rollout.max_model_len=2049"]) == 2
    assert f"max_model_len=2049: exceeds {window}" in capsys.readouterr().err
    plan = ["plan", f"model.path={ckpt}", "--gpus", "1", "--no-proposal", "--workers", "1"]
    assert main([*plan, "rollout.max_model_len=2049"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"moerl: error: rollout.max_model_len=2049: exceeds {window}\n"
    assert main([*plan, "rollout.max_model_len=2048", "policy.micro_batch_size=1"]) == 0
    assert "x 2048 tokens" in capsys.readouterr().out
