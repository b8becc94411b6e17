"""The trainer: Policy (in a training mode, ``moerl.modes``), batches, optimizer and schedule, checkpoints."""

from moerl.errors import TrainingStopped
from moerl.trainer.batch import Batch
from moerl.trainer.config import OptimConfig, PolicyConfig
from moerl.trainer.policy import Policy

__all__ = ["Batch", "OptimConfig", "Policy", "PolicyConfig", "TrainingStopped"]
