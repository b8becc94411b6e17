"""Micro-batches by a token budget (``policy.max_tokens_per_micro_batch``, ``moerl.parallel.rows.split_rows``): every
row once, in order, no micro-batch over its budget (packed: its tokens; unpacked: rows x width) or its row limit;
the data ranks' shares balanced by tokens and as many micro-batches on every rank; a row that alone passes the
budget refused by name. A step's loss and gradients do not depend on the split: token-budget micro-batches give the
fixed ones' within 1e-6 (fp32; control: another learning signal misses it). Several ranks: tests/test_parallel.py's
``tokens=`` cases."""

import pytest
import torch
from run_helpers import stepped_grads

from moerl.errors import ConfigError
from moerl.parallel.rows import split_rows
from moerl.parallel.world import fake_world
from moerl.presets import init_model
from moerl.trainer import Batch, OptimConfig, Policy, PolicyConfig
from moerl.trainer.losses import PolicyLossConfig, make_policy_loss

TOL = 1e-6  # fp32, relative: the same rows in other groupings, gradients summed in another order


def _batch(lengths: list[int], width: int | None = None, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    t = width or max(lengths)
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()
    loss = mask.clone()
    loss[:, :2] = 0
    ids = torch.randint(4, 100, (len(lengths), t), generator=g) * mask
    return Batch(ids, mask, loss, extras={"advantages": torch.randn(len(lengths), generator=g)})


LENGTHS = [30, 3, 17, 25, 8, 8, 40, 12, 5, 33, 21, 2, 19]


@pytest.fixture
def worlds():
    made = []

    def world(dp: int, rank: int):
        made.append(fake_world(dp, rank=rank))
        return made[-1]

    yield world
    fake_world()  # back to one process, no process group


@pytest.mark.parametrize(("budget", "size", "packed"), [(40, 0, True), (64, 3, True), (45, 0, False), (100, 2, True)])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_every_row_once_in_order_and_no_micro_batch_over_its_limits(worlds, budget, size, packed, dp):
    batch = _batch(LENGTHS, width=40)
    seen, counts, shares = [], [], None
    for rank in range(dp):
        split = split_rows(worlds(dp, rank), batch, size, budget, packed)
        shares = shares or split.shares
        assert split.shares == shares  # every rank computes the same shares
        counts.append(len(split.micro))
        for mb, real in split.micro:
            if not real:
                continue
            cost = int(mb.attention_mask.sum()) if packed else len(mb) * 40
            assert cost <= budget and (not size or len(mb) <= size)
            seen.append(mb.input_ids)
    assert len(set(counts)) == 1  # the ranks' collectives pair up
    assert torch.equal(torch.cat(seen), batch.input_ids)  # each row once, in order
    costs = [n if packed else 40 for n in LENGTHS]
    share_costs = [sum(costs[s]) for s in shares]
    assert max(share_costs) <= sum(costs) / dp + max(costs)  # balanced within a row


def test_a_row_over_the_budget_is_refused_by_name(worlds):
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=32: row 6 of the batch holds 40 tokens"):
        split_rows(worlds(1, 0), _batch(LENGTHS), 0, 32, True)
    with pytest.raises(ConfigError, match=r"row 0 of the batch holds 40 tokens \(padded, unpacked\)"):
        split_rows(worlds(1, 0), _batch(LENGTHS), 0, 39, False)
    with pytest.raises(ConfigError, match=r"micro_batch_size=0: 0 \(no row limit\) needs a token limit"):
        PolicyConfig(micro_batch_size=0, max_tokens_per_micro_batch=0)
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=-1: must be >= 0"):
        PolicyConfig(max_tokens_per_micro_batch=-1)


def test_with_context_parallelism_the_budget_is_a_ranks_share_of_a_micro_batch():
    """At cp 2 a micro-batch's tokens are split over two ranks: a budget of 20 a rank lets in the 40-token row (and
    micro-batches of up to 40 tokens); a row over twice the budget is refused, naming the split."""
    try:
        world = fake_world(1, rank=0, cp=2)
        split = split_rows(world, _batch(LENGTHS), 0, 20, True)
        assert max(int(mb.attention_mask.sum()) for mb, _ in split.micro) <= 40
        assert sum(len(mb) for mb, real in split.micro if real) == len(LENGTHS)
        with pytest.raises(ConfigError, match=r"=19: row 6 of the batch holds 40 tokens, more than a micro-batch may "
                           r"split over parallel.cp=2 ranks; raise it, raise parallel.cp"):  # fmt: skip
            split_rows(world, _batch(LENGTHS), 0, 19, True)
    finally:
        fake_world()


def _step(path, packing: bool, size: int, budget: int, batch: Batch) -> tuple[dict, dict]:
    cfg = PolicyConfig(mode="full", dtype="float32", micro_batch_size=size, max_tokens_per_micro_batch=budget,
                       packing=packing, optim=OptimConfig(lr=1e-2))  # fmt: skip
    pol = Policy(path, cfg)
    batch.extras["old_logprobs"] = pol.forward_logprobs(batch, replay=False)[0]
    grads = stepped_grads(pol)
    stats = pol.train_step(batch, make_policy_loss(PolicyLossConfig()), replay=False)
    assert grads.keys() == pol.trained.keys()
    return stats, dict(grads)


def _off(got: dict, want: dict) -> float:
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-30)).item() for n in want)


@pytest.mark.parametrize("packing", [True, False])
def test_a_step_in_token_budget_micro_batches_is_the_fixed_split_step(tmp_path, packing):
    init_model("qwen3_moe", "tiny", tmp_path / "m")
    batch = _batch(LENGTHS)
    fixed, want = _step(tmp_path / "m", packing, 4, 0, batch)
    for budget in (60, 100):
        got_stats, got = _step(tmp_path / "m", packing, 0, budget if packing else 2 * budget, batch)
        assert abs(got_stats["loss"] - fixed["loss"]) <= TOL * abs(fixed["loss"]) + 1e-9
        assert abs(got_stats["grad_norm"] - fixed["grad_norm"]) <= TOL * fixed["grad_norm"]
        assert _off(got, want) <= TOL, _off(got, want)
    # the control: other advantages (another learning signal) in the same split miss the tolerance
    flipped = {"advantages": -batch.extras["advantages"]}
    other = Batch(batch.input_ids, batch.attention_mask, batch.loss_mask, extras=flipped)
    _, moved = _step(tmp_path / "m", packing, 0, 100 if packing else 200, other)
    assert _off(moved, want) > 1e3 * TOL


def test_the_default_budget_holds_the_context_window():
    """Left null, a run's budget is 16384 tokens, or its context window where that is longer; a PolicyConfig of its
    own takes 16384."""
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    assert load_config(RunConfig, None, []).policy.max_tokens_per_micro_batch == 16384
    assert load_config(RunConfig, None, ["rollout.max_model_len=40000"]).policy.max_tokens_per_micro_batch == 40000
    assert PolicyConfig().token_budget == 16384 and PolicyConfig().micro_batch_size == 0
    # a rank's budget: at cp 4 a 131072-token window is 32768 tokens a rank
    cp4 = ["rollout.max_model_len=131072", "parallel.cp=4"]
    assert load_config(RunConfig, None, cp4).policy.max_tokens_per_micro_batch == 32768


def test_a_budget_under_the_context_window_is_refused_before_the_run():
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    over = ["policy.max_tokens_per_micro_batch=64", "rollout.max_model_len=128"]
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch'=64: a sequence may hold rollout.max_model_len"):
        load_config(RunConfig, None, over)
    assert load_config(RunConfig, None, ["policy.max_tokens_per_micro_batch=128", "rollout.max_model_len=128"])
    # split over two context-parallel ranks, a 64-token budget a rank holds the 128-token window; over three it
    # would not (two ranks of 64 hold 128, not 129)
    assert load_config(RunConfig, None, [*over, "parallel.cp=2"])
    with pytest.raises(ConfigError, match=r"more than a micro-batch may split over parallel.cp=2 ranks"):
        load_config(
            RunConfig, None, ["policy.max_tokens_per_micro_batch=64", "rollout.max_model_len=129", "parallel.cp=2"]
        )
