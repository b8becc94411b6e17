"""vLLM model classes with fp32 routers (registered by ``moerl.rollout.vllm_plugin``; imported by vLLM only)."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM


def fp32_gates(model: torch.nn.Module) -> int:
    """Replace every MoE gate by an fp32 one (fp32 weight, fp32 logits from fp32-cast inputs); returns how many.

    The MoE layer's runner calls the gate object it was given, so every reference in the module tree is replaced,
    not only ``mlp.gate`` (which weight loading uses).
    """
    old_to_new = {}
    for module in model.modules():
        for name, child in list(module.named_children()):
            if isinstance(child, GateLinear) and child.weight.dtype != torch.float32:
                new = old_to_new.get(id(child))
                if new is None:
                    new = GateLinear(
                        child.input_size,
                        child.output_size,
                        bias=child.bias is not None,
                        params_dtype=torch.float32,
                        out_dtype=torch.float32,
                        force_fp32_compute=True,
                        prefix=child.prefix,
                    )
                    old_to_new[id(child)] = new
                setattr(module, name, new)
    return len(old_to_new)


class Qwen3MoeFp32Router(Qwen3MoeForCausalLM):
    """vLLM's Qwen3-MoE with fp32 routers."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        fp32_gates(self)
