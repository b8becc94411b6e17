"""Checks of a parallel layout against the model, run before any rank starts work."""

from __future__ import annotations

from pathlib import Path

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig
from moerl.model.mixers import is_recurrent


def model_config(path: str | None, arch: str, preset: str) -> ModelConfig | None:
    """The ModelConfig a run trains: from ``path``'s config.json, or of ``arch`` at ``preset`` size (None when the
    checkpoint is not there: loading it names that)."""
    if path is None:
        from moerl.presets import preset_config

        return preset_config(arch, preset)[1]
    if not (Path(path) / "config.json").exists():
        return None
    from moerl.bridges.base import HFConfig
    from moerl.bridges.checkpoint import read_config
    from moerl.bridges.find import get_bridge

    source = str(Path(path) / "config.json")
    hf = read_config(path)
    return get_bridge(hf, source=source).config_from_hf(HFConfig(hf, source))


def check_layout(
    dp: int,
    ep: int,
    pp: int,
    cfg: ModelConfig,
    schedule: str = "1f1b",
    stages: list[int] | None = None,
    cp: int = 1,
) -> None:
    """Refuse, by name, a layout this model cannot take (or moerl does not build)."""
    check_context(cp, pp, cfg)
    if cfg.num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the model's {cfg.num_experts} experts per MoE layer")
    if pp == 1:
        return
    n_stages = pp * (2 if schedule == "interleaved_1f1b" else 1)
    if n_stages > cfg.num_layers:
        raise ConfigError(
            f"parallel.pp={pp} with schedule {schedule!r} needs {n_stages} stages of at least one layer; the model has "
            f"{cfg.num_layers} layers"
        )
    if stages and (len(stages) != n_stages or sum(stages) != cfg.num_layers or min(stages) < 1):
        raise ConfigError(
            f"parallel.stages={stages}: needs {n_stages} layer counts of at least 1 that add up to the model's "
            f"{cfg.num_layers} layers"
        )


def check_context(cp: int, pp: int, cfg: ModelConfig) -> None:
    """Refuse, by name, a context-parallel layout this model cannot take (or moerl does not build)."""
    if cp == 1:
        return
    recurrent = sorted({kind for kind in cfg.layer_types if is_recurrent(kind)})
    if recurrent:
        raise ConfigError(
            f"parallel.cp={cp} with a model whose {', '.join(recurrent)} layers keep a state across the sequence: "
            "splitting their tokens over ranks is not built; set parallel.cp=1"
        )
    if cfg.index_topk:
        raise ConfigError(
            f"parallel.cp={cp} with DeepSeek sparse attention (index_topk={cfg.index_topk}): its indexer scores every "
            "key for each query, which split tokens do not have; set parallel.cp=1"
        )
    heads = sorted({cfg.heads(i) for i in range(cfg.num_layers)})
    if any(n % cp for n in heads):
        raise ConfigError(
            f"parallel.cp={cp} must divide the model's {'/'.join(map(str, heads))} attention heads (each cp rank "
            "attends over whole rows for its share of the heads)"
        )
    if pp > 1:
        raise ConfigError(
            f"parallel.cp={cp} with parallel.pp={pp}: context parallelism across pipeline stages is not "
            "built; set one of them to 1"
        )
