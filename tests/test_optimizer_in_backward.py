"""The optimizer step inside the backward (``policy.optimizer_in_backward``, ``moerl.trainer.in_backward``): two
steps that step each tensor as its gradient arrives move every trained tensor as the steps after the backward do
(fp32: full and LoRA, blocks recomputed or not; mxfp8's fp32 masters), with the same gradient norm; a knob 0.1% off
misses the tolerance. Such a step never holds the whole model's gradients (its peak, counted by
``moerl.plan.memory``, is the plain one's less nearly all of them). A non-finite gradient skips the tensors from it
on and the step counts as skipped; outside a step the hooks do nothing. What it does not build is refused by name,
before anything steps."""

import pytest
import torch
from dp_check import fixed_batch

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.plan.memory import Memory
from moerl.plan.rank import count_the_step, held
from moerl.presets import init_model
from moerl.run_config import RunConfig
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import PolicyLossConfig, make_policy_loss

TOL = 1e-6  # relative to each update's largest element: the same gradients through the same fused AdamW kernel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    init_model("qwen3_moe", "tiny", path)
    return path


def _policy(path, mode="full", in_backward=True, dtype="float32", how="none", lr=1e-2, world=None, **kw) -> Policy:
    torch.manual_seed(0)  # the same adapters
    optim = OptimConfig(lr=lr, grad_clip=0.0, weight_decay=0.01)
    cfg = PolicyConfig(mode=mode, dtype=dtype, activation_checkpointing=how, optimizer_in_backward=in_backward,
                       optim=optim, **kw)  # fmt: skip
    return Policy(path, cfg, world)


def _batch(pol: Policy) -> Batch:
    mcfg = pol.model.config
    batch = fixed_batch(len(mcfg.moe_layers), mcfg.top_k, mcfg.num_experts)
    batch.extras["old_logprobs"] = pol.forward_logprobs(batch)[0]
    return batch


def _two_steps(pol: Policy) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(each step's stats, each trained tensor's move over both steps)."""
    batch = _batch(pol)
    before = {n: t.detach().clone() for n, t in pol.trained.items()}
    stats = [pol.train_step(batch, make_policy_loss(PolicyLossConfig())) for _ in range(2)]
    return stats, {n: pol.trained[n].detach() - before[n] for n in before}


def _off(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and want
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-30)).item() for n in want)


@pytest.mark.parametrize(
    ("mode", "dtype", "how"),
    [
        ("full", "float32", "none"),
        ("full", "float32", "full"),
        ("lora", "float32", "full"),
        ("mxfp8", "bfloat16", "none"),
    ],
)
def test_stepping_in_the_backward_is_the_step_after_it(tiny, mode, dtype, how):
    want_stats, want = _two_steps(_policy(tiny, mode, False, dtype, how))
    pol = _policy(tiny, mode, True, dtype, how)
    stats, got = _two_steps(pol)
    assert _off(got, want) <= TOL, _off(got, want)
    for s, w in zip(stats, want_stats, strict=True):
        assert s["skipped"] == 0.0 and s["loss"] == pytest.approx(w["loss"], rel=TOL)
        assert s["grad_norm"] == pytest.approx(w["grad_norm"], rel=TOL)
    assert pol.step == 2 and all(p.grad is None for p in [*pol.trained.values(), *pol.trainable.values()])


def test_a_knob_a_tenth_of_a_percent_off_misses_the_tolerance(tiny):
    """The control: the plain steps at a learning rate 0.1% higher."""
    _, want = _two_steps(_policy(tiny, "full", False))
    _, got = _two_steps(_policy(tiny, "full", True, lr=1.001e-2))
    assert _off(got, want) > 100 * TOL


def _peak_above_rest(pol: Policy, batch: Batch) -> int:
    loss = make_policy_loss(PolicyLossConfig())
    pol.train_step(batch, loss)  # the optimizer state made: at rest after it
    with Memory(held(pol)) as memory:
        hooks = count_the_step(pol, memory)
        pol.train_step(batch, loss)
        for hook in hooks:
            hook.remove()
    return memory.peak.total - sum(memory.peak.bytes[k] for k in ("weights", "masters", "optimizer"))


def test_a_step_in_the_backward_never_holds_every_gradient(tiny):
    """Blocks recomputed, fp32 full: the plain step's peak holds every gradient; stepped in the backward, the peak
    is less by all of them but the four largest's worth (one or two are alive at once, beside its temporaries)."""
    plain = _policy(tiny, "full", False, how="full")
    grads = sorted((p.numel() * 4 for p in plain.trained.values()), reverse=True)
    batch = _batch(plain)
    saved = sum(grads) - 4 * grads[0]
    assert _peak_above_rest(_policy(tiny, "full", True, how="full"), batch) <= _peak_above_rest(plain, batch) - saved


def test_a_nonfinite_gradient_skips_the_tensors_from_it_on(tiny):
    """A NaN in the first layer's attention gradient: the tensors stepped before it (later in the model) moved, it
    and those after it (the embedding) did not; the step counts as skipped, its norm non-finite."""
    pol = _policy(tiny, "full", True)
    batch = _batch(pol)
    bad = "layers.0.self_attn.o_proj.weight"
    pol.trainable[bad].register_hook(lambda g: torch.full_like(g, float("nan")))
    before = {n: t.detach().clone() for n, t in pol.trained.items()}
    stats = pol.train_step(batch, make_policy_loss(PolicyLossConfig()))
    assert stats["skipped"] == 1.0 and pol.nan_skipped == 1 and pol.step == 0
    assert not torch.isfinite(torch.tensor(stats["grad_norm"]))
    moved = {n for n, t in pol.trained.items() if not torch.equal(t, before[n])}
    last = len(pol.model.layers) - 1
    assert f"layers.{last}.self_attn.o_proj.weight" in moved
    assert bad not in moved and "embed_tokens.weight" not in moved
    assert all(torch.isfinite(t).all() for t in pol.trained.values())


def test_a_nonfinite_loss_steps_nothing(tiny):
    pol = _policy(tiny, "full", True)
    batch = _batch(pol)
    before = {n: t.detach().clone() for n, t in pol.trained.items()}

    def nan_loss(lp, mb, ent):
        return lp.sum() * float("nan"), {}

    stats = pol.train_step(batch, nan_loss)
    assert stats["skipped"] == 1.0 and pol.nan_skipped == 1
    assert all(torch.equal(t, before[n]) for n, t in pol.trained.items())
    # no tensor counted a step either: the next step is every tensor's first
    assert all(int(st["step"]) == 0 for st in pol.optimizer.state.values())


def test_outside_a_step_the_hooks_do_nothing(tiny):
    pol = _policy(tiny, "full", True)
    before = {n: t.detach().clone() for n, t in pol.trained.items()}
    ids = torch.randint(4, 100, (2, 8))
    pol.model(ids).logits.float().square().mean().backward()
    assert all(torch.equal(t, before[n]) for n, t in pol.trained.items())
    assert all(p.grad is not None for p in pol.trained.values())


def test_clipping_is_refused_with_it():
    with pytest.raises(ConfigError, match=r"optimizer_in_backward.*grad_clip=1.0: clipping needs the whole"):
        PolicyConfig(mode="full", optimizer_in_backward=True)


def test_a_policy_on_several_ranks_is_refused(tiny):
    from moerl.parallel.world import fake_world

    try:
        with pytest.raises(ConfigError, match=r"optimizer_in_backward=true on 2 ranks: not built"):
            _policy(tiny, "full", True, world=fake_world(2, rank=0))
    finally:
        fake_world()  # back to one process, no process group


def test_a_step_of_several_micro_batches_is_refused_before_anything_steps(tiny):
    pol = _policy(tiny, "full", True, micro_batch_size=2)
    batch = _batch(pol)
    before = {n: t.detach().clone() for n, t in pol.trained.items()}
    with pytest.raises(ConfigError, match=r"optimizer_in_backward=true: this step's 7 sequences .* split into 4 micro"):
        pol.train_step(batch, make_policy_loss(PolicyLossConfig()))
    assert all(torch.equal(t, before[n]) for n, t in pol.trained.items())
    assert pol.step == 0 and not pol.optimizer.state and all(p.grad is None for p in pol.trainable.values())


def test_a_run_that_would_split_its_step_or_its_ranks_is_refused_before_it_starts():
    on = ["policy.mode=full", "policy.optimizer_in_backward=true", "policy.optim.grad_clip=0"]
    run = load_config(RunConfig, None, [*on, "rollout.max_model_len=64"])  # 16384 tokens hold the step's rows
    rows = -(-run.rollout.prompts_per_step * run.rollout.group_size // run.algo.mini_batches)
    assert run.policy.optimizer_in_backward and rows * 64 <= 16384
    with pytest.raises(ConfigError, match=r"'policy.optimizer_in_backward'=true: a step's \d+ sequences .* set policy"):
        load_config(RunConfig, None, [*on, "rollout.max_model_len=64", "policy.micro_batch_size=1"])
    with pytest.raises(ConfigError, match=r"micro_batch=16384.* >= \d+ and policy.micro_batch_size 0 or"):
        load_config(RunConfig, None, [*on, "rollout.max_model_len=16384"])
    with pytest.raises(ConfigError, match=r"'policy.optimizer_in_backward'=true with parallel.\* making 2 ranks"):
        load_config(RunConfig, None, [*on, "rollout.max_model_len=64", "parallel.dp=2"])


def test_the_plan_counts_it_and_names_it_where_only_it_fits():
    """Qwen3-30B-A3B's real shapes in full on one 80 GB GPU, a step of one 16384-token sequence, blocks recomputed,
    the masters and optimizer state in host memory. The plain step holds the model's bf16 gradients at its
    backward's end beside the weights (counted there, not at the later copy of each into host memory) and does not
    fit; stepped in the backward, the gradients are gone from the peak (the device's, and the host's for the masters'
    fp32 gradients) and it fits. Asked without it, the plan names it (and the clipping it gives up)."""
    from moerl.plan.plan import Machine, _with_option, plan, plan_dtype
    from moerl.plan.rank import trace_rank

    over = ["model.path=qwen3-30b-a3b", "policy.mode=full", "rollout.max_model_len=16384", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "algo.mini_batches=8", "policy.activation_checkpointing=full",
            "policy.cpu_offload=true"]  # fmt: skip
    gpu = Machine(1, memory=80 * 10**9)
    run = load_config(RunConfig, None, over)
    plain = plan(run, gpu, propose=False)
    was = plain.roles[0].trace.peak.bytes
    assert not plain.fits and was["gradients"] >= 0.95 * was["weights"]
    tracer = lambda cfg, run, ranks, hf: [trace_rank(cfg, run, r, hf) for r in ranks]  # noqa: E731
    named = "policy.optimizer_in_backward=true policy.optim.grad_clip=0"
    assert _with_option(plan_dtype(run), gpu, False, tracer) == (named, None)
    on = plan(load_config(RunConfig, None, [*over, *named.split()]), gpu, propose=False)
    now = on.roles[0].trace.peak.bytes
    assert on.fits and now["gradients"] == 0
    assert on.roles[0].need <= plain.roles[0].need - 0.9 * was["gradients"]
    # the host's own peak: the plain step's holds every master's fp32 gradient (twice the bf16 ones), this one's one
    assert was["host"] - now["host"] >= 0.9 * 2 * was["gradients"]
