"""Activation checkpointing (``policy.activation_checkpointing``), applied to the model from outside as FSDP is: each
decoder block of a training forward keeps only its inputs and is computed again in the backward
(``torch.utils.checkpoint``, non-reentrant). ``selective`` also keeps the attention's output, the most expensive op
to compute again for what it weighs.

A recomputed MoE block routes every token to the experts the forward chose: its router's choice is kept from the
forward and replayed in the recomputation (whether R3 replays the engine's choice or not), so a recomputation whose
scores round otherwise (another kernel, atomics) still trains the experts the forward used. The replayed gate
weights are the same gathers of the same scores as the router's own top-k (``Router.forward``)."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

CHECKPOINTING = ("none", "full", "selective")

# what ``selective`` keeps from the forward: attention's output (every SDPA kernel torch may pick, those this torch has)
KEPT = {
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
}


def apply_checkpointing(model: torch.nn.Module, how: str) -> int:
    """Make each of ``model``'s decoder blocks recompute its activations in the backward (``how``: full or
    selective; none leaves them); returns how many."""
    if how == "none":
        return 0
    run = partial(recompute, selective=how == "selective")
    n = 0
    for layer in model.layers:
        if hasattr(layer, "recompute"):  # another pipeline stage's layers are placeholders
            layer.recompute = run
            n += 1
    return n


def recompute(layer, block, x, cos, sin, mask, replay, passed, selective: bool = False):
    """``block(x, cos, sin, mask, replay, None, passed)`` of decoder ``layer``, keeping only its inputs for the
    backward, which computes it again with the experts the forward chose."""
    kept: list[torch.Tensor] = []  # the forward's choice of experts, replayed by the recomputation
    if replay is None and layer.routes:
        # every row routes itself (-1), through the router's replay path: the path the recomputation takes with the
        # kept choice, so both save the same tensors (torch checks that they do) and compute the same gate weights
        router = layer.mlp.router if layer.is_moe else layer.self_attn.router
        rows = (x.shape[0] * x.shape[1], *([2] if layer.routes == 2 else []), router.top_k)
        replay = torch.full(rows, -1, dtype=torch.long, device=x.device)

    def run(x, cos, sin, mask, replay):
        out, idx = block(x, cos, sin, mask, kept[0] if kept else replay, None, passed)
        if idx is not None and not kept:
            kept.append(idx.detach())
        return out, idx

    context = partial(create_selective_checkpoint_contexts, _keep_attention) if selective else None
    extra = {"context_fn": context} if context is not None else {}
    return checkpoint(run, x, cos, sin, mask, replay, use_reentrant=False, **extra)


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE
