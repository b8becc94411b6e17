"""``auto`` compute dtypes: bf16 where the hardware multiplies it natively, fp32 elsewhere, for the trainer and the
engines the loop builds; explicit dtypes are kept; what reaches the engine is the trainer's compute dtype."""

import pytest
import torch

from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.loop import build_engine
from moerl.precision import compute_dtype, dtype_name, native_bf16
from moerl.run_config import RunConfig
from moerl.trainer import Policy, PolicyConfig


def test_auto_follows_the_hardware_and_explicit_names_stay():
    assert compute_dtype("auto", "cuda") == torch.bfloat16  # every CUDA device multiplies bf16 natively
    assert compute_dtype("auto") == (torch.bfloat16 if native_bf16() else torch.float32)
    assert dtype_name("bfloat16") == "bfloat16" and compute_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ConfigError, match=r"rollout.dtype='half': allowed: auto, bfloat16, float32"):
        dtype_name("half", key="rollout.dtype")


@pytest.mark.parametrize("name", ["auto", "bfloat16", "float32"])
def test_policy_and_engine_compute_in_the_named_dtype(name, tmp_path):
    from moerl.presets import init_model

    init_model("qwen3_moe", "tiny", tmp_path / "m", seed=0)
    want = compute_dtype(name)
    pol = Policy(tmp_path / "m", PolicyConfig(mode="full", dtype=name))
    assert pol.model.embed_tokens.weight.dtype == want
    assert pol.model.layers[0].mlp.router.weight.dtype == torch.float32  # the router stays fp32
    cfg = load_config(RunConfig, None, [f"model.path={tmp_path / 'm'}", f"rollout.dtype={name}"])
    engine = build_engine(cfg, tmp_path / "m")
    model = engine.engines[0].model
    assert model.embed_tokens.weight.dtype == want and model.layers[0].mlp.router.weight.dtype == torch.float32
    sent = dict(pol.sync_tensors())  # full mode sends the compute dtype (router fp32)
    assert sent["embed_tokens.weight"].dtype == want and sent["layers.0.mlp.router.weight"].dtype == torch.float32
