"""Weight sync from the trainer to the rollout engine: mode-aware, bucketed, router kept fp32."""

from moerl.sync.weights import SyncStats, sync_policy

__all__ = ["SyncStats", "sync_policy"]
