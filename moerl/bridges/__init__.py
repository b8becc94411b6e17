"""Bridges: HF architectures onto the generic MoE model (config mapping + weight names), load and export."""

from moerl.bridges.base import Bridge, Fused, HFConfig, Preset, Rule
from moerl.bridges.checkpoint import read_config
from moerl.bridges.find import export_model, get_bridge, load_model
from moerl.bridges.registry import bridge_for_arch, supported

__all__ = [
    "Bridge",
    "Fused",
    "HFConfig",
    "Preset",
    "Rule",
    "bridge_for_arch",
    "export_model",
    "get_bridge",
    "load_model",
    "read_config",
    "supported",
]
