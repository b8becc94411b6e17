"""The CPU backend: C kernels for an engine's own model on a CPU, installed on the model from outside by module
swaps (``moerl.model.swap``), as gpt-fast swaps in its quantized linear layers. The model stays plain PyTorch and
never imports this package; an engine that builds its model on a CPU asks for it (``install``).

A swapped module runs its kernel where the kernel applies (no autograd, not inside a compiled graph, on the CPU,
its dtypes) and its plain module's forward everywhere else, so a model with the backend installed computes what the
plain one does, to the kernels' rounding.
"""

from __future__ import annotations

from torch import nn

from moerl.cpu.attention import KernelAttention
from moerl.cpu.experts import KernelExperts, KernelLoraExperts, k_major
from moerl.cpu.kernels import kernel
from moerl.cpu.linear import KernelLinear, KernelLoraLinear
from moerl.cpu.moe import KernelRouter
from moerl.cpu.norms import KernelRMSNorm
from moerl.model.attention import Attention
from moerl.model.linear import Linear
from moerl.model.lora import LoraExperts, LoraLinear
from moerl.model.moe import Experts, Router
from moerl.model.norms import RMSNorm
from moerl.model.swap import replace_module, swapped
from moerl.model.transformer import MoEModel

# a plain module's class -> the backend's class that takes it over (a mode's other classes, MXFP8's, stay theirs)
SWAPS = {
    RMSNorm: KernelRMSNorm,
    Router: KernelRouter,
    Attention: KernelAttention,
    Linear: KernelLinear,
    LoraLinear: KernelLoraLinear,
    Experts: KernelExperts,
    LoraExperts: KernelLoraExperts,
}


def install(model: MoEModel) -> None:
    """Lay ``model`` out for an engine's decode on a CPU and swap in the backend's modules, where its kernels build.
    The experts' weights go K-major in any case (``k_major``: MKL's prefill GEMMs gain too). Again after a mode
    swaps modules (adapters attached): modules already the backend's stay."""
    model.backend = "cpu"
    for i in model.moe_layer_ids:
        k_major(model.layers[i].mlp.experts)
    if kernel() is None or model.embed_tokens.weight.device.type != "cpu":
        return
    for name, module in list(model.named_modules()):
        if type(module) in SWAPS:
            replace_module(model, name, kernel_module(module))


def kernel_module(module: nn.Module) -> nn.Module:
    """The backend's module for plain ``module`` (a new one holding its state, laid out for decode), or ``module``
    itself where the backend has none for its class."""
    cls = SWAPS.get(type(module))
    if cls is None:
        return module
    new = swapped(module, cls)
    if hasattr(new, "lay_out"):
        new.lay_out()
    return new
