"""The trainer: Policy (lora | full | mxfp8), batches, optimizer and schedule, checkpoints."""

from moerl.trainer.batch import Batch
from moerl.trainer.policy import OptimConfig, Policy, PolicyConfig, TrainingStopped

__all__ = ["Batch", "OptimConfig", "Policy", "PolicyConfig", "TrainingStopped"]
