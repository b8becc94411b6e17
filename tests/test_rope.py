"""Rotary scaling variants against transformers' own RoPE init functions (fp32, 1e-6 relative)."""

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moerl.bridges import HFConfig
from moerl.model.rope import inv_freq_and_scale

PARAMS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("name", PARAMS)
def test_inv_freq_matches_transformers(name):
    hf = Qwen3MoeConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=163840,
        rope_parameters=dict(PARAMS[name]),
    )
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[PARAMS[name]["rope_type"]](hf, "cpu")
    rope = HFConfig(hf.to_dict(), "test").rope()
    freq, scale = inv_freq_and_scale(rope, 64, hf.max_position_embeddings)
    torch.testing.assert_close(freq, ref_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-9)
