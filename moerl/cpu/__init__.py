"""The CPU backend: C kernels for an engine's own model on a CPU, installed on the model from outside by module
swaps (``moerl.model.swap``), as gpt-fast swaps in its quantized linear layers. The model stays plain PyTorch and
never imports this package; an engine that builds its model on a CPU asks for it (``install``).

A swapped module runs its kernel where the kernel applies (no autograd, not inside a compiled graph, on the CPU,
its dtypes) and its plain module's forward everywhere else, so a model with the backend installed computes what the
plain one does, to the kernels' rounding.
"""

from __future__ import annotations

from moerl.cpu.attention import KernelAttention
from moerl.cpu.moe import KernelRouter
from moerl.cpu.norms import KernelRMSNorm
from moerl.model.attention import Attention
from moerl.model.moe import Router
from moerl.model.norms import RMSNorm
from moerl.model.packed import kernel
from moerl.model.swap import replace_module, swapped
from moerl.model.transformer import MoEModel

# a plain module's class -> the backend's class that takes it over
SWAPS = {RMSNorm: KernelRMSNorm, Router: KernelRouter, Attention: KernelAttention}


def install(model: MoEModel) -> None:
    """Lay ``model`` out for an engine's decode on a CPU (``MoEModel.decode_layout``) and swap in the backend's
    modules, where its kernels build. Again after adapters are attached: modules already swapped stay."""
    model.decode_layout()
    if kernel() is None or model.embed_tokens.weight.device.type != "cpu":
        return
    for name, module in list(model.named_modules()):
        cls = SWAPS.get(type(module))
        if cls is not None:
            replace_module(model, name, swapped(module, cls))
