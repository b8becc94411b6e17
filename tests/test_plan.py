"""``moerl plan`` against what runs: the plan of a tiny or small run (1, 2 and 4 gloo ranks, every mode, packing on and
off) holds each memory category of the real step within 10% (counted on real tensors by the same dispatch-mode count,
``tests/plan_measure.py``), and a wrong plan (a micro-batch doubled, FSDP dropped) is caught; the parallel code at
real sizes on fake worlds (meta weights, nothing allocated): every tensor tiled once over the ranks that split it,
stages balanced, uneven expert splits refused, stages without MoE layers, R3 columns, the checkpoint files a rank
opens; the command's table."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.plan.memory import CATEGORIES
from moerl.run_config import RunConfig

MEASURE = Path(__file__).parent / "plan_measure.py"
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
TOLERANCE = 0.10  # the bound, per category
FLOOR = 64 * 2**10  # bytes: categories below it (a few gradients) compare in absolute terms


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moerl.presets import init_model

    path = tmp_path_factory.mktemp("plan") / "tiny"
    init_model("qwen3_moe", "tiny", path, seed=0)
    return path


def _run(layout: str, case: str) -> RunConfig:
    dp, ep, pp, cp = ([*layout.split(","), "1"])[:4]
    over = [f"parallel.dp={dp}", f"parallel.ep={ep}", f"parallel.pp={pp}", f"parallel.cp={cp}", *case.split()]
    return load_config(RunConfig, None, over)


def _planned(layout: str, case: str, rank: int, preset: str = "tiny") -> dict[str, int]:
    from moerl.plan.rank import trace_rank
    from moerl.presets import preset_config

    hf, cfg = preset_config("qwen3_moe", preset)
    return dict(trace_rank(cfg, _run(layout, case), rank, hf, gpu=False).peak.bytes)


def _off(planned: dict[str, int], measured: dict[str, int]) -> list[str]:
    """The categories where the plan misses the measured bytes by more than TOLERANCE."""
    return [
        f"{c}: planned {planned[c]}, measured {measured[c]}"
        for c in CATEGORIES
        if abs(planned[c] - measured[c]) > max(TOLERANCE * measured[c], FLOOR)
    ]


ONE_PROCESS = [
    ("tiny", "policy.mode=lora policy.dtype=bfloat16"),
    ("tiny", "policy.mode=full policy.dtype=bfloat16"),
    ("tiny", "policy.mode=mxfp8 policy.dtype=bfloat16"),
    ("tiny", "policy.mode=lora policy.dtype=float32 policy.packing=false rollout.max_model_len=96"),
    ("small", "policy.mode=lora policy.dtype=bfloat16 policy.micro_batch_size=4"),
]


@pytest.mark.parametrize("preset, case", ONE_PROCESS)
def test_the_plan_of_one_process_holds_the_measured_step(tmp_path, preset, case):
    from plan_measure import measure

    from moerl.presets import init_model

    ckpt = tmp_path / preset
    init_model("qwen3_moe", preset, ckpt, seed=0)
    run = _run("1,1,1", case)
    from moerl.parallel.world import World

    measured = measure(str(ckpt), run, World())
    planned = _planned("1,1,1", case, 0, preset)
    assert not _off(planned, measured), _off(planned, measured)
    assert measured["activations"] > 0 and measured["weights"] > 0


BF16 = "policy.dtype=bfloat16"
RANKS = [  # one launch per layout, its cases in turn
    ("2,1,1", [f"policy.mode=full {BF16}", f"policy.mode=lora {BF16} policy.packing=false"]),
    ("1,2,2", ["policy.mode=lora policy.dtype=bfloat16", "policy.mode=mxfp8 policy.dtype=bfloat16"]),
    # each row's tokens split over two context-parallel ranks (dp,ep,pp,cp)
    ("1,1,1,2", [f"policy.mode=full {BF16}", f"policy.mode=lora {BF16} policy.activation_checkpointing=full"]),
]


@pytest.fixture(scope="module")
def measured_ranks(tiny, tmp_path_factory):
    """Each layout's cases measured once on a torchrun launch: {(layout, case): [per-rank bytes]}."""
    out, where = {}, tmp_path_factory.mktemp("measured")
    for layout, cases in RANKS:
        ranks = math.prod(int(n) for n in layout.split(","))
        prefix = where / layout.replace(",", "_")
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(MEASURE)]
        done = subprocess.run(
            [sys.executable, *args, str(tiny), str(prefix), layout, *cases],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        for i, case in enumerate(cases):
            out[layout, case] = [json.loads(Path(f"{prefix}.case{i}.rank{r}.json").read_text()) for r in range(ranks)]
    return out


@pytest.mark.parametrize("layout, case", [(lay, c) for lay, cases in RANKS for c in cases])
def test_the_plan_of_every_rank_holds_the_measured_step(measured_ranks, layout, case):
    for rank, measured in enumerate(measured_ranks[layout, case]):
        planned = _planned(layout, case, rank)
        assert not _off(planned, measured), (rank, _off(planned, measured))


def test_a_wrong_plan_is_caught(measured_ranks):
    """Negative controls: the plan of sequences twice as long (twice the micro-batch's tokens), of dp=1 (no FSDP)
    for a dp=2 run, or of cp=1 for a cp=2 run, misses the measured step by more than the tolerance, in the categories
    it should."""
    layout, case = RANKS[0][0], RANKS[0][1][0]
    measured = measured_ranks[layout, case][0]
    doubled = _planned(layout, case + " rollout.max_model_len=256", 0)
    assert any(c.startswith("activations") for c in _off(doubled, measured))
    assert doubled["activations"] > 1.5 * measured["activations"]
    unsharded = _planned("1,1,1", case, 0)
    off = {c.split(":")[0] for c in _off(unsharded, measured)}
    assert {"weights", "optimizer"} <= off or {"masters", "optimizer"} <= off, off
    assert unsharded["optimizer"] > 1.8 * measured["optimizer"]
    # the plan of cp 1 for a cp 2 run: each rank's activations of the whole rows, not of its half of their tokens
    layout, case = RANKS[2][0], RANKS[2][1][0]
    whole = _planned("1,1,1", case, 0)
    assert any(c.startswith("activations") for c in _off(whole, measured_ranks[layout, case][0]))


@pytest.mark.parametrize(
    "arch, layout, rank, case",
    [
        ("qwen3_moe", "1,2,1", 1, "policy.mode=full policy.dtype=bfloat16"),
        ("qwen3_5_moe", "1,1,2", 1, "policy.mode=lora policy.dtype=bfloat16"),  # linear and full attention layers
        ("deepseek_v3", "1,1,2", 0, "policy.mode=full policy.dtype=bfloat16"),  # dense and MoE layers
        ("longcat_flash", "1,1,2", 0, "policy.mode=lora policy.dtype=bfloat16"),  # pairs: a MoE, then a dense layer
        ("jetmoe", "1,1,2", 0, "policy.mode=full policy.dtype=bfloat16"),  # a mixture of attention heads
    ],
)
def test_a_deep_rank_extrapolated_from_two_layers_of_each_kind_is_its_whole_trace(arch, layout, rank, case):
    """moerl.plan.depth: ten layers traced as two layers of each kind plus one more of each (LongCat-Flash's: two
    pairs, then three), against every layer traced (the peak, the step's end and the sync's peak, per category,
    0.5%)."""
    from moerl.plan.rank import trace_rank
    from moerl.presets import preset_config

    hf = preset_config(arch, "tiny")[0]
    more = {"num_layers": 5} if arch == "longcat_flash" else {"num_hidden_layers": 10}  # its pairs: ten layers
    if "layer_types" in hf:  # the hybrid's pattern, continued
        more["layer_types"] = [hf["layer_types"][i % len(hf["layer_types"])] for i in range(10)]
    hf, cfg = preset_config(arch, "tiny", more)
    run = _run(layout, case)
    deep, whole = (trace_rank(cfg, run, rank, hf, gpu=False, exact=e) for e in (False, True))
    for a, b in ((deep.peak, whole.peak), (deep.end, whole.end), (deep.sync, whole.sync)):
        assert all(abs(a.bytes[c] - b.bytes[c]) <= 0.005 * b.bytes[c] + 4096 for c in CATEGORIES), (a, b)
    assert deep.sent == whole.sent


# -- the parallel code at real sizes, on fake worlds ----------------------------------------------------------------

REAL = [  # (shipped model, mode, dp, ep, pp, schedule)
    ("qwen3-30b-a3b", "full", 1, 8, 1, "1f1b"),
    ("qwen3-30b-a3b", "lora", 4, 8, 2, "1f1b"),
    ("deepseek-v3", "full", 1, 8, 8, "interleaved_1f1b"),
    ("deepseek-v3", "full", 4, 16, 4, "1f1b"),
    ("deepseek-v3", "full", 1, 64, 4, "1f1b"),
]


def _model_config(name: str):
    from moerl.parallel.plan import model_config
    from moerl.plan.plan import MODELS

    return model_config(str(MODELS / name), "", "")


def _split(cfg, mode: str, dp: int, ep: int, pp: int, schedule: str, rank: int, stages=None):
    """Rank ``rank``'s layout of a meta model of ``cfg`` on a fake world (trainable flags as the Policy sets them)."""
    from moerl.model.lora import LoraConfig, attach_lora
    from moerl.model.transformer import MoEModel
    from moerl.modes import mode_of
    from moerl.parallel.layout import LayoutConfig, parallelize
    from moerl.parallel.world import fake_world
    from moerl.trainer.logprobs import batch_head

    world = fake_world(dp, ep, pp, rank, schedule=schedule, stages=stages)
    with torch.device("meta"):
        model = MoEModel(cfg, torch.float32 if mode != "lora" or dp * ep == 1 else torch.bfloat16)
        if mode == "lora":
            model.requires_grad_(False)
            attach_lora(model, LoraConfig(), dtype=torch.float32)
            for n, p in model.named_parameters():
                p.requires_grad_(".lora." in n)
    split = LayoutConfig(mode_of(mode).masters, torch.bfloat16, 8, batch_head)
    return world, model, parallelize(model, world, split)


def _boxes(layout, world) -> dict[str, list[tuple[tuple, tuple]]]:
    """Every rank of this rank's stage's (offset, shape) of each tensor, from the placements the layout gave its
    parts (FSDP's shards over the data group, expert slices over the ep group; anything else whole)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    out = {}
    for name, p in layout.model.named_parameters():
        g = layout.global_view(name, p)
        if name in layout.copies:
            continue
        if not isinstance(g, DTensor):
            out[name] = [((0,) * p.ndim, tuple(p.shape))] * world.data_size
            continue
        mesh = g.device_mesh
        parts = []
        for coord in torch.cartesian_prod(*(torch.arange(n) for n in mesh.shape)).reshape(-1, mesh.ndim).tolist():
            shape, offset = _compute_local_shape_and_global_offset(g.shape, mesh.shape, coord, g.placements)
            parts.append((tuple(offset), tuple(shape)))
        out[name] = parts * (world.data_size // math.prod(mesh.shape))
    return out


def _tiled_once(parts: list[tuple[tuple, tuple]], shape: tuple) -> str | None:
    """None if the distinct non-empty parts tile ``shape`` exactly once along the one dim they split, each held by
    the same number of ranks; else what is wrong."""
    held = {}
    for part in parts:
        if math.prod(part[1]):
            held[part] = held.get(part, 0) + 1
    if len(set(held.values())) != 1:
        return f"parts held unevenly: {held}"
    split = [d for d in range(len(shape)) if any(s[d] != shape[d] for _, s in held)]
    if len(split) > 1:
        return f"split along dims {split}"
    d = split[0] if split else 0
    ends = 0
    for offset, size in sorted(held, key=lambda p: p[0][d]):
        if offset[d] != ends or any(size[i] != shape[i] for i in range(len(shape)) if i != d):
            return f"a gap or an overlap at {offset} ({size})"
        ends += size[d]
    return None if ends == shape[d] else f"covers {ends} of {shape[d]}"


@pytest.mark.parametrize("name, mode, dp, ep, pp, schedule", REAL)
def test_every_tensor_is_tiled_once_by_the_ranks_that_split_it(name, mode, dp, ep, pp, schedule):
    """Each stage's ranks hold each of its tensors' parts once (FSDP shards over dp x ep, expert slices over ep,
    replicated over dp); every tensor lives on exactly one stage; each rank's expert slice starts where its ep index
    says; the stages' R3 columns are their MoE layers' places in the model's MoE order."""
    from moerl.model.transformer import MoEModel

    cfg = _model_config(name)
    with torch.device("meta"):
        whole = dict(MoEModel(cfg, torch.float32).named_parameters())
    owner, moe = {}, sorted(cfg.moe_layers)
    for stage_rank in range(pp):
        for ep_rank in sorted({0, ep - 1}):
            rank = stage_rank * dp * ep + ep_rank
            world, model, layout = _split(cfg, mode, dp, ep, pp, schedule, rank)
            for i in model.moe_layer_ids:
                assert model.layers[i].mlp.experts.ep is None or model.layers[i].mlp.experts.ep.first == (
                    ep_rank * cfg.num_experts // ep
                )
            if ep_rank:
                world.close()
                continue
            for name_, parts in _boxes(layout, world).items():
                base = name_.replace(".lora", "")
                shape = tuple(whole[name_].shape) if name_ in whole else None
                if shape is not None:
                    assert owner.setdefault(name_, stage_rank) == stage_rank, f"{name_} on two stages"
                    assert _tiled_once(parts, shape) is None, (name_, _tiled_once(parts, shape))
                else:
                    assert ".lora." in name_ and base
            if layout.pipeline is not None:
                for module in layout.pipeline.modules:
                    assert module.columns == [moe.index(i) for i in module.view.moe_layer_ids]
            world.close()
    assert set(owner) == set(whole) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "deepseek-v3"])
@pytest.mark.parametrize("stages", [2, 4, 8, 16])
def test_pipeline_stages_balance_parameters(name, stages):
    """DESIGN's rule: the split whose largest stage holds the fewest parameters (embedding on the first stage, norm and
    head on the last). Checked against a binary search over the largest stage with a greedy fill."""
    from moerl.model.transformer import MoEModel
    from moerl.parallel.pipeline import split_layers

    with torch.device("meta"):
        model = MoEModel(_model_config(name), torch.bfloat16)
    cost = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    cost[0] += model.embed_tokens.weight.numel()
    cost[-1] += sum(p.numel() for m in (model.norm, model.lm_head) for p in m.parameters())
    ranges = split_layers(model, stages)
    assert [r.start for r in ranges] == [0, *(r.stop for r in ranges[:-1])] and ranges[-1].stop == len(cost)
    got = max(sum(cost[i] for i in r) for r in ranges)

    def fits(cap: int) -> bool:
        used, load = 1, 0
        for c in cost:
            if c > cap:
                return False
            used, load = (used + 1, c) if load + c > cap else (used, load + c)
        return used <= stages

    lo, hi = max(cost), sum(cost)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    assert got == lo


@pytest.mark.parametrize("name, ep", [("qwen3-30b-a3b", 48), ("gpt-oss-120b", 3), ("deepseek-v3", 96)])
def test_an_uneven_expert_split_is_refused_by_name(name, ep):
    from moerl.plan.plan import Machine, plan

    run = load_config(RunConfig, None, [f"model.path={name}", f"parallel.ep={ep}"])
    with pytest.raises(ConfigError, match=rf"parallel.ep={ep} must divide the model's \d+ experts"):
        plan(run, Machine(ep))


def test_a_stage_without_moe_layers_holds_no_expert_slice_and_no_r3_column():
    """DeepSeek-V3's first three layers are dense: a first stage of just them (parallel.stages=[3, 58]) holds no MoE
    layer, no expert slice and no R3 column; the next stage's columns are MoE layers 0 .. 57."""
    cfg = _model_config("deepseek-v3")
    world, model, layout = _split(cfg, "full", 1, 8, 2, "1f1b", 0, stages=[3, 58])
    assert not layout.sliced and layout.pipeline.modules[0].columns == [] and model.moe_layer_ids == []
    world.close()
    world, model, layout = _split(cfg, "full", 1, 8, 2, "1f1b", 8, stages=[3, 58])  # stage 1, ep rank 0
    assert layout.pipeline.modules[0].columns == list(range(58)) and len(layout.sliced) == 2 * 58
    world.close()


def test_a_rank_opens_only_the_checkpoint_files_of_what_it_holds(tmp_path):
    """A Qwen3-30B-A3B checkpoint index of its real tensor names (16 files): each rank of a dp 1 x ep 8 x pp 2 world
    names only tensors of its stage's layers and its experts; together the ranks name every tensor; a rank opens
    about half of the files (its stage's); the plan's figure of what a rank loads is the most loaded rank's."""
    from moerl.bridges import get_bridge
    from moerl.bridges.checkpoint import files_held, names_held, to_hf
    from moerl.model.transformer import MoEModel
    from moerl.plan.limits import _loaded_bytes
    from moerl.plan.plan import MODELS

    hf = json.loads((MODELS / "qwen3-30b-a3b" / "config.json").read_text())
    cfg, bridge = _model_config("qwen3-30b-a3b"), get_bridge(hf)
    with torch.device("meta"):
        whole = MoEModel(cfg, torch.bfloat16)
    sizes = {hf_name: h.numel() * 2 for n, t in whole.named_parameters() for hf_name, h in to_hf(bridge, n, t, cfg)}
    names = list(sizes)
    per_file = math.ceil(len(names) / 16)
    weight_map = {n: f"model-{i // per_file + 1:05d}-of-00016.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    seen: dict[str, int] = {}
    most = 0  # the bytes (bf16) of the most loaded rank
    for stage in range(2):
        for ep_rank in range(8):
            world, model, layout = _split(cfg, "full", 1, 8, 2, "1f1b", stage * 8 + ep_rank)
            params = {n: p for n, p in model.named_parameters() if n not in layout.copies}
            held = names_held(bridge, cfg, params, layout.experts_held())
            layers = {int(n.split(".")[2]) for n in held if n.startswith("model.layers.")}
            assert layers <= set(layout.pipeline.plan.layers)
            experts = {int(n.split(".experts.")[1].split(".")[0]) for n in held if ".experts." in n}
            assert experts <= set(range(ep_rank * 16, ep_rank * 16 + 16)), sorted(experts)[:5]
            assert len(files_held(tmp_path, held)) <= 9
            for n in held:
                seen[n] = seen.get(n, 0) + 1
            most = max(most, sum(sizes[n] for n in held))
            world.close()
    assert set(seen) == set(names)
    # the plan's host-memory limit counts what the most loaded of these ranks reads
    run = load_config(RunConfig, None, ["model.path=qwen3-30b-a3b", "parallel.ep=8", "parallel.pp=2"])
    assert _loaded_bytes(cfg, run, 8, 2) == most
    assert _loaded_bytes(cfg, run, 8, 1) > 1.8 * most  # the control: one stage holds every layer
    with pytest.raises(Exception, match="no tensor 'model.layers.99"):
        files_held(tmp_path, ["model.layers.99.mlp.gate.weight"])


# -- the command ----------------------------------------------------------------------------------------------------


def test_moerl_plan_prints_each_rank_and_a_verdict(capsys):
    from moerl.cli import main

    argv = ["plan", "parallel.ep=2", "parallel.pp=2", "--gpus", "4", "--gpu-memory", "80GB", "--no-proposal"]
    rc = main([*argv, "--workers", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "qwen3_moe tiny (0.0 B parameters)" in out and "layout dp 1 x ep 2 x pp 2" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "yes" in line]
    assert [r[0] for r in rows] == ["0", "2"], out  # one row per pipeline stage
    assert "weight sync per step" in out and "lora" in out and "verdict: fits" in out


def test_ranks_traced_in_worker_processes_give_one_processs_plan(capsys):
    """``workers=2`` (the CLI's default on two cores: ranks traced in spawned processes) gives the same bytes, rank by
    rank, as tracing them here; ``--workers -1`` is refused by name."""
    from moerl.cli import main
    from moerl.plan.plan import Machine, plan

    run = load_config(RunConfig, None, ["parallel.ep=2", "parallel.pp=2"])
    here, pooled = (plan(run, Machine(4), propose=False, workers=w) for w in (1, 2))

    def figures(p):
        return [(r.trace.rank, r.trace.peak.bytes, r.trace.end.bytes, r.trace.sync.bytes, r.need) for r in p.roles]

    assert len(here.roles) == 2 and figures(pooled) == figures(here)
    assert main(["plan", "--gpus", "4", "--workers", "-1"]) == 2
    assert "--workers -1: must be >= 0" in capsys.readouterr().err


def test_an_unknown_model_is_named_with_the_shipped_ones():
    from moerl.plan.plan import Machine, plan

    run = load_config(RunConfig, None, ["model.path=qwen9-1t"])
    with pytest.raises(ConfigError, match="qwen9-1t.*shipped: deepseek-v3, gpt-oss-120b"):
        plan(run, Machine(8))


def test_an_engine_on_the_trainers_gpu_adds_its_weights_cache_and_staging():
    """--colocated: the rank's need is the engine's weights plus the busiest of the step, the sync with the engine's
    staged weights, and the trainer at rest with the engine's KV cache; apart, the trainer's alone."""
    from moerl.plan.plan import Machine, plan
    from moerl.plan.sync import engine_bytes, sync_bytes
    from moerl.presets import preset_config

    run = load_config(RunConfig, None, ["policy.mode=full", "rollout.max_model_len=256", "rollout.max_num_seqs=32"])
    apart, together = (plan(run, Machine(1), colocated=c, propose=False).roles[0] for c in (False, True))
    assert apart.engine == 0 and apart.need == max(apart.trace.peak.total, apart.trace.sync.total)
    cfg = preset_config("qwen3_moe", "tiny")[1]
    e = engine_bytes(cfg, plan(run, Machine(1), propose=False).run, sync_bytes(cfg, run))
    assert e.weights > 0 and e.kv > 0 and e.staging > 0
    t = together.trace
    assert together.need == e.weights + max(t.peak.total, t.sync.total + e.staging, t.end.total + e.kv)
    assert together.need > apart.need and together.engine == together.need - apart.need


def test_a_cut_model_drops_the_fields_of_layer_kinds_it_lacks():
    """A deep rank is traced on a cut model of its own layer kinds: where a pipeline stage holds no chunked, NoPE,
    sliding or full layer (Llama 4's, Gemma 4's), the fields about those layers go back to their defaults instead of
    being refused; the fields of kinds it holds stay."""
    from dataclasses import replace

    from moerl.model.config import ModelConfig, RopeConfig
    from moerl.plan.depth import counts, cut

    base = dict(vocab_size=32, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32)
    base |= dict(num_experts=4, top_k=1, moe_intermediate_size=8, num_layers=4, moe_layers=[0, 1, 2, 3])
    llama4 = ModelConfig(
        **base,
        layer_types=["chunked", "chunked", "chunked", "full"],
        attention_chunk=8,
        nope_layers=[3],
        attn_temperature_scale=0.1,
        attn_temperature_floor=8,
    )
    run = RunConfig()
    ranges = [range(0, 2), range(2, 4)]
    small, _ = cut(llama4, run, ranges, counts(llama4, ranges, [0]))  # stage 0: chunked layers alone
    assert small.layer_types == ["chunked", "chunked", "chunked"] and small.attention_chunk == 8
    assert (small.nope_layers, small.attn_temperature_scale, small.attn_temperature_floor) == ([], 0.0, 0)
    gemma = replace(
        ModelConfig(**base, layer_types=["sliding", "full", "sliding", "full"], sliding_window=4),
        head_dim=16,
        sliding_head_dim=8,
        sliding_kv_heads=4,
        sliding_rope=RopeConfig(theta=1e4),
        attn_k_eq_v=True,
    )
    small, _ = cut(gemma, run, [range(0, 1), range(1, 4)], counts(gemma, [range(0, 1), range(1, 4)], [0]))
    assert small.layer_types == ["sliding", "full"] and small.sliding_head_dim == 8 and small.attn_k_eq_v
    apart = [range(1, 2), range(3, 4)]  # full layers alone: the sliding layers' fields go
    small, _ = cut(gemma, run, apart, counts(gemma, apart, [0]))
    assert small.layer_types == ["full", "full"] and (small.sliding_head_dim, small.sliding_kv_heads) == (0, 0)
    assert small.sliding_window is None and small.sliding_rope is None and small.attn_k_eq_v
    with pytest.raises(ConfigError, match="with a .sliding. layer"):  # the control: kept, they are refused
        replace(gemma, num_layers=2, layer_types=["full", "full"], moe_layers=[0, 1])
    full_only = replace(gemma, layer_types=["full"] * 4, sliding_window=None, sliding_head_dim=0, sliding_kv_heads=0,
                        sliding_rope=None)  # fmt: skip
    assert cut(full_only, run, [range(4)], counts(full_only, [range(4)], [0]))[0].attn_k_eq_v
