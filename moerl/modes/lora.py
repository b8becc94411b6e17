"""lora: the base frozen in the compute dtype, fp32 adapters on attention, dense MLPs and every expert train; the
reference is the same model with its adapters off.

A sync sends the adapters only (one slot, moerl names) into the engine's adapter ``policy``; an engine of plain
weights (vLLM) gets the weights the adapters touch merged (W + scale * B @ A summed in fp32, in its dtype; the router
untouched: moerl puts no adapter on it). The run exports a PEFT adapter, or merged weights where PEFT cannot express
the adapters.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moerl.errors import ConfigError
from moerl.model.lora import attach_lora, merged_weights, slot_tensors
from moerl.modes.base import Mode


class LoRA(Mode):
    name = "lora"
    masters = False  # the adapters are fp32 themselves
    adapter_slot = 0
    reference_copy = False  # the reference is the policy's own model, adapters off

    def prepare(self, model, cfg) -> None:
        model.requires_grad_(False)
        attach_lora(model, cfg.lora, dtype=torch.float32)
        for n, p in model.named_parameters():
            p.requires_grad_(".lora." in n)

    def trained_modules(self, model, cfg) -> None:
        attach_lora(model, cfg.lora, dtype=torch.float32)

    def reference(self, model, cfg, dtype):
        return None  # the policy's own model with its adapters off

    def check_run(self, engine: str, ranks: int) -> None:
        if engine == "vllm" and ranks > 1:
            raise ConfigError(
                f"rollout.engine=vllm with policy.mode=lora on {ranks} trainer ranks: not built (the merged-weight "
                "sync runs in one trainer process); use rollout.engine=native or parallel sizes of 1"
            )

    def sends_adapter(self, dense: str | None) -> bool:
        return not dense

    def own_tensors(self, policy, dense, part_bytes: int = 256 * 2**20):  # adapters and merged weights: whole
        layout = policy.layout
        with layout.gathered_here(base=bool(dense)):  # small: the adapters together (the base experts only to merge)
            if dense:  # the touched weights, merged: one module's at a time
                merged = merged_weights(policy.model, self.adapter_slot, getattr(torch, dense))
                yield from ((n, layout.whole(n, t)) for n, t in merged)
            else:
                yield from slot_tensors(policy.model, self.adapter_slot).items()

    def export(self, policy, run_dir: Path) -> dict[str, str]:
        """A PEFT adapter in ``run_dir/adapter``; where PEFT cannot express the adapters (fused projections),
        the merged weights in ``run_dir/merged`` and why."""
        from moerl.bridges import export_model
        from moerl.bridges.peft import write_peft_adapter
        from moerl.errors import CheckpointError
        from moerl.model.lora import merged_state_dict

        with policy.gathered() as model:  # a sharded policy's adapters, whole
            try:
                write_peft_adapter(model, run_dir / "adapter", base=str(policy.checkpoint.resolve()))
                return {"adapter": str(run_dir / "adapter")}
            except CheckpointError as e:
                export_model(model, run_dir / "merged", state_dict=merged_state_dict(model))
                return {"merged": str(run_dir / "merged"), "adapter_note": str(e)}
