"""moerl's vLLM plugin (entry point ``vllm.general_plugins``): fp32 routers in vLLM, as in moerl's trainer.

vLLM builds its MoE models' routers (``GateLinear``) in the model dtype, so a bf16 engine routes with bf16 weights and
logits, and an fp32 router pushed into it is rounded silently. The plugin registers, under each architecture name
moerl supports, a subclass whose gates hold fp32 weights and compute fp32 logits from fp32-cast hidden states. vLLM
loads general plugins in every one of its processes (the driver, the engine core, the workers), which an in-script
``ModelRegistry.register_model`` cannot reach. It acts only when ``MOERL_VLLM_FP32_ROUTER=1`` is set (moerl's vLLM
engine sets it), so installing moerl changes nothing for other users of vLLM.
"""

from __future__ import annotations

import os

ENV = "MOERL_VLLM_FP32_ROUTER"
# moerl's architectures (HF ``architectures`` names, vLLM's registry keys) -> their fp32-router classes
MODELS = {
    arch: f"moerl.rollout.vllm_models:{arch.replace('ForCausalLM', 'Fp32Router')}"
    for arch in (
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        "OlmoeForCausalLM",
        "DeepseekV3ForCausalLM",
        "GptOssForCausalLM",
        "LagunaForCausalLM",
        "Cohere2MoeForCausalLM",
        "Llama4ForCausalLM",
        "DbrxForCausalLM",
        "Gemma4ForCausalLM",
        "LongcatFlashForCausalLM",
    )
}

# served by vLLM's GPU builds only: what the CPU build lacks that the family's vLLM model takes (refused there by name)
GPU_ONLY = {
    "LongcatFlashForCausalLM": "routes zero-computation experts with a CUDA-only kernel (_moe_C.topk_softmax), which "
    "its LongCat-Flash takes for every MoE layer",
}


def register() -> None:
    """Register moerl's fp32-router model classes with vLLM (when asked to)."""
    if os.environ.get(ENV) != "1":
        return
    from vllm import ModelRegistry

    for arch, cls in MODELS.items():
        ModelRegistry.register_model(arch, cls)
