"""The distributed trainer (gloo, 2 ranks on this CPU): one step at dp=2 (FSDP2) or ep=2 (experts split, tokens
exchanged) gives one process's loss, gradient norm, logprobs and weights; ``moerl train parallel.dp=2`` learns, and
its checkpoint resumes at another dp or ep size; a rank that dies stops the run, named, with its checkpoint intact."""

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_helpers import EASY, metric_rows
from safetensors.torch import load_file
from tolerances import logprobs_agree

CHECK = Path(__file__).parent / "dp_check.py"
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moerl.presets import init_model

    path = tmp_path_factory.mktemp("dp") / "model"
    init_model("qwen3_moe", "tiny", path, seed=0)
    return path


def _step(model, mode, dtype, out: Path, layout: str = "1,1,1", *extra) -> tuple[dict, dict]:
    """One step of ``dp_check.py`` alone (layout 1,1,1: in this process) or on the ranks of a torchrun launch
    (``dp,ep,pp``)."""
    args = [str(CHECK), str(model), mode, dtype, str(out), layout, *extra]
    ranks = math.prod(int(n) for n in layout.split(","))
    if ranks == 1:
        from dp_check import main

        main(*args[1:])
        return json.loads(out.read_text()), load_file(str(out) + ".st")
    _launch(ranks, args)
    return json.loads(out.read_text()), load_file(str(out) + ".st")


def _launch(ranks: int, args: list[str]) -> None:
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    done = subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=300)
    errors = "\n".join(line for line in done.stderr.splitlines() if "Warning" not in line)
    assert done.returncode == 0, errors[:4000] + "\n[...]\n" + errors[-2000:]


@pytest.fixture(scope="module")
def one_process(model, tmp_path_factory):
    """The single-process step of each (mode, dtype, extra), computed once for the module."""
    cache, where = {}, tmp_path_factory.mktemp("one")

    def step(mode, dtype, *extra):
        key = (mode, dtype, *extra)
        if key not in cache:
            cache[key] = _step(model, mode, dtype, where / f"{len(cache)}.json", "1,1,1", *extra)
        return cache[key]

    return step


# layout (dp,ep,pp), mode, dtype, extra, grad-norm rtol. Measured (AVX2 host): grad norm equal in fp32 (2e-8 .. 5e-8
# relative), 1.1e-5 (dp) and 1.1e-5 .. 2.1e-5 (ep) relative in bf16 (fp32 reduction of the ranks' bf16 gradients vs
# one bf16 accumulation), 9e-7 (pp: the same bf16 gradients, summed in another order for the norm), 2.1e-5 (dp x pp).
CASES = [
    ("2,1,1", "full", "float32", (), 1e-6),
    ("2,1,1", "full", "bfloat16", (), 1e-4),
    ("2,1,1", "lora", "float32", (), 1e-6),
    ("2,1,1", "mxfp8", "bfloat16", (), 1e-4),
    ("1,2,1", "full", "float32", (), 1e-6),
    ("1,2,1", "full", "bfloat16", (), 1e-4),
    ("1,2,1", "lora", "float32", (), 1e-6),
    ("1,2,1", "lora", "float32", ("layout=shared_outer",), 1e-6),
    ("1,2,1", "mxfp8", "bfloat16", (), 1e-4),
    ("1,1,2", "full", "float32", (), 1e-6),
    ("1,1,2", "full", "bfloat16", ("schedule=gpipe",), 1e-5),
    ("1,1,2", "lora", "float32", (), 1e-6),
    ("1,1,2", "lora", "float32", ("layout=shared_outer", "schedule=interleaved_1f1b"), 1e-6),
    ("1,1,2", "mxfp8", "bfloat16", ("schedule=interleaved_1f1b",), 1e-5),
    ("2,1,2", "full", "float32", (), 1e-6),
    ("1,2,2", "full", "float32", ("schedule=interleaved_1f1b",), 1e-6),
    ("1,2,2", "lora", "float32", ("layout=shared_outer",), 1e-6),
    # activation checkpointing on the ranks, and micro-batches by a token budget (shares balanced by tokens), each
    # against one process's plain step (no recomputation, fixed micro-batches of 2 rows)
    ("1,2,1", "full", "float32", ("ac=full",), 1e-6),
    ("1,1,2", "lora", "float32", ("ac=selective",), 1e-6),
    ("2,1,1", "full", "float32", ("tokens=30",), 1e-6),
    ("1,1,2", "full", "float32", ("tokens=36",), 1e-6),
    # the trained state in host memory (FSDP2's CPUOffloadPolicy; on a CPU the host is the device, so this shows the
    # offloaded path's numbers, not where they live: tests/test_offload.py does, on the simulated device)
    ("2,1,1", "full", "float32", ("offload",), 1e-6),
    ("1,2,1", "full", "bfloat16", ("offload",), 1e-4),
    # context parallelism (dp,ep,pp,cp): each row's tokens split over the cp ranks, attention by all-to-all over heads
    # (cp 4: more ranks than the model's 2 kv heads, which travel with their q heads), R3's routes split with them
    ("1,1,1,2", "full", "float32", (), 1e-6),
    ("1,1,1,2", "lora", "float32", ("ac=full",), 1e-6),
    ("1,1,1,2", "mxfp8", "bfloat16", (), 1e-4),
    ("1,1,1,2", "full", "float32", ("unpacked",), 1e-6),  # right-padded rows, their 0/1 mask split with them
    ("1,1,1,4", "full", "float32", (), 1e-6),
    ("1,1,1,4", "lora", "float32", ("layout=shared_outer", "tokens=8"), 1e-6),
    ("1,2,1,2", "full", "float32", (), 1e-6),
    ("2,1,1,2", "lora", "float32", ("ac=selective",), 1e-6),
]

# How far a step on several ranks may be from one process's. A rank runs its GEMMs on other row counts and expert
# group sizes than one process does, so the kernels (which differ by ISA: AVX2, AVX-512, AMX) accumulate in another
# order: the two agree to rounding, not bit for bit. Measured on an AVX-512 host (fp32, every layout above; the
# AVX2 host these tests were first written on gave bit-equal logprobs) against the negative controls below:
# - logprobs before the step (tests/tolerances.py), fp32: 4.8e-7 at most (a few ulps of a logprob of order 4);
#   controls: 1.7e-3 (one expert moved by 1e-3), 3.9e-2 (a stage replaying another stage's columns). bf16: bit-equal
#   on AVX2 / AVX-512 / AMX (the bf16 rounding absorbs the fp32 accumulation order); control: wrong columns, mean
#   1.2e-2 (a 1e-3 expert move, mean 6e-4, is below bf16's reach).
# - the gradient (AdamW's first and second moments after one step) per tensor, relative to its largest element:
#   measured 7e-7 at most; controls: 7.7e-2 (the moved expert), 0.9 (tied copies that keep their own gradients)
FP32_GRAD = 1e-5
# - the weights after the step, against what AdamW's update makes of each run's own moments: AdamW's first step is
#   g / (|g| + eps) (eps = 1e-8), so a gradient near eps amplifies its last-bit differences (weights measured up to
#   2.1e-4 apart at ep2 x pp2); given the moments, the rest is fp32 rounding of weights of order 1 (measured 1.2e-7).
#   Control: the moved expert, 1e-3
FP32_STEP = 1e-6
# - logprobs after the step: those amplified weight moves reach the logprobs (measured 1.8e-5 at most, 1.4e-4 with
#   tied embeddings at dp2 x pp2, of moves up to 1.8); controls 4.7e-2 (moved expert), 0.26 (wrong columns), 0.33
#   (untied copies)
FP32_AFTER = 1e-3


@pytest.fixture(scope="module")
def several_ranks(model, tmp_path_factory):
    """The distributed step of each case of CASES: the cases that share a layout and a pipeline schedule run on one
    torchrun launch, one after another on the same world (a launch's start-up is most of a case's time)."""
    from dp_check import schedule_of

    where, done = tmp_path_factory.mktemp("ranks"), set()

    def step(layout, mode, dtype, *extra):
        group = (layout, schedule_of(extra))
        if group not in done:
            done.add(group)
            mine = [
                (m, d, str(where / f"{i}.json"), e)
                for i, (lay, m, d, e, _) in enumerate(CASES)
                if (lay, schedule_of(e)) == group
            ]
            (where / "cases.json").write_text(json.dumps(mine))
            ranks = math.prod(int(n) for n in layout.split(","))
            _launch(ranks, [str(CHECK), "--cases", str(model), layout, group[1], str(where / "cases.json")])
        i = next(i for i, c in enumerate(CASES) if c[:4] == (layout, mode, dtype, extra))
        out = where / f"{i}.json"
        return json.loads(out.read_text()), load_file(str(out) + ".st")

    return step


@pytest.mark.parametrize(("layout", "mode", "dtype", "extra", "rtol"), CASES)
def test_one_step_on_several_ranks_is_one_process_step(one_process, several_ranks, layout, mode, dtype, extra, rtol):
    """R3 replay on, with replayed experts unlike the router's own choice (padding rows -1: route yourself); ragged
    rows (7), micro-batches of 2. dp=2: 4 rows on rank 0, 3 on rank 1; the loss is normalised by the global token
    count and the gradient summed over ranks. ep=2: each rank holds half the experts of every MoE layer and the
    replayed indices send each token to the rank of its experts (adapters of both layouts split with them). pp=2:
    two layers per rank (interleaved 1F1B: one layer per stage, stages 0 and 2 on rank 0), 4 micro-batches of 2
    rows (one a stand-in), each stage replaying its own MoE layers' columns. Four ranks (pp=2 with dp=2 or ep=2):
    a pipeline per data rank, each on its share of the rows, each stage sharded over its two data ranks. cp=2 / 4:
    every row's 12 tokens split over the ranks (6 or 3 each), the attention's heads exchanged for them, the logprobs
    gathered whole; with ep=2 or dp=2 beside it. Each equals one process's step within the tolerances above, also
    where its blocks recompute their activations in the backward (``ac=``), its micro-batches are cut by tokens
    (``tokens=``) or its trained state is offloaded (``offload``): against one process's plain step."""
    plain = [e for e in extra if not e.startswith(("ac=", "tokens=")) and e != "offload"]
    one, t1 = one_process(mode, dtype, *plain)
    two, t2 = several_ranks(layout, mode, dtype, *extra)
    differences = _step_differences(one, t1, two, t2, mode, dtype, rtol) + _experts_in_parts(t2, layout, mode)
    assert not differences, differences


def _step_differences(one, t1, two, t2, mode, dtype, rtol) -> list[str]:
    """What differs between one process's step (``one``, ``t1``) and the distributed one (``two``, ``t2``) beyond
    the tolerances: empty when they agree."""
    bad = []
    # the loss's micro-batch sums add up in another order when the rows are shared out (measured: 6e-8 relative)
    if two["loss"] != pytest.approx(one["loss"], rel=1e-7, abs=1e-9):
        bad.append(f"loss {two['loss']} vs {one['loss']}")
    if two["grad_norm"] != pytest.approx(one["grad_norm"], rel=rtol):
        bad.append(f"grad norm {two['grad_norm']} vs {one['grad_norm']}")
    keys1, keys2 = ({k.rpartition("@")[0] or k for k in t} for t in (t1, t2))  # a tensor's parts: the tensor
    if keys1 != keys2:
        bad.append(f"tensors {sorted(keys1 ^ keys2)[:5]}")
    if not logprobs_agree(t2["old_logprobs"], t1["old_logprobs"], dtype):
        bad.append("logprobs before the step")
    bad += _sync_differences(t2, mode, dtype)
    if dtype == "float32":
        if float((t2["new_logprobs"] - t1["new_logprobs"]).abs().max()) > FP32_AFTER:
            bad.append("logprobs after the step")
        bad += _adamw_differences(t1, t2)
    else:  # bf16: AdamW's first step moves each weight by ~lr whatever the gradient's size (so near-zero gradients
        # summed in another order can flip a move): compare the step's effect on the logprobs. Measured: the two
        # runs' new logprobs differ by 0.66% of how far the step moved them (mean), 0.016 at most. MXFP8 quantizes the
        # weight gradient in blocks of 32 tokens, so rows split over ranks (dp, ep) are other blocks: the gradients
        # differ by E4M3 rounding, not only by summation order. Measured: 1.9% of the move (mean), 0.030 at most
        # (AVX512-BF16 and AVX2 hosts, dp 2 / ep 2 / pp 2 / cp 2). Control: a sharded trainer that kept its
        # quantized weights between forwards (FSDP refills a layer's storage without bumping its version, so the
        # logprobs after the step were partly the old weights') was 17-28% of the move apart, 0.41-0.45 at most.
        mean_tol, max_tol = (0.04, 0.08) if mode == "mxfp8" else (0.02, 0.05)
        mask = t1["new_logprobs"] != 0
        moved = (t1["new_logprobs"] - t1["old_logprobs"])[mask].abs().mean()
        d = (t2["new_logprobs"] - t1["new_logprobs"])[mask].abs()
        if not (float(d.mean()) < mean_tol * float(moved) and float(d.max()) < max_tol):
            bad.append(f"logprobs after the step: mean {float(d.mean())}, max {float(d.max())}, moved {float(moved)}")
    return bad


def _adamw_differences(t1: dict, t2: dict) -> list[str]:
    """fp32, one AdamW step from the same weights: where the two runs' gradients (first and second moments) differ
    beyond FP32_GRAD of the tensor's largest, or a run's weights are not the step its own moments give (FP32_STEP)."""
    from dp_check import LR

    b1, b2, eps = 0.9, 0.999, 1e-8  # OptimConfig's defaults, which dp_check keeps

    def update(t, name):  # AdamW's first step: the bias-corrected m / (sqrt(v) + eps)
        assert float(t[f"o/{name}/step"]) == 1, "the comparison holds for one step from the same weights"
        return (t[f"o/{name}/exp_avg"] / (1 - b1)) / ((t[f"o/{name}/exp_avg_sq"] / (1 - b2)).sqrt() + eps)

    bad = []
    for key in (k for k in t1 if k.startswith("w/")):
        name = key[2:]
        if f"o/{name}/exp_avg" not in t1:  # no gradient reached it: untouched in both
            if not torch.allclose(t2[key], t1[key], atol=FP32_STEP, rtol=0):
                bad.append(f"weights of {name}")
            continue
        for moment, rel in (("exp_avg", FP32_GRAD), ("exp_avg_sq", 2 * FP32_GRAD)):  # v ~ g^2: twice g's error
            m1, m2 = t1[f"o/{name}/{moment}"], t2[f"o/{name}/{moment}"]
            if float((m2 - m1).abs().max()) > rel * float(m1.abs().max()):
                bad.append(f"gradient of {name}" if moment == "exp_avg" else f"second moment of {name}")
        step = (t2[key] - t1[key]) + LR * (update(t2, name) - update(t1, name))
        if float(step.abs().max()) > FP32_STEP:
            bad.append(f"weights of {name}")
    return bad


def _sync_differences(t: dict, mode: str, dtype: str) -> list[str]:
    """Where what the sharded trainer's weight sync sends (gathered one tensor at a time) is not its whole weights:
    routers fp32 bit for bit, full mode's other weights the masters in the compute dtype, LoRA the adapters of slot
    0. Empty when it is."""
    sent, bad = _assembled({k.removeprefix("s/"): v for k, v in t.items() if k.startswith("s/")})
    bad += [] if sent else ["nothing sent"]
    for name, v in sent.items():
        if mode == "lora":
            if not name.endswith(".scale"):
                path, key = name.rsplit(".", 1)
                if not torch.equal(v, t[f"w/{path}.lora.{key}"][0]):
                    bad.append(f"sent {name}")
        elif f"w/{name}" in t and (".router." in name or mode == "full"):
            w = t[f"w/{name}"]
            want = w if ".router." in name else w.to(getattr(torch, dtype))
            if not (v.dtype == want.dtype and torch.equal(v, want)):
                bad.append(f"sent {name}")
        elif mode == "mxfp8" and name.endswith(".mx_scale"):  # E8M0 scales and E4M3 data of the whole master
            from moerl.model.mx import mx_quantize

            weight = name.removesuffix(".mx_scale")
            scale, data = mx_quantize(t[f"w/{weight}"])
            for got, want in ((v, scale), (sent[weight], data)):
                if not (got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))):
                    bad.append(f"sent {weight} (MX)")
    return bad


def _assembled(sent: dict) -> tuple[dict, list[str]]:
    """The sync's tensors with the parts of each (``name@first_row``) joined, and what is wrong with the parts:
    rows missing or sent twice, a part over dp_check's PART_BYTES."""
    from dp_check import PART_BYTES

    whole, parts, bad = {}, {}, []
    for key, v in sent.items():
        name, _, start = key.rpartition("@")
        if name:
            parts.setdefault(name, []).append((int(start), v))
            if v.numel() * v.element_size() > PART_BYTES and v.shape[0] > 1:
                bad.append(f"part {key} of {v.numel() * v.element_size()} bytes")
        else:
            whole[key] = v
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        if [start for start, _ in pieces] != [0, *itertools.accumulate(v.shape[0] for _, v in pieces[:-1])]:
            bad.append(f"parts of {name} at rows {[start for start, _ in pieces]}")
        whole[name] = torch.cat([v.view(torch.uint8) for _, v in pieces]).view(pieces[0][1].dtype)
    return whole, bad


def _experts_in_parts(t: dict, layout: str, mode: str) -> list[str]:
    """Where a run whose experts are split over ranks (dp, ep or cp above 1: FSDP or expert slices; not LoRA's
    frozen experts) sent an expert tensor whole."""
    dp, ep, _, cp = ([int(n) for n in layout.split(",")] + [1])[:4]
    if mode == "lora" or dp * ep * cp == 1:
        return []
    whole = [k for k in t if k.startswith("s/") and ".experts." in k and "@" not in k]
    parted = [k for k in t if k.startswith("s/") and "@" in k]
    return [f"sent whole: {whole[:3]}"] * bool(whole) + ["no parts"] * (not parted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stage_replaying_another_stages_columns_would_be_caught(one_process, model, tmp_path, dtype):
    """Negative control: the last stage given the first stage's routed-expert columns changes the logprobs beyond
    the tolerance of either dtype."""
    one, t1 = one_process("full", dtype)
    bad, t2 = _step(model, "full", dtype, tmp_path / "bad.json", "1,1,2", "wrong_columns")
    assert not logprobs_agree(t2["old_logprobs"], t1["old_logprobs"], dtype)
    assert "logprobs before the step" in _step_differences(one, t1, bad, t2, "full", dtype, 1e-6)


def test_a_mean_over_ranks_would_be_caught(one_process, model, tmp_path):
    """Negative control: FSDP's default (the mean of the ranks' gradients) halves the gradient at dp=2."""
    one, _ = one_process("full", "float32")
    mean, _ = _step(model, "full", "float32", tmp_path / "mean.json", "2,1,1", "mean")
    assert mean["grad_norm"] == pytest.approx(one["grad_norm"] / 2, rel=0.05)
    assert mean["grad_norm"] != pytest.approx(one["grad_norm"], rel=1e-6)


def test_an_expert_slice_off_by_1e3_would_be_caught(one_process, model, tmp_path):
    """Negative control: one expert of rank 1's slice moved by 1e-3 shows in the logprobs before the step, in its
    gradient and in its weights after the step, each beyond the fp32 tolerances of the ep=2 comparison."""
    one, t1 = one_process("full", "float32")
    bad, t2 = _step(model, "full", "float32", tmp_path / "bad.json", "1,2,1", "perturb")
    differences = _step_differences(one, t1, bad, t2, "full", "float32", 1e-6)
    for what in ("before the step", "after the step"):
        assert f"logprobs {what}" in differences, differences
    name = "layers.0.mlp.experts.gate_up_proj"
    assert f"gradient of {name}" in differences and f"weights of {name}" in differences, differences


def _train(run_dir, model, *over, resume=False, outer_torchrun=False):
    """``moerl train`` in a subprocess: started by moerl's own launch, or with ``outer_torchrun`` by torchrun on
    four fixed training problems (``dp_train.py``)."""
    args = [f"run_dir={run_dir}", f"model.path={model}", "policy.dtype=float32", "policy.micro_batch_size=16"]
    args += ["env.name=arithmetic", f"env.kwargs={json.dumps(EASY)}", "rollout.max_tokens=3", "policy.mode=full"]
    args += ["rollout.max_model_len=32", "rollout.group_size=8", "train.checkpoint_every=2", "policy.optim.lr=1e-3"]
    args += ["rollout.prompts_per_step=4", "env.eval_problems=16", *over, *(["--resume"] if resume else [])]
    cmd = [sys.executable, "-m", "moerl.cli", "train", *args]
    if outer_torchrun:
        run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(CHECK.parent / "dp_train.py")]
        cmd = [sys.executable, *run, "train", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def test_a_dp2_run_learns_and_its_checkpoint_resumes_at_dp1_and_back(warm_model, tmp_path):
    """Under an outer torchrun (moerl joins its ranks unchanged); then moerl's own launch, at dp=1 and dp=2."""
    run = tmp_path / "run"
    done = _train(run, warm_model, "parallel.dp=2", "train.steps=12", outer_torchrun=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in metric_rows(run) if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == 12 and rows[-1]["weight_version"] == 12.0
    # measured here: 0.62 over the first 3 steps -> 0.88 over the last 5
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert rows[-1]["mismatch_k3_r3"] < 1e-3  # the engine got the sharded trainer's weights
    # the checkpoint holds whole tensors: it loads at any dp or ep size
    changes = [(13, "parallel.dp=1", "parallel.dp 2 -> 1"), (14, "parallel.ep=2", "parallel.ep 1 -> 2")]
    changes += [(15, "parallel.ep=1 parallel.pp=2", "parallel.pp 1 -> 2")]
    changes += [(16, "parallel.pp=2 parallel.dp=2", "parallel.dp 1 -> 2")]  # four ranks: 2 pipelines of 2 stages
    changes += [(17, "parallel.cp=2", "parallel.cp 1 -> 2")]  # each sequence's tokens split over two ranks
    for steps, layout, change in changes:
        more = _train(run, warm_model, *layout.split(), f"train.steps={steps}", resume=True)
        assert more.returncode == 0, more.stderr[-3000:]
        assert change in more.stderr
        rows = [r for r in metric_rows(run) if "weight_version" in r]
        assert rows[-1]["weight_version"] == steps
        assert rows[-1]["mismatch_k3_r3"] < 1e-3  # the engine got the weights of the trainer of this layout


def _rank_pid(rank: int, marker: str) -> int | None:
    """The pid of trainer rank ``rank`` of the launch whose command line holds ``marker``."""
    for proc in Path("/proc").iterdir():
        try:
            cmd, env = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        if marker.encode() in cmd and f"\0RANK={rank}\0".encode() in b"\0" + env and b"LOCAL_RANK" in env:
            return int(proc.name)
    return None


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_that_dies_stops_every_rank_named_and_the_checkpoint_resumes(how, warm_model, tmp_path):
    """LoRA at ep=2 (the adapters of each rank's experts synced to the engine and checkpointed whole); rank 1 is
    killed, or stopped (SIGSTOP: rank 0's next collective times out after ``parallel.timeout_s``, names it and ends
    it); the resume runs in one process."""
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"model.path={warm_model}", "parallel.ep=2", "train.steps=500", "policy.mode=lora"]
    args += ["parallel.timeout_s=10"]
    args += ["train.checkpoint_every=1", "rollout.prompts_per_step=4", "rollout.group_size=4", "env.eval_problems=4"]
    args += ["rollout.max_tokens=3", "rollout.max_model_len=32", "policy.dtype=float32"]
    proc, (_, victim) = _started(run, args)
    try:
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)  # no rank waits forever on a collective
    finally:
        proc.kill()
    assert proc.returncode == 2
    if how == "kill":
        assert "moerl: error: trainer rank 1 of 2 failed (exit code -9)" in err, err[-3000:]
    else:
        # rank 0 names rank 1 and ends it (the launcher, seeing rank 1 gone, may end rank 0 before it exits)
        named = rf"rank 0 of 2 failed \(exit code -?\d+\): .*trainer rank 1 \(pid {victim}\) stopped answering"
        assert re.search(named, err) and "parallel.timeout_s=10 s" in err, err[-3000:]
        assert not _alive(victim)
    assert _rank_pid(0, str(run)) is None  # the launcher stopped rank 0 too
    from moerl.trainer.checkpoint import read_meta

    step = read_meta(run / "checkpoint")["state"]["step"]
    done = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "train", *args[:2], *args[4:], f"train.steps={step + 1}", "--resume"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_rows(run)[-1].get("weight_version") == step + 1


def test_ranks_stop_when_their_launcher_is_killed(warm_model, tmp_path):
    """kill -9 of `moerl train ... parallel.dp=2` cannot stop its ranks itself: each rank notices its parent is gone
    and stops, naming it (they trained on for 27 more steps before)."""
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"model.path={warm_model}", "parallel.dp=2", "train.steps=500", "policy.mode=lora"]
    args += ["train.checkpoint_every=1", "rollout.prompts_per_step=4", "rollout.group_size=4", "env.eval_problems=4"]
    args += ["rollout.max_tokens=3", "rollout.max_model_len=32", "policy.dtype=float32"]
    proc, ranks = _started(run, args)
    try:
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while any(_alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in ranks), ranks
    finally:
        proc.kill()
        for r in (0, 1):
            pid = _rank_pid(r, str(run))
            if pid is not None:
                os.kill(pid, signal.SIGKILL)


def _started(run: Path, args: list[str], **popen) -> tuple[subprocess.Popen, list[int]]:
    """``moerl train args`` on two ranks, once its first checkpoint is written; the process and the ranks' pids."""
    cmd = [sys.executable, "-m", "moerl.cli", "train", *args]
    proc = subprocess.Popen(cmd, env=ENV, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.time() + 300
    while not (run / "checkpoint" / "checkpoint.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    ranks = [_rank_pid(r, str(run)) for r in (0, 1)]
    if None in ranks:
        proc.kill()
        raise AssertionError(f"the two ranks of {run} did not start: {ranks}")
    return proc, ranks


def test_ctrl_c_of_a_dp2_run_ends_every_rank_with_one_message_and_rc_130(warm_model, tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the launcher's whole process group, ranks included, mid-run."""
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"model.path={warm_model}", "parallel.dp=2", "train.steps=500", "policy.mode=full"]
    args += ["train.checkpoint_every=1", "rollout.prompts_per_step=4", "rollout.group_size=4", "env.eval_problems=4"]
    args += ["rollout.max_tokens=3", "rollout.max_model_len=32", "policy.dtype=float32"]
    proc, ranks = _started(run, args, start_new_session=True)  # its own process group, as a shell job is
    try:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "moerl: interrupted" and "Traceback" not in err, err[-3000:]
    assert not any(_alive(pid) for pid in ranks)
    # the launcher's own lines (torchrun's OMP_NUM_THREADS note, its shutdown) are in the run's libraries.log
    assert " torch.distributed." not in err and "OMP_NUM_THREADS" not in err, err[-3000:]
    # (torchrun's OMP_NUM_THREADS note only where the variable is unset: under pytest-xdist it is set; its shutdown
    # line always)
    assert re.search(r" torch\.distributed\.\S+ WARNING ", (run / "libraries.log").read_text())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_an_outer_launch_of_the_wrong_size_is_refused_by_name(tmp_path):
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "moerl.cli", "train"]
    cmd += [f"run_dir={tmp_path / 'run'}", "parallel.dp=2"]
    done = subprocess.run([sys.executable, *cmd], env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "parallel.dp x parallel.ep x parallel.pp = 2 ranks, but the launcher started 1" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.ep=3", "parallel.ep=3 must divide the model's 8 experts per MoE layer"),
        ("model.preset=small parallel.ep=32", "parallel.ep=32 must divide the model's 16 experts per MoE layer"),
        ("parallel.pp=5", "parallel.pp=5 with schedule '1f1b' needs 5 stages of at least one layer; the model has 4"),
        ("parallel.pp=3 parallel.schedule=interleaved_1f1b", "needs 6 stages of at least one layer; the model has 4"),
        ("parallel.pp=2 parallel.stages=[3,2]", "parallel.stages=[3, 2]: needs 2 layer counts of at least 1 that add"),
        ("parallel.pp=2 parallel.stages=[4,0]", "parallel.stages=[4, 0]: needs 2 layer counts of at least 1 that add"),
        ("parallel.cp=3", "parallel.cp=3 must divide the model's 4 attention heads"),
        ("parallel.cp=2 parallel.pp=2", "parallel.cp=2 with parallel.pp=2: context parallelism across pipeline stages"),
    ],
)
def test_a_layout_the_model_cannot_take_is_refused_before_any_rank_starts(model, tmp_path, capsys, override, message):
    from moerl.cli import main

    where = [] if "preset" in override else [f"model.path={model}"]
    assert main(["train", f"run_dir={tmp_path / 'run'}", *where, *override.split()]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny model whose head is its embedding, and its one-process step in full fp32."""
    from moerl.presets import init_model

    where = tmp_path_factory.mktemp("tied")
    init_model("qwen3_moe", "tiny", where / "model", seed=0, overrides={"tie_word_embeddings": True})
    return where / "model", _step(where / "model", "full", "float32", where / "one.json")


def test_tied_embeddings_train_across_pipeline_stages_as_in_one_process(tied, tmp_path):
    """dp=2 x pp=2: the first stage embeds with the weight the last stage's head uses (its copy): both get the sum of
    the two gradients, so one step equals one process's (loss, gradient norm, weights, logprobs after the step)."""
    model, (one, t1) = tied
    two, t2 = _step(model, "full", "float32", tmp_path / "two.json", "2,1,2")
    differences = _step_differences(one, t1, two, t2, "full", "float32", 1e-6)
    assert not differences, differences


def test_ernie_trains_across_pipeline_stages_as_in_one_process(tmp_path):
    """Ernie-4.5-MoE (a transformers checkpoint): tied head with its own bias (last stage only), a dense first
    layer, shared experts; pp=2 equals one process."""
    from hf_models import save_hf_model

    save_hf_model("Ernie4_5_MoeForCausalLM", tmp_path / "ernie")
    one, t1 = _step(tmp_path / "ernie", "full", "float32", tmp_path / "one.json")
    two, t2 = _step(tmp_path / "ernie", "full", "float32", tmp_path / "two.json", "1,1,2")
    differences = _step_differences(one, t1, two, t2, "full", "float32", 1e-6)
    assert not differences, differences


def test_tied_copies_that_kept_their_own_gradients_would_be_caught(tied, tmp_path):
    """Negative control: without the exchange each copy steps on its own gradient and the logprobs after the step
    leave the tolerance; the comparison the tied tests make reports it (and the gradient that went wrong)."""
    model, (one, t1) = tied
    two, t2 = _step(model, "full", "float32", tmp_path / "untied.json", "1,1,2", "untie")
    assert logprobs_agree(t2["old_logprobs"], t1["old_logprobs"], "float32")  # the forward is right
    assert float((t2["new_logprobs"] - t1["new_logprobs"]).abs().max()) > FP32_AFTER
    differences = _step_differences(one, t1, two, t2, "full", "float32", 1e-6)
    assert "logprobs after the step" in differences and "gradient of embed_tokens.weight" in differences, differences


def test_a_tied_pipeline_checkpoint_resumes_bit_exact(tied, tmp_path):
    """pp=2 with tied embeddings: two steps in one run equal a load of the checkpoint saved after the first and the
    second step (the checkpoint holds the first stage's weight once; the last stage's copy loads from it)."""
    model, _ = tied
    ckpt = tmp_path / "ckpt"
    _, straight = _step(model, "full", "float32", tmp_path / "two.json", "1,1,2", "steps=2", f"save={ckpt}")
    _, resumed = _step(model, "full", "float32", tmp_path / "re.json", "1,1,2", f"load={ckpt}")
    assert straight.keys() == resumed.keys()
    for k in straight:
        if k != "old_logprobs":
            assert torch.equal(straight[k], resumed[k]), k


@pytest.mark.parametrize(
    ("arch", "preset", "stages"),
    [("qwen3_moe", "tiny", 2), ("deepseek_v3", "tiny", 3), ("qwen2_moe", "small", 3), ("gpt_oss", "small", 4)],
)
def test_stages_are_split_to_the_smallest_largest_stage(arch, preset, stages):
    """Against every contiguous split (the oracle): the balanced split's largest stage holds the fewest parameters
    (the embedding counted on the first stage, the norm and head on the last)."""
    import itertools

    from moerl.model.transformer import MoEModel
    from moerl.parallel.pipeline import split_layers
    from moerl.presets import preset_config

    with torch.device("meta"):
        m = MoEModel(preset_config(arch, preset)[1])
    n = len(m.layers)
    cost = [sum(p.numel() for p in layer.parameters()) for layer in m.layers]
    cost[0] += m.embed_tokens.weight.numel()
    cost[-1] += sum(p.numel() for mod in (m.norm, m.lm_head) if mod is not None for p in mod.parameters())

    def worst(bounds):
        return max(sum(cost[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))

    best = min(worst([0, *cuts, n]) for cuts in itertools.combinations(range(1, n), stages - 1))
    ranges = split_layers(m, stages)
    assert [r.start for r in ranges] == [0, *[r.stop for r in ranges[:-1]]] and ranges[-1].stop == n
    assert min(len(r) for r in ranges) >= 1
    assert worst([0, *[r.stop for r in ranges]]) == best
    assert [list(r) for r in split_layers(m, 2, [1, n - 1])] == [[0], list(range(1, n))]


def test_no_stage_starts_at_a_layer_keeping_an_earlier_layers_keys():
    """GLM-5's shared indexer layers keep the keys the indexer layer before them chose, within a forward: the
    balanced split never starts a stage at one (oracle: every contiguous split that does not), a given split that
    would is refused naming the layer, and more stages than layers a stage can start at are refused."""
    import itertools

    from moerl.errors import ConfigError
    from moerl.model.config import ModelConfig
    from moerl.model.transformer import MoEModel
    from moerl.parallel.pipeline import split_layers

    n, shared = 6, [1, 2, 4]
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_layers=n, num_heads=2, num_kv_heads=2, head_dim=0, intermediate_size=32,
        num_experts=4, top_k=2, moe_intermediate_size=16, moe_layers=list(range(1, n)), attention="mla",
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=2,
        index_n_heads=2, index_head_dim=8, index_shared_layers=shared,
    )  # fmt: skip
    with torch.device("meta"):
        m = MoEModel(cfg)
    cost = [sum(p.numel() for p in layer.parameters()) for layer in m.layers]
    cost[0] += m.embed_tokens.weight.numel()
    cost[-1] += m.norm.weight.numel() + m.lm_head.weight.numel()

    def worst(bounds):
        return max(sum(cost[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))

    starts = [j for j in range(1, n) if j not in shared]
    for stages in (2, 3):
        ranges = split_layers(m, stages)
        assert not {r.start for r in ranges} & set(shared)
        best = min(worst([0, *cuts, n]) for cuts in itertools.combinations(starts, stages - 1))
        assert worst([0, *[r.stop for r in ranges]]) == best
    with pytest.raises(ConfigError, match=r"parallel.stages=\[1, 5\]: a stage starts at layer 1, which keeps"):
        split_layers(m, 2, [1, 5])
    with pytest.raises(ConfigError, match="4 pipeline stages: the model has fewer layers a stage can start at"):
        split_layers(m, 4)


@pytest.fixture(scope="module")
def dp2_checkpoint(model, tmp_path_factory):
    """A checkpoint saved at dp=2 after one full-mode step (each rank's FSDP shards in its own file), and the
    state it holds."""
    where = tmp_path_factory.mktemp("dp2ckpt")
    _, state = _step(model, "full", "float32", where / "a.json", "2,1,1", f"save={where / 'ckpt'}")
    return where / "ckpt", {k: v for k, v in state.items() if k.startswith(("w/", "o/"))}


def _loaded(model, tmp_path, mode, layout, ckpt) -> dict:
    _, got = _step(model, mode, "float32", tmp_path / f"{layout}.json", layout, f"load={ckpt}", "dump")
    return {k: v for k, v in got.items() if k.startswith(("w/", "o/"))}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any(k.startswith("o/") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_sharded_checkpoint_loads_at_another_layout_with_the_same_state(dp2_checkpoint, model, tmp_path):
    """Saved at dp=2 with torch.distributed.checkpoint (every rank writes its part; safetensors files whose headers
    hold each part's offset): one process, ep=2 and pp=2 load the same weights and AdamW moments bit for bit.
    Negative control: the fresh policy's state differs."""
    ckpt, saved = dp2_checkpoint
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert len(meta["shards"]) == 2 and sorted(p.name for p in (ckpt / "shards").iterdir()) == sorted(meta["shards"])
    for layout in ("1,1,1", "1,2,1", "1,1,2"):
        _same(_loaded(model, tmp_path, "full", layout, ckpt), saved)
    _, fresh = _step(model, "full", "float32", tmp_path / "fresh.json", "1,1,1", "dump")
    assert not all(torch.equal(fresh[k], saved[k]) for k in fresh if k.startswith("w/"))


def test_checkpoints_cross_pipeline_and_whole_layouts(model, tmp_path):
    """LoRA saved at pp=2 (each stage's adapters from its own rank) loads at dp=2; a one-process checkpoint (whole
    tensors, one file) loads at pp=2."""
    for save_at, load_at in (("1,1,2", "2,1,1"), ("1,1,1", "1,1,2")):
        ckpt = tmp_path / f"from-{save_at}"
        _, state = _step(model, "lora", "float32", tmp_path / "s.json", save_at, f"save={ckpt}")
        saved = {k: v for k, v in state.items() if k.startswith(("w/", "o/"))}
        _same(_loaded(model, tmp_path, "lora", load_at, ckpt), saved)


def test_a_resume_on_the_same_layout_is_bit_exact(dp2_checkpoint, model, tmp_path):
    """dp=2: two steps in one run equal one step, a save, a load in a new run and the second step, bit for bit."""
    ckpt, _ = dp2_checkpoint
    _, straight = _step(model, "full", "float32", tmp_path / "two.json", "2,1,1", "steps=2")
    _, resumed = _step(model, "full", "float32", tmp_path / "re.json", "2,1,1", f"load={ckpt}")
    assert straight.keys() == resumed.keys()
    for k in straight:
        if k != "old_logprobs":  # the resumed run's "before" is after the first step
            assert torch.equal(straight[k], resumed[k]), k


@pytest.mark.parametrize("case", ["truncated shard", "flipped byte"])
def test_a_damaged_shard_is_refused_by_name(dp2_checkpoint, model, tmp_path, case):
    import shutil

    from moerl.errors import CheckpointError
    from moerl.trainer import Policy, PolicyConfig
    from moerl.trainer.checkpoint import load_checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(dp2_checkpoint[0], ckpt)
    shard = sorted((ckpt / "shards").iterdir())[1]
    data = bytearray(shard.read_bytes())
    if case == "truncated shard":
        shard.write_bytes(data[:-100])
        pattern = rf"{shard.name}: checkpoint.json records {len(data)} bytes, found {len(data) - 100} bytes"
    else:
        data[-5] ^= 0xFF
        shard.write_bytes(data)
        pattern = rf"{shard.name} is corrupt: its SHA-256 differs"
    policy = Policy(model, PolicyConfig(mode="full", dtype="float32"))
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(ckpt, policy)
    assert all(torch.equal(before[k], v) for k, v in policy.trainable_state().items()) and policy.step == 0


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5-MoE checkpoint (transformers'): three linear-attention layers, one full; its one-process step."""
    from hf_models import save_hf_model

    path = tmp_path_factory.mktemp("hybrid") / "qwen3_5_moe"
    save_hf_model("Qwen3_5MoeForCausalLM", path)
    return path, _step(path, "full", "float32", path.parent / "one.json")


@pytest.mark.parametrize("layout", ["2,1,1", "1,2,1", "1,1,2"])
def test_a_hybrid_model_trains_on_several_ranks_as_in_one_process(hybrid, tmp_path, layout):
    """Gated DeltaNet layers under FSDP (dp=2), expert parallelism (ep=2) and a pipeline whose stage boundary falls
    between two linear-attention layers (pp=2: layers 0-1 | 2-3), R3 replay on: one step equals one process's."""
    path, (one, t1) = hybrid
    two, t2 = _step(path, "full", "float32", tmp_path / "two.json", layout)
    differences = _step_differences(one, t1, two, t2, "full", "float32", 1e-6)
    assert not differences, differences


def test_four_ranks_each_read_only_their_stage_and_their_share_of_the_experts(model, tmp_path):
    """Each expert-parallel rank reads the checkpoint's tensors every rank holds and the tensors of its own experts
    only: at ep 4, experts 2r, 2r+1 of the 8 on rank r (a quarter of the expert bytes); at ep 2 x pp 2, also only its
    stage's layers (the embedding on the first stage, the final norm and head on the last), the ranks together reading
    every tensor once per expert group. The control: the same four ranks at dp 4 each read every tensor."""
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        sizes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    nbytes = {n: math.prod(shape) * 4 for n, shape in sizes.items()}  # fp32 checkpoint
    expert_of = {n: int(m.group(1)) for n in sizes if (m := re.search(r"\.experts\.(\d+)\.", n))}
    layer_of = {n: int(m.group(1)) for n in sizes if (m := re.search(r"layers\.(\d+)\.", n))}
    assert len(set(expert_of.values())) == 8 and sum(nbytes[n] for n in expert_of) > sum(nbytes.values()) / 2
    last = max(layer_of.values())
    assert last >= 1
    for layout in ("1,4,1", "1,2,2", "4,1,1"):
        out = tmp_path / layout.replace(",", "")
        _launch(4, [str(CHECK), str(model), "lora", "float32", str(out), layout, "reads"])
        ep = int(layout.split(",")[1])
        together: dict[str, int] = {}
        for rank in range(4):
            got = json.loads(Path(f"{out}.reads{rank}.json").read_text())
            read = dict(got["reads"])
            assert read == {n: nbytes[n] for n in read}  # each tensor read whole, once
            for n in read:
                together[n] = together.get(n, 0) + 1
            if layout == "4,1,1":
                assert set(read) == set(sizes)
                continue
            r, layers = got["ep_rank"], set(got["layers"])
            share = set(range(r * 8 // ep, (r + 1) * 8 // ep))
            assert {layer_of[n] for n in read if n in layer_of} == layers
            assert {expert_of[n] for n in read if n in expert_of} == share
            held = {n for n in sizes if layer_of.get(n, -1) in layers or n not in layer_of}
            held -= {n for n in held if n.startswith("model.embed_tokens") and 0 not in layers}
            held -= {n for n in held if n.split(".")[-2] in ("norm", "lm_head") and last not in layers}
            assert set(read) - set(expert_of) == held - set(expert_of)  # what every rank of its stage holds
            experts_read = sum(b for n, b in read.items() if n in expert_of and layer_of[n] in layers)
            assert experts_read * ep == sum(nbytes[n] for n in expert_of if layer_of[n] in layers)
        if layout == "1,2,2":  # each tensor by its stage's ranks: twice if every expert group holds it, else once
            assert together == {n: 1 if n in expert_of else 2 for n in sizes}


@pytest.fixture(scope="module")
def attention_kinds(tmp_path_factory):
    """gpt-oss (sliding windows of 5 tokens, shorter than the rows, and attention sinks), DeepSeek-V3 (latent
    attention), Llama 4 (chunks of 8 tokens, temperature tuning) and JetMoE (a mixture of attention heads): each
    checkpoint and its one-process step, and their steps at cp 2 (one launch)."""
    from hf_models import build_hf_model

    from moerl.presets import init_model

    where = tmp_path_factory.mktemp("kinds")
    paths = {
        "gpt_oss": init_model("gpt_oss", "tiny", where / "gpt_oss", seed=0, overrides={"sliding_window": 5}),
        "deepseek_v3": init_model("deepseek_v3", "tiny", where / "deepseek_v3", seed=0),
    }
    build_hf_model("Llama4ForCausalLM").save_pretrained(where / "llama4")  # chunks of 8, derived with no bridge file
    paths["llama4"] = where / "llama4"
    build_hf_model("JetMoeForCausalLM").save_pretrained(where / "jetmoe")  # routed query heads over shared keys
    paths["jetmoe"] = where / "jetmoe"
    assert paths["gpt_oss"].config.sliding_window == 5 and paths["gpt_oss"].config.attention_sinks
    assert paths["deepseek_v3"].config.attention == "mla"
    return _one_and_launched(where, list(paths), "1,1,1,2")


def _one_and_launched(where: Path, names: list[str], layout: str) -> tuple[dict, dict]:
    """The checkpoints ``where / name``: each one's one-process step, and each one's step on a 2-rank launch of
    ``layout`` (one launch for them all, a case each)."""
    one = {a: _step(where / a, "full", "float32", where / f"one_{a}.json") for a in names}
    spec = [["full", "float32", str(where / f"two_{a}.json"), [f"model={where / a}"]] for a in names]
    (where / "cases.json").write_text(json.dumps(spec))
    _launch(2, [str(CHECK), "--cases", str(where / names[0]), layout, "1f1b", str(where / "cases.json")])
    two = {
        a: (json.loads((where / f"two_{a}.json").read_text()), load_file(f"{where / f'two_{a}.json'}.st"))
        for a in names
    }
    return one, two


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "llama4", "jetmoe"])
def test_context_parallel_attention_kinds_train_as_in_one_process(attention_kinds, arch):
    """At cp 2 each rank holds 6 of a row's 12 tokens: gpt-oss's sliding layers attend over a 5-token window that
    crosses the ranks' boundary, each rank keeping its heads' sinks; DeepSeek-V3's latent attention splits its
    per-head keys; Llama 4's chunks of 8 cross it too; JetMoE's routed query heads split with their key heads. R3
    replay on (JetMoE's attention columns too), packed rows: one step equals one process's (fp32)."""
    one, two = attention_kinds
    differences = _step_differences(*one[arch], *two[arch], "full", "float32", 1e-6)
    assert not differences, differences


@pytest.fixture(scope="module")
def expert_kinds(tmp_path_factory):
    """Llama 4 (the gate weight on the one expert's input) and Gemma 4 (the experts beside a dense MLP, the router's
    own norm and per-expert scale), derived with no bridge file, LongCat-Flash (zero-computation experts, the MoE
    output carried to the next layer), JetMoE (attention experts routed beside the MoE's, R3 columns for both) and
    GLM-5 (a layer reading the keys an earlier layer's indexer chose, handed on through the sharded forward): each
    checkpoint and its one-process step, and their steps with the experts split over ep 2 (one launch)."""
    from hf_models import build_hf_model

    where = tmp_path_factory.mktemp("experts")
    archs = {"llama4": "Llama4ForCausalLM", "gemma4": "Gemma4ForCausalLM", "longcat": "LongcatFlashForCausalLM"}
    archs["jetmoe"] = "JetMoeForCausalLM"  # the MoE's experts split, the attention's replicated
    archs["glm5"] = "GlmMoeDsaForCausalLM"  # its second layer reads the keys the first one's indexer chose
    for name, arch in archs.items():
        build_hf_model(arch).save_pretrained(where / name)
    return _one_and_launched(where, list(archs), "1,2,1")


@pytest.mark.parametrize("arch", ["llama4", "gemma4", "longcat", "jetmoe", "glm5"])
def test_expert_parallel_moe_blocks_of_2026_train_as_in_one_process(expert_kinds, arch):
    """At ep 2 each rank holds 4 of the 8 experts: Llama 4's gate weight scaling the expert's input, Gemma 4's dense
    MLP beside the experts (replicated, its norms and the router's scales with it) and LongCat-Flash's pairs routed to
    its 4 zero-computation experts (they stay on the token's rank) give one process's step, as GLM-5's shared-keys
    layer does (fp32, R3 replay on, the zero experts among the replayed ones, packed rows)."""
    one, two = expert_kinds
    differences = _step_differences(*one[arch], *two[arch], "full", "float32", 1e-6)
    assert not differences, differences


def test_context_parallel_ranks_that_attend_within_their_own_tokens_would_be_caught(one_process, model, tmp_path):
    """The control: at cp 2 each rank's attention layers keep the plain core (each token sees only its own rank's
    part of the row): far outside the tolerances (logprobs 0.55 apart, moments 1.9 of their largest, measured)."""
    one, t1 = one_process("full", "float32")
    two, t2 = _step(model, "full", "float32", tmp_path / "local.json", "1,1,1,2", "cp_local")
    differences = _step_differences(one, t1, two, t2, "full", "float32", 1e-6)
    assert "logprobs before the step" in differences and any("gradient of" in d for d in differences), differences


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ("HYBRID", "parallel.cp=2 with a model whose linear layers keep a state across the sequence"),
        ("MAMBA", "parallel.cp=2 with a model whose mamba layers keep a state across the sequence"),
        ("INDEXED", r"parallel.cp=2 with DeepSeek sparse attention \(index_topk=3\)"),
    ],
)
def test_context_parallelism_refuses_the_layers_it_does_not_split(base, message):
    """Layers that carry a state along the sequence, and an indexer that scores every key, are refused at cp > 1
    (the same models are taken at cp 1)."""
    import test_model_config

    from moerl.errors import ConfigError
    from moerl.model.config import ModelConfig
    from moerl.parallel.plan import check_layout

    cfg = ModelConfig(**getattr(test_model_config, base))
    check_layout(1, 1, 1, cfg, cp=1)
    with pytest.raises(ConfigError, match=message):
        check_layout(1, 1, 1, cfg, cp=2)
