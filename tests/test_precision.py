"""``auto`` compute dtypes: bf16 where the hardware multiplies it natively, fp32 elsewhere, for the trainer and the
engines the loop builds; explicit dtypes are kept; what reaches the engine is the trainer's compute dtype."""

import pytest
import torch

from moerl.build import build_engine
from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.precision import AUTO_ENV, compute_dtype, dtype_name, host_summary, native_bf16
from moerl.run_config import RunConfig
from moerl.trainer import Policy, PolicyConfig


def test_auto_follows_the_hardware_and_explicit_names_stay(monkeypatch):
    monkeypatch.delenv(AUTO_ENV, raising=False)
    assert compute_dtype("auto", "cuda") == torch.bfloat16  # every CUDA device multiplies bf16 natively
    assert compute_dtype("auto") == (torch.bfloat16 if native_bf16() else torch.float32)
    assert dtype_name("bfloat16") == "bfloat16" and compute_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ConfigError, match=r"rollout.dtype='half': allowed: auto, bfloat16, float32"):
        dtype_name("half", key="rollout.dtype")


def test_auto_can_be_pinned_and_an_isa_cap_below_bf16_makes_it_fp32(monkeypatch):
    """MOERL_AUTO_DTYPE says what auto means on any host (the suite runs as the other kind of host would); a bad
    value is refused by name. ONEDNN_MAX_CPU_ISA held at AVX2 (an AVX2 host's kernels) makes the CPU's bf16 not
    native; at a bf16-capable ISA, or unset, the hardware decides."""
    monkeypatch.delenv(AUTO_ENV, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not native_bf16() and dtype_name("auto") == "float32" and native_bf16("cuda")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert native_bf16() == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    for name in ("bfloat16", "float32"):
        monkeypatch.setenv(AUTO_ENV, name)
        assert dtype_name("auto") == name and dtype_name("auto", "cuda") == name and f"auto = {name}" in host_summary()
    assert compute_dtype("float32") == torch.float32  # explicit names stay
    monkeypatch.setenv(AUTO_ENV, "fp16")
    with pytest.raises(ConfigError, match=r"MOERL_AUTO_DTYPE='fp16': allowed: bfloat16, float32"):
        dtype_name("auto")


def test_the_host_line_names_the_kernels_threads_and_auto(monkeypatch):
    monkeypatch.delenv(AUTO_ENV, raising=False)
    line = host_summary()
    assert torch.backends.cpu.get_cpu_capability() in line and f"{torch.get_num_threads()} threads" in line
    assert line.endswith(f"dtype auto = {dtype_name('auto')}")


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
