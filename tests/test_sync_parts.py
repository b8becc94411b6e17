"""A weight sync's row-range parts (``moerl.sync.parts``): what a sharded trainer sends of a weight it splits by rows
(FSDP's shards, expert slices), one rank's rows after another's, at most a bucket at a time. An engine given a tensor
in parts, in any order and over several buckets, holds what the whole tensor gives it; parts that leave rows out,
send rows twice or do not fit the tensor are refused by name and change nothing. The vLLM staging turns parts of
experts into the checkpoint's tensors of their experts, and joins the parts of any tensor the checkpoint holds as
one."""

import pytest
import torch

from moerl.engine import EngineConfig, LLMEngine
from moerl.errors import CheckpointError
from moerl.model.mx import MX_SCALE, mx_quantize
from moerl.presets import init_model
from moerl.sync.parts import part_name, split_part
from moerl.sync.weights import buckets

EXPERTS = "layers.1.mlp.experts.gate_up_proj"  # [8, 128, 128] in the tiny Qwen3-MoE


def _engine() -> LLMEngine:
    model = init_model("qwen3_moe", "tiny", dtype=torch.float32, seed=0)
    return LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=32), dtype=torch.float32)


def _new(engine, name: str = EXPERTS) -> torch.Tensor:
    p = engine.model.get_parameter(name)
    return p.detach() + 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3))


def _parts(t: torch.Tensor, cuts: list[int], name: str = EXPERTS) -> dict[str, torch.Tensor]:
    edges = [0, *cuts, t.shape[0]]
    return {part_name(name, a): t[a:b].clone() for a, b in zip(edges, edges[1:], strict=False)}


def test_part_names_round_trip():
    assert split_part(part_name(EXPERTS, 6)) == (EXPERTS, 6)
    assert split_part(EXPERTS) == (EXPERTS, None)
    assert split_part("a@b.weight") == ("a@b.weight", None)  # only a row number after the last @ makes a part


def test_parts_over_buckets_in_any_order_give_the_whole_tensors_weights():
    whole, parted = _engine(), _engine()
    new = _new(whole)
    router = "layers.1.mlp.router.weight"
    whole.update_weights({EXPERTS: new, router: _new(whole, router)}, version=1)
    parts = _parts(new, [3, 4, 7])
    keys = list(parts)
    parted.discard_staged()
    parted.stage_weights({keys[2]: parts[keys[2]], router: _new(parted, router)})  # out of order, other tensors too
    parted.stage_weights({k: parts[k] for k in (keys[0], keys[3], keys[1])})
    parted.commit_weights(version=1)
    assert torch.equal(parted.model.get_parameter(EXPERTS), whole.model.get_parameter(EXPERTS))
    assert torch.equal(parted.model.get_parameter(router), whole.model.get_parameter(router))
    assert parted.weight_version == 1


def test_mx_parts_dequantize_as_the_whole_tensor():
    whole, parted = _engine(), _engine()
    scale, data = mx_quantize(_new(whole))
    whole.update_weights({EXPERTS: data, EXPERTS + MX_SCALE: scale}, version=2)
    tensors = _parts(data, [5]) | _parts(scale, [5], EXPERTS + MX_SCALE)
    parted.update_weights(tensors, version=2)
    assert torch.equal(parted.model.get_parameter(EXPERTS), whole.model.get_parameter(EXPERTS))
    # a bucket keeps a part's scales with its data (they follow it), however small the bucket
    stream = [(part_name(EXPERTS, 0), data[:5]), (part_name(EXPERTS + MX_SCALE, 0), scale[:5])]
    assert [list(b) for b in buckets(stream, 16)] == [[k for k, _ in stream]]


@pytest.mark.parametrize(
    ("cuts", "drop", "dup", "match"),
    [
        ([3, 6], 1, None, r"rows 3\.\.6 missing; nothing applied"),
        ([3, 6], 2, None, r"rows 6\.\.8 missing; nothing applied"),
        ([3, 6], None, (2, 4), r"rows 2\.\.3 sent twice; nothing applied"),
    ],
)
def test_parts_that_miss_rows_or_send_them_twice_change_nothing(cuts, drop, dup, match):
    engine = _engine()
    before = engine.model.get_parameter(EXPERTS).detach().clone()
    new = _new(engine)
    parts = list(_parts(new, cuts).items())
    if drop is not None:
        del parts[drop]
    if dup is not None:
        parts.append((part_name(EXPERTS, dup[0]), new[dup[0] : dup[1]].clone()))
    engine.discard_staged()
    for key, t in parts:  # one bucket each: a key sent twice is two buckets
        engine.stage_weights({key: t})
    with pytest.raises(CheckpointError, match=match):
        engine.commit_weights(version=4)
    assert torch.equal(engine.model.get_parameter(EXPERTS), before) and engine.weight_version == 0
    engine.update_weights(_parts(new, cuts), version=5)  # what was staged went with the refusal
    assert torch.equal(engine.model.get_parameter(EXPERTS), new)


def test_a_part_that_does_not_fit_its_tensor_is_refused_as_it_is_staged():
    engine = _engine()
    new = _new(engine)
    with pytest.raises(CheckpointError, match=r"part 'layers\.1\.mlp\.experts\.gate_up_proj@6' has shape \(3, 128"):
        engine.stage_weights({part_name(EXPERTS, 6): new[:3]})  # rows 6..9 of 8
    with pytest.raises(CheckpointError, match=r"part 'layers\.1\.mlp\.experts\.gate_up_proj@0' has shape \(2, 64"):
        engine.stage_weights({part_name(EXPERTS, 0): new[:2, :64]})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.1\.mlp\.experts\.nothing@0'"):
        engine.stage_weights({part_name("layers.1.mlp.experts.nothing", 0): new[:2]})


@pytest.mark.parametrize(
    ("arch", "name"),
    [
        ("Qwen3MoeForCausalLM", "layers.0.mlp.experts.down_proj"),
        ("Qwen3MoeForCausalLM", "layers.0.self_attn.q_proj.weight"),
        ("GptOssForCausalLM", "layers.0.mlp.experts.down_proj"),
    ],
)
def test_vllm_staging_writes_the_checkpoints_tensors_of_the_parts(arch, name, hf_checkpoints):
    """Qwen3-MoE's checkpoint holds each expert's tensors (a part becomes its experts'); gpt-oss's holds a layer's
    experts as one tensor, and a projection is one tensor too (the parts are joined first). Either way the shared
    buffer gets what the whole tensor gives; a missing part is named at commit, an overlapping one as it comes."""
    from moerl.bridges.base import HFConfig
    from moerl.bridges.checkpoint import read_config
    from moerl.bridges.find import get_bridge
    from moerl.model.transformer import MoEModel
    from moerl.rollout.shm import SharedBuffer
    from moerl.rollout.vllm import HFStaging

    path = hf_checkpoints[arch][0]
    hf = read_config(path)
    bridge = get_bridge(hf, source=path)
    cfg = bridge.config_from_hf(HFConfig(hf, path))
    with torch.device("meta"):
        shape = MoEModel(cfg).get_parameter(name).shape
    new = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def written(staging, buckets_):
        out = {}
        for b in buckets_:
            msg = staging.put(b)
            if msg is not None:
                out |= SharedBuffer.open(msg["buffer"], msg["nbytes"]).read(msg["tensors"])
        return out

    whole, parted = HFStaging(bridge, cfg), HFStaging(bridge, cfg)
    try:
        want = written(whole, [{name: new}])
        cut = shape[0] // 2
        got = written(parted, [{part_name(name, cut): new[cut:]}, {part_name(name, 0): new[:cut]}])
        parted.check_complete()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        per_expert = arch == "Qwen3MoeForCausalLM" and ".experts." in name
        assert len(want) == (cfg.num_experts if per_expert else 1)
        parted.reset()
        written(parted, [{part_name(name, 0): new[:cut]}])
        with pytest.raises(CheckpointError, match=rf"{name}'.*rows \[{cut}, {cut + 1}"):
            parted.check_complete()
        with pytest.raises(CheckpointError, match="overlaps rows already sent"):
            written(parted, [{part_name(name, 1): new[1:3]}])
    finally:
        whole.close()
        parted.close()
