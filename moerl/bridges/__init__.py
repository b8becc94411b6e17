"""Bridges: HF architectures onto the generic MoE model (config mapping + weight names), load and export."""

from moerl.bridges.base import Bridge, Fused, HFConfig, Preset, Rule
from moerl.bridges.checkpoint import export_model, load_model, read_config
from moerl.bridges.registry import bridge_for_arch, get_bridge, register, supported

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
    "register",
    "supported",
]
