"""The baseline of ``sync_bandwidth.py``'s ``vllm-reload`` contender: moerl's vLLM worker extension with its commit
going through vLLM's general in-place ``reload_weights`` (then every MoE layer's post-load packing: a full sync
touches them all), which is how moerl's worker committed before it loaded through the model's own loaders."""

from __future__ import annotations

import torch

from moerl.rollout.vllm_worker import MoerlWorkerExtension


class ReloadCommit(MoerlWorkerExtension):
    def moerl_commit(self) -> int:
        staged, self._moerl_staged = getattr(self, "_moerl_staged", []), []
        model = self.model_runner.get_model()
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
            for module in model.modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is not None:
                    kernel.fused_experts.process_weights_after_loading(module)
        return len(staged)
