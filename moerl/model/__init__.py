"""The generic MoE decoder."""

from moerl.model.config import ModelConfig, RopeConfig
from moerl.model.transformer import ModelOutput, MoEModel

__all__ = ["ModelConfig", "ModelOutput", "MoEModel", "RopeConfig"]
