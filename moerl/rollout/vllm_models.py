"""vLLM model classes with fp32 routers (registered by ``moerl.rollout.vllm_plugin``; imported by vLLM only).

Each class is vLLM's own model for one of moerl's architectures, with every MoE gate rebuilt in fp32 after
``__init__`` and every MoE router hooked to report its chosen experts (``moerl.rollout.vllm_routes``); nothing else
changes.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.olmoe import OlmoeForCausalLM
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from moerl.rollout.vllm_routes import bind


def _fp32_copy(gate: GateLinear) -> GateLinear:
    new = GateLinear(
        gate.input_size,
        gate.output_size,
        bias=gate.bias is not None,
        params_dtype=torch.float32,
        out_dtype=torch.float32,
        force_fp32_compute=True,
        skip_bias_add=gate.skip_bias_add,
        prefix=gate.prefix,
        return_bias=gate.return_bias,
    )
    # DeepSeek-V3 hangs its (already fp32) selection bias on the gate; the MoE layer holds the same Parameter
    if hasattr(gate, "e_score_correction_bias"):
        new.e_score_correction_bias = gate.e_score_correction_bias
    return new


def fp32_gates(model: torch.nn.Module) -> int:
    """Replace every MoE gate by an fp32 one (fp32 weight, fp32 logits from fp32-cast inputs); returns how many.

    The MoE layer's runner calls the gate object it was given, so every reference in the module tree is replaced,
    not only ``mlp.gate`` (which weight loading uses).
    """
    old_to_new: dict[int, GateLinear] = {}
    for module in model.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, GateLinear) and child.weight.dtype != torch.float32:
                if id(child) not in old_to_new:
                    old_to_new[id(child)] = _fp32_copy(child)
                setattr(module, name, old_to_new[id(child)])
    return len(old_to_new)


def _with_fp32_router(base: type) -> type:
    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        fp32_gates(self)
        bind(self)  # R3: each router reports the experts it chose (recorded once moerl asks)

    return type(base.__name__.replace("ForCausalLM", "Fp32Router"), (base,), {"__init__": __init__})


Qwen3MoeFp32Router = _with_fp32_router(Qwen3MoeForCausalLM)
Qwen2MoeFp32Router = _with_fp32_router(Qwen2MoeForCausalLM)
MixtralFp32Router = _with_fp32_router(MixtralForCausalLM)
OlmoeFp32Router = _with_fp32_router(OlmoeForCausalLM)
DeepseekV3Fp32Router = _with_fp32_router(DeepseekV3ForCausalLM)
GptOssFp32Router = _with_fp32_router(GptOssForCausalLM)
