"""vLLM model classes with fp32 routers (registered by ``moerl.rollout.vllm_plugin``; imported by vLLM only).

Each class is vLLM's own model for one of moerl's architectures, with every MoE gate rebuilt in fp32 after
``__init__`` and every MoE router hooked to report its chosen experts (``moerl.rollout.vllm_routes``). Where vLLM's
own class would route or load a family otherwise than its checkpoint says (Gemma 4's router input in bf16, Laguna's
selection bias dropped, DBRX's experts not found, sigmoid routing on the CPU build), the class mends that, each
named where it is done; nothing else changes.
"""

from __future__ import annotations

import re

import torch
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.models.cohere2_moe import Cohere2MoeForCausalLM
from vllm.model_executor.models.dbrx import DbrxForCausalLM
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.laguna import LagunaForCausalLM
from vllm.model_executor.models.llama4 import Llama4ForCausalLM
from vllm.model_executor.models.longcat_flash import LongcatFlashForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.olmoe import OlmoeForCausalLM
from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from moerl.model.norms import unit_rms
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


class _UnitRMS(torch.nn.Module):
    """moerl's router input norm (``unit_rms``) in fp32 from any input dtype."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unit_rms(x.float(), self.eps)


def fp32_router_inputs(model: torch.nn.Module) -> int:
    """Gemma 4's routers norm and scale their input before the gate: made fp32 as moerl's are (the norm's output,
    the 1 / sqrt(H) factor and the learned scales), where vLLM computes them in the model dtype and so would hand
    the fp32 gate bf16-rounded inputs. Returns how many."""
    found = [m for m in model.modules() if type(m).__name__ == "Gemma4Router"]
    for m in found:
        m.norm = _UnitRMS(m.norm.variance_epsilon)
        m.register_buffer("root_size", torch.tensor(m.hidden_size**-0.5, dtype=torch.float32), persistent=False)
        for name in ("scale", "per_expert_scale"):
            setattr(m, name, torch.nn.Parameter(getattr(m, name).detach().float(), requires_grad=False))
    return len(found)


def cpu_sigmoid_routing(model: torch.nn.Module) -> int:
    """Let vLLM's CPU router serve sigmoid routing without expert groups (Laguna, AFMoE); returns how many routers.

    The CPU build's router selects experts by a plain top-k only for softmax scores and asserts otherwise; its
    grouped top-k takes sigmoid scores and a selection bias, and with one group of every expert it selects exactly
    what an ungrouped top-k does (the one group is always chosen), with the same weights.
    """
    from moerl.rollout.vllm_routes import moe_routers

    changed = 0
    for router in moe_routers(model):
        if type(router).__name__ != "CPURouter" or router.use_grouped_topk or router.custom_routing_function:
            continue
        if router.scoring_func != "softmax":
            router.use_grouped_topk, router.num_expert_group, router.topk_group = True, 1, 1
            changed += 1
    return changed


def _with_fp32_router(base: type, renames: dict[str, str] | None = None, own: dict[str, str] | None = None) -> type:
    """``base`` with fp32 gates and hooked routers. Where ``base``'s loader misses a checkpoint name (the checkpoint
    load and every weight sync go through ``load_weights``): ``renames`` maps a name suffix to the one its loader
    knows, ``own`` maps a name suffix its loader drops to the parameter that holds it, copied here."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        fp32_gates(self)
        fp32_router_inputs(self)
        cpu_sigmoid_routing(self)
        bind(self)  # R3: each router reports the experts it chose (recorded once moerl asks)

    def load_weights(self, weights):
        params, mine = dict(self.named_parameters()), set()

        def rest():
            for name, tensor in weights:
                name = next((name.removesuffix(a) + b for a, b in renames.items() if name.endswith(a)), name)
                target = next((name.removesuffix(a) + b for a, b in own.items() if name.endswith(a)), None)
                if target is None:
                    yield name, tensor
                    continue
                with torch.no_grad():
                    params[target].copy_(tensor)
                mine.add(target)

        return set(base.load_weights(self, rest())) | mine

    renames, own = renames or {}, own or {}
    body = {"__init__": __init__} | ({"load_weights": load_weights} if renames or own else {})
    return type(base.__name__.replace("ForCausalLM", "Fp32Router"), (base,), body)


Qwen3MoeFp32Router = _with_fp32_router(Qwen3MoeForCausalLM)
Qwen2MoeFp32Router = _with_fp32_router(Qwen2MoeForCausalLM)
MixtralFp32Router = _with_fp32_router(MixtralForCausalLM)
OlmoeFp32Router = _with_fp32_router(OlmoeForCausalLM)
DeepseekV3Fp32Router = _with_fp32_router(DeepseekV3ForCausalLM)
GptOssFp32Router = _with_fp32_router(GptOssForCausalLM)
# vLLM's Laguna keeps the selection bias on its routed experts, whose loader knows expert weights only, and its
# model's loader ignores names ending in "_bias": the engine would route without the bias, silently
LagunaFp32Router = _with_fp32_router(
    LagunaForCausalLM,
    own={".mlp.experts.e_score_correction_bias": ".mlp.experts.routed_experts.e_score_correction_bias"},
)
Cohere2MoeFp32Router = _with_fp32_router(Cohere2MoeForCausalLM)
Llama4Fp32Router = _with_fp32_router(Llama4ForCausalLM)
# vLLM's DBRX loader names its experts' parameters as they were before its MoE layers held their experts in a
# ``routed_experts`` module: every checkpoint fails to load (KeyError) without the module in the name
DbrxFp32Router = _with_fp32_router(
    DbrxForCausalLM,
    renames={f".ffn.experts.mlp.{w}": f".ffn.experts.routed_experts.mlp.{w}" for w in ("w1", "v1", "w2")},
)
Gemma4Fp32Router = _with_fp32_router(Gemma4ForCausalLM)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


class LongcatFlashFp32Router(_with_fp32_router(LongcatFlashForCausalLM)):
    """transformers writes zero rows for the zero-computation experts' projections, which vLLM's LongCat-Flash does
    not hold (its loader fails on them): they are skipped."""

    def load_weights(self, weights):
        n = self.config.n_routed_experts
        real = ((name, t) for name, t in weights if not ((m := _EXPERT.search(name)) and int(m.group(1)) >= n))
        return super().load_weights(real)
