"""The trainer's compiled decoder blocks (``policy.compile``, ``moerl.trainer.compile``) against eager, the
reference: fp32 logits and every gradient within fp32 rounding on packed rows with R3 replay, in full and LoRA mode,
the routed experts' GEMMs and their backward inside the graph; new packed lengths reuse the graph; negative
controls: an attention weight or an expert weight moved by 1e-3, or another replay, miss the same tolerance. The
auto rule and the refusals."""

import copy
import re

import pytest
import torch

from moerl.bridges import load_model
from moerl.dynamo import _remember, remembered_seconds
from moerl.errors import ConfigError
from moerl.model import grouped
from moerl.model.grouped import group_mm_wgrad
from moerl.model.lora import LoraConfig, attach_lora
from moerl.presets import init_model
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.checkpoint import load_checkpoint, save_checkpoint
from moerl.trainer.compile import COMPILE_SECONDS, GAIN, AutoCompile, compile_blocks, pays
from moerl.trainer.losses import sft_loss
from moerl.trainer.packing import plan_packing

TOL = 1e-5  # fp32: compiled kernels reorder sums (2e-7 measured)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_model("qwen3_moe", "tiny", path)
    return path


def _rows(lengths: list[int], seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()
    return Batch(torch.randint(4, 100, (len(lengths), t), generator=g) * mask, mask, mask)


def _forward_backward(model, batch: Batch, replay_shift: int):
    """Packed forward in training mode with replayed experts (the model's own choice shifted by ``replay_shift``),
    a fixed random weighting of the log-softmax as the loss, its backward: (logits, {name: grad})."""
    pk = plan_packing(batch.attention_mask)
    ids = pk.pack(batch.input_ids, 0)
    model.eval()
    with torch.no_grad():
        own = model(ids, positions=pk.positions, attention_mask=pk.segment, capture=True).routed
    replay = (own + replay_shift) % model.config.num_experts
    model.train()
    model.zero_grad(set_to_none=True)
    adapters = 0 if any(".lora." in n for n, _ in model.named_parameters()) else None
    out = model(ids, positions=pk.positions, attention_mask=pk.segment, replay=replay, adapters=adapters)
    weights = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(7))
    (out.logits.float().log_softmax(-1) * weights * (pk.segment > 0)[..., None]).sum().backward()
    model.eval()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(a, b) -> float:
    logits_a, grads_a = a
    logits_b, grads_b = b
    assert grads_a.keys() == grads_b.keys() and grads_a
    worst = float((logits_a - logits_b).abs().max())
    for n, g in grads_a.items():
        worst = max(worst, float((g - grads_b[n]).abs().max()) / max(1.0, float(g.abs().max())))
    return worst


def _name(model, param) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_compiled_blocks_equal_eager_and_reuse_the_graph(tiny, mode, monkeypatch):
    eager = load_model(tiny, torch.float32)
    if mode == "lora":
        attach_lora(eager, LoraConfig(rank=4, alpha=8), dtype=torch.float32)
        with torch.no_grad():  # B starts at zero: give the adapters a delta and their A gradients a signal
            for n, p in eager.named_parameters():
                if ".lora." in n:
                    p.copy_(torch.randn(p.shape) * 0.05)
        for n, p in eager.named_parameters():
            p.requires_grad_(".lora." in n)
    fast = copy.deepcopy(eager)
    # what this test counts starts from a clean dynamo: blocks compiled by an earlier test of the same worker leave
    # guards and recorded sizes on the same code objects, which would make more graphs here
    torch._dynamo.reset()
    assert compile_blocks(fast) == eager.config.num_layers
    from torch._dynamo.utils import counters

    # the experts' weight gradients come from the graph's own op (eager autograd never calls it)
    wgrad_calls = []
    monkeypatch.setattr(grouped, "group_mm_wgrad", lambda *a: wgrad_calls.append(1) or group_mm_wgrad(*a))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())  # the session's
    # packed rows of 128 tokens first (the hidden size: a length equal to a model dim must not pin the graph to
    # it), then 17, 20 and 19
    sets = [[128, 60, 50, 9], [9, 17, 5, 12], [20, 3, 14, 8, 11], [6, 19, 10]]
    for k, lengths in enumerate(sets):
        batch = _rows(lengths, seed=k)
        before = len(wgrad_calls)
        reference = _forward_backward(eager, batch, k)
        assert len(wgrad_calls) == before
        assert _worst(reference, _forward_backward(fast, batch, k)) <= TOL
    # one graph for every layer and length (LoRA's first layer, without an input gradient, runs eager), nothing
    # left the graph, and the experts' weight gradients came from it: both projections (or their adapters)
    assert counters["stats"]["unique_graphs"] - graphs == 1 and sum(counters["graph_break"].values()) == breaks
    assert len(wgrad_calls) >= 2 * len(sets) * (len(eager.moe_layer_ids) - (mode == "lora"))

    # negative controls: another replay, an attention weight, an expert weight moved by 1e-3
    batch = _rows([9, 17, 5, 12])
    reference = _forward_backward(eager, batch, 0)
    assert _worst(reference, _forward_backward(fast, batch, 1)) > TOL
    gen = torch.Generator().manual_seed(3)
    for w in (eager.layers[0].self_attn.q_proj.weight, eager.layers[1].mlp.experts.down_proj):
        moved = copy.deepcopy(eager)
        with torch.no_grad():
            dict(moved.named_parameters())[_name(eager, w)].add_(1e-3 * torch.randn(w.shape, generator=gen))
        assert _worst(_forward_backward(moved, batch, 0), _forward_backward(fast, batch, 0)) > TOL, _name(eager, w)


def test_a_compiled_policy_trains_as_the_eager_one(tiny):
    """Policy.train_step with policy.compile=true against compile=false: the same losses and gradient norms over
    three steps of different packed lengths, the same adapters after them up to Adam's amplified rounding (LoRA,
    fp32)."""
    cfg = dict(mode="lora", dtype="float32", lora=LoraConfig(rank=4, alpha=8), optim=OptimConfig(lr=1e-2))
    torch.manual_seed(0)  # the adapters' A start random: the same draw for both
    eager = Policy(tiny, PolicyConfig(**cfg, compile=False))
    torch.manual_seed(0)
    fast = Policy(tiny, PolicyConfig(**cfg, compile=True))
    assert fast.compiled and not eager.compiled
    assert remembered_seconds(fast.graph_key) is None
    for k, lengths in enumerate([[9, 17, 5, 12], [20, 3, 14, 8, 11], [6, 19, 10]]):
        batch = _rows(lengths, seed=k)
        a, b = eager.train_step(batch, sft_loss), fast.train_step(batch, sft_loss)
        if k == 0:  # the first compiled step's seconds are remembered for the next run's auto (the ledger)
            assert remembered_seconds(fast.graph_key) > 0 and fast.graph_key == eager.graph_key
        assert abs(a["loss"] - b["loss"]) <= TOL * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * max(1.0, a["grad_norm"])
    # Adam divides by the gradients' own scale: where a gradient is ~0, rounding moves that element's update, so
    # the adapters are compared against the size of the updates (lr 1e-2 x 3 steps): within 1% of it
    for name, p in eager.trained.items():
        assert (p - fast.trained[name]).abs().max() <= 0.01 * 3e-2, name
    key = eager.graph_key
    eager.train_step(_rows([5, 7]), sft_loss, temperature=0.7)  # another temperature traces another graph
    assert eager.graph_key != key


def test_auto_compiles_only_when_the_steps_left_repay_it(tiny):
    assert pays(1000, 0.5) and not pays(10, 0.5)  # 1000 x 0.15 x 0.5 s = 75 s >= 30 s; 10 steps: 0.75 s
    assert pays(int(COMPILE_SECONDS / (GAIN * 0.2)) + 1, 0.2) and not pays(int(COMPILE_SECONDS / (GAIN * 0.2)) - 1, 0.2)
    policy = Policy(tiny, PolicyConfig(mode="lora", dtype="float32"))  # auto: eager until the loop asks
    assert not policy.compiled and all(layer.compiled is None for layer in policy.model.layers)
    assert not policy.compile_if_it_pays(10, 0.1)
    assert not policy.compile_if_it_pays(10, 1.0)  # 10 x 0.15 x 1 s = 1.5 s < the ~30 s of a first compilation
    assert policy.compile_price() == (COMPILE_SECONDS, f"the ~{COMPILE_SECONDS:.0f} s a first compilation takes")
    _remember(policy.graph_key, 1.2)  # these blocks compiled here before, in 1.2 s (inductor's cache kept them)
    assert policy.compile_price() == (1.2, "the 1.2 s it took when it last compiled here")
    assert not policy.compile_if_it_pays(10, 0.5) and not policy.compiled  # 0.75 s < 1.2 s
    assert policy.compile_if_it_pays(10, 1.0) and policy.compiled  # 1.5 s >= 1.2 s
    off = Policy(tiny, PolicyConfig(mode="lora", dtype="float32", compile=False))
    assert not off.compile_if_it_pays(10_000, 10.0) and not off.compiled
    mx = Policy(tiny, PolicyConfig(mode="mxfp8", dtype="float32"))  # mxfp8 trains eager (see the refusal)
    assert not mx.compile_if_it_pays(10_000, 10.0) and not mx.compiled


@pytest.mark.parametrize("compiled_rate, kept", [(120.0, True), (95.0, False)])
def test_auto_keeps_the_compiled_blocks_only_where_they_train_faster(tiny, compiled_rate, kept):
    """AutoCompile fed the rows of a run (training tokens/s; step 2 skipped training, as a step whose groups were
    all uninformative does): trained steps 2-3 eager at 100 and 90, compiled after the third, the 5th and 6th
    timed: kept where their best beats eager's best, else back to eager."""
    policy = Policy(tiny, PolicyConfig(mode="lora", dtype="float32"))
    auto = AutoCompile(steps=100_000)
    rates = {0: 10.0, 1: 100.0, 2: None, 3: 90.0, 4: 5.0, 5: None, 6: compiled_rate, 7: compiled_rate - 10}
    said = []
    for step, rate in rates.items():
        row = {"skipped": 1.0} if rate is None else {"train_tokens_per_s": rate, "seconds_train": 1.0}
        said.append(auto.after(policy, step, row))
    assert said[3].startswith("moerl: compiling the trainer's decoder blocks (policy.compile: auto; 99996 steps")
    assert said[:3] == [None] * 3 and said[4:7] == [None] * 3
    verdict = f"{compiled_rate / 100:.2f}x as fast as eager: " + ("kept" if kept else "back to eager")
    assert verdict in said[7], said[7]
    assert policy.compiled == kept and all((layer.compiled is not None) == kept for layer in policy.model.layers)
    assert auto.after(policy, 8, {"train_tokens_per_s": 1.0, "seconds_train": 1.0}) is None  # decided once
    short = AutoCompile(steps=10)  # 7 steps left do not repay the compilation: never compiled
    eager = Policy(tiny, PolicyConfig(mode="lora", dtype="float32"))
    assert not any(short.after(eager, s, {"train_tokens_per_s": 1.0, "seconds_train": 1.0}) for s in range(10))
    assert not eager.compiled


def test_compile_refusals():
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    with pytest.raises(ConfigError, match=r"policy.compile='sometimes': allowed: auto, true, false"):
        load_config(RunConfig, None, ["policy.compile=sometimes"])
    with pytest.raises(ConfigError, match=r"policy.compile=1: allowed: auto, true, false"):
        PolicyConfig(compile=1)  # not taken for true (it would have meant off: only ``is True`` compiles)
    with pytest.raises(ConfigError, match=r"policy.compile=true with 2 ranks: .*built for one process"):
        load_config(RunConfig, None, ["policy.compile=true", "parallel.dp=2"])
    assert load_config(RunConfig, None, ["policy.compile=auto", "parallel.dp=2"]).policy.compile == "auto"
    with pytest.raises(ConfigError, match=r"policy.compile=true with policy.mode=mxfp8: .*do not trace"):
        load_config(RunConfig, None, ["policy.compile=true", "policy.mode=mxfp8"])
    with pytest.raises(ConfigError, match=r"policy.compile=true with policy.mode=mxfp8"):
        PolicyConfig(mode="mxfp8", compile=True)
    assert load_config(RunConfig, None, ["policy.compile=auto", "policy.mode=mxfp8"]).policy.compile == "auto"


def test_the_loop_compiles_when_auto_finds_it_pays(warm_model, tmp_path, monkeypatch, capsys):
    """A run with policy.compile: auto (compilation priced at 0 s here) compiles after its third step, says so,
    times two compiled steps, says whether it keeps them, and trains on to the end."""
    from run_helpers import metric_rows, run_cfg

    from moerl.loop import train
    from moerl.trainer import compile as trainer_compile

    monkeypatch.setattr(trainer_compile, "COMPILE_SECONDS", 0.0)
    # 9 steps: the trial needs 6 that train, and a step whose groups all agree (the warm model) trains nothing
    train(run_cfg(tmp_path / "run", warm_model, "lora", steps=9))
    err = capsys.readouterr().err
    assert re.search(r"moerl: compiling the trainer's decoder blocks \(policy.compile: auto; \d steps left", err)
    assert re.search(
        r"moerl: the compiled decoder blocks train(ed)? \d\.\d\dx as fast as eager: (kept|back to eager)", err
    )
    losses = [r["loss"] for r in metric_rows(tmp_path / "run") if "loss" in r]
    assert len(losses) >= 6 and all(abs(x) < 1e3 for x in losses)


def test_a_compiled_policys_checkpoint_takes_its_next_step_eager_within_the_compiled_tolerance(tiny, tmp_path, capfd):
    """``policy.compile`` may change on ``--resume`` (``run_config.MUTABLE``) because the numbers allow it: a policy
    compiled (fp32, full) saves after two steps; an eager policy loads that checkpoint, and its third step leaves every
    weight where the compiled policy's own third step does, within the compiled-vs-eager tolerance. Negative
    control: the eager policy's third step on another batch misses it."""
    cfg = {"mode": "full", "dtype": "float32", "optim": OptimConfig(lr=3e-3)}
    batches = [_rows([12, 9, 16], seed=s) for s in range(4)]
    compiled = Policy(tiny, PolicyConfig(compile=True, **cfg))
    compiled.train_step(batches[0], sft_loss)
    said = capfd.readouterr().err  # the step that compiles says so before and after it
    assert "moerl: compiling the trainer's decoder blocks now, in the first call (policy.compile: true)" in said
    assert re.search(r"moerl: compiled the trainer's decoder blocks: the first call took \d+\.\d s", said)
    compiled.train_step(batches[1], sft_loss)
    assert "compile" not in capfd.readouterr().err  # once
    save_checkpoint(tmp_path / "ckpt", compiled)

    def resumed_eager(batch: Batch) -> dict[str, torch.Tensor]:
        eager = Policy(tiny, PolicyConfig(compile=False, **cfg))
        load_checkpoint(tmp_path / "ckpt", eager)
        eager.train_step(batch, sft_loss)
        return {n: p.detach().clone() for n, p in eager.model.named_parameters()}

    compiled.train_step(batches[2], sft_loss)
    want = {n: p.detach() for n, p in compiled.model.named_parameters()}

    def worst(got: dict[str, torch.Tensor]) -> float:
        return max(float((got[n] - w).abs().max()) / max(1.0, float(w.abs().max())) for n, w in want.items())

    assert worst(resumed_eager(batches[2])) <= TOL
    assert worst(resumed_eager(batches[3])) > 10 * TOL
