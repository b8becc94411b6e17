"""PEFT adapter directories <-> moerl adapter tensors (the format ``LLMEngine.add_adapter`` and LoRA slots take).

Reads ``adapter_config.json`` + ``adapter_model.safetensors`` for the model's HF architecture:
- linear layers (``target_modules``): ``{module}.lora_A.weight`` [r, in], ``.lora_B.weight`` [out, r];
- 3D experts (``target_parameters``, PEFT's ParamWrapper): ``{experts}.lora_A.weight`` [r * E, in] (expert-major
  rows), ``.lora_B.weight`` [out, r * E] (rank-major columns); with both expert parameters targeted, gate_up is
  the inner wrapper (``{experts}.base_layer.lora_*``) and down the outer one;
- per-expert linear layers (the pre-v5 layout, ``experts.{e}.gate_proj`` ...), gate and up joined as one LoRA of
  rank 2r (A stacked, B block-diagonal).
Each module's scale (alpha / r, or alpha / sqrt(r) with rsLoRA; rank_pattern / alpha_pattern honoured) is folded
into B, so every module comes back with scale 1.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moerl.bridges.base import Bridge, _compile, match, model_name
from moerl.bridges.checkpoint import moerl_rules, resolve
from moerl.bridges.find import get_bridge
from moerl.errors import CheckpointError

PREFIX = "base_model.model."


def _pattern_value(patterns: dict, key: str, default):
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(pattern, key) or re.fullmatch(rf"(.*\.)?{pattern}", key):
            return value
    return default


def _rows(rule, cfg, b: torch.Tensor, save: bool = False) -> torch.Tensor:
    """LoRA B ``b`` [..., out, r] with the output-row reordering ``rule``'s transform makes to its parameter (PEFT
    import; ``save``: export). A rule that transforms its tensor without saying how (``Rule.rows``) is refused."""
    fn, transform = (rule.rows_save, rule.save) if save else (rule.rows, rule.load)
    if fn is None and transform is not None:
        raise CheckpointError(
            f"LoRA adapter on {rule.hf!r}: the bridge's rule for it transforms the weight on "
            f"{'export' if save else 'load'} but does not say how the adapter's rows follow (Rule.rows"
            f"{'_save' if save else ''}); adapters on this module are not supported"
        )
    return b if fn is None else fn(b, cfg)


def _rows_of(rules: list, cfg, b: torch.Tensor, save: bool = True) -> torch.Tensor:
    """``_rows`` for a parameter the checkpoint holds as one tensor (one rule) or as several (per-expert gate / up
    parts), where no part may transform."""
    if len(rules) == 1:
        return _rows(rules[0][0], cfg, b, save=save)
    moving = [r.hf for r, _ in rules if any(f is not None for f in (r.load, r.save, r.rows, r.rows_save))]
    if moving:
        raise CheckpointError(f"LoRA adapter on {moving[0]!r}: a transform on one part of a split tensor: not built")
    return b


def read_peft_adapter(path: str | os.PathLike, model) -> dict[str, torch.Tensor]:
    """moerl-named adapter tensors (scales folded into B) for ``model`` from a PEFT adapter directory."""
    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise CheckpointError(f"{f} does not exist: not a PEFT adapter directory")
    cfg = _read_config(cfg_file)
    _check_base(cfg_file, cfg, model)
    scale = _scaler(cfg)
    modules = _load_modules(weights)
    rd = _Reading(weights.name, model, get_bridge(model.hf_config), dict(model.named_parameters()), scale)
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (module, part, e) -> A, B
    for hf_module, ab in modules.items():
        a, b = _factors(rd.file, hf_module, ab)
        experts = _wrapped_experts(rd, hf_module)
        if experts is not None:
            out |= _read_experts(rd, hf_module, experts, a, b)
        else:
            _read_linear(rd, hf_module, a, b, out, per_expert)
    for module in sorted({k[0] for k in per_expert}):
        out |= _join_per_expert(rd, module, per_expert)
    _pad_untargeted(out, model.config)
    return out


def adapter_rank(path: str | os.PathLike) -> int:
    """The largest LoRA rank of the PEFT adapter directory ``path`` (``r`` and its ``rank_pattern``): the rank an
    engine's adapter slots need to hold it."""
    cfg_file = Path(path) / "adapter_config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} does not exist: not a PEFT adapter directory")
    cfg = _read_config(cfg_file)
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise CheckpointError(f"{cfg_file}: LoRA ranks (r, rank_pattern) must be ints >= 1, got {ranks}")
    return max(ranks)


# -- reading: the adapter's files -------------------------------------------------------------------------------


def _read_config(cfg_file: Path) -> dict:
    """``adapter_config.json``, refused unless it describes a plain LoRA (not DoRA, not another PEFT method)."""
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise CheckpointError(f"{cfg_file}: DoRA adapters are not supported")
    return cfg


def _check_base(cfg_file: Path, cfg: dict, model) -> None:
    """Refuse, naming both architectures, an adapter made for another architecture than ``model``'s: LoRA tensor
    names and shapes can coincide across families (attention projections), so an adapter of one would load silently
    onto the other. Its architecture is the base model class PEFT's ``auto_mapping`` records (moerl writes it), else
    the ``architectures`` of its base's config.json (``base_model_name_or_path``: a checkpoint directory, or a hub id
    in the Hugging Face cache); where neither says (a base moved or never fetched here), the adapter loads."""
    ours = (model.hf_config.get("architectures") or ["?"])[0]
    for theirs, said_by in _adapter_archs(cfg_file, cfg):
        if theirs != ours:
            raise CheckpointError(
                f"{cfg_file}: the adapter was made for a {theirs} model ({said_by}), not for this {ours} model; "
                f"load it onto a {theirs} checkpoint"
            )


def _adapter_archs(cfg_file: Path, cfg: dict) -> list[tuple[str, str]]:
    """The architectures adapter config ``cfg`` names, each with the field that names it."""
    found = []
    mapping = cfg.get("auto_mapping")
    if mapping is not None:
        if not isinstance(mapping, dict) or not isinstance(mapping.get("base_model_class"), str):
            raise CheckpointError(f"{cfg_file}: auto_mapping must be an object with a base_model_class string")
        found.append((mapping["base_model_class"], f"auto_mapping.base_model_class {mapping['base_model_class']!r}"))
    base = cfg.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise CheckpointError(f"{cfg_file}: base_model_name_or_path must be a string, got {type(base).__name__}")
    archs = _base_archs(base) if base else None
    if archs:
        found.append((archs[0], f"base_model_name_or_path {base!r}, whose config.json says {archs[0]}"))
    return found


def _base_archs(base: str) -> list[str] | None:
    """The ``architectures`` of checkpoint ``base``'s config.json (a directory, or a hub id with a config.json in
    the Hugging Face cache, read without a network call), or None where it is not here to read (or unreadable: the
    base is not what is being loaded, so its own faults do not refuse the adapter)."""
    from moerl.bridges.checkpoint import read_config
    from moerl.hub import HUB_ID

    config = Path(base).expanduser() / "config.json"
    if not config.is_file() and HUB_ID.match(base):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base, "config.json")
        config = Path(cached) if isinstance(cached, str) else config
    if not config.is_file():
        return None
    try:
        hf = read_config(config.parent)
    except CheckpointError:
        return None
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    return archs if isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs) else None


def _scaler(cfg: dict) -> Callable[[str, int], float]:
    """PEFT's scale of a module's LoRA by its key and rank: alpha / r, or alpha / sqrt(r) with rsLoRA (the
    ``alpha_pattern`` entry matching the key, else ``lora_alpha``)."""
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))

    def scale(key: str, rank: int) -> float:
        a = float(_pattern_value(cfg.get("alpha_pattern"), key, alpha))
        return a / rank**0.5 if rslora else a / rank

    return scale


def _load_modules(weights: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter's tensors by HF module (``base_model.model.`` dropped), as ``{"lora_A": .., "lora_B": ..}`` fp32."""
    raw = {k.removeprefix(PREFIX): v for k, v in load_file(weights).items()}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight", key)
        if m is None:
            raise CheckpointError(
                f"{weights.name}: unexpected tensor {key!r} (expected *.lora_A.weight / *.lora_B.weight)"
            )
        modules.setdefault(m.group(1), {})[m.group(2)] = t.float()
    return modules


def _factors(file: str, hf_module: str, ab: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's A [r, in] and B [out, r], refused unless both are there with one rank r >= 1."""
    if set(ab) != {"lora_A", "lora_B"}:
        raise CheckpointError(f"{file}: module {hf_module!r} has {sorted(ab)}, needs lora_A and lora_B")
    a, b = ab["lora_A"], ab["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] == 0 or a.shape[0] != b.shape[1]:
        raise CheckpointError(
            f"{file}: module {hf_module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
            "needs [r, in] and [out, r] with the same rank r >= 1"
        )
    return a, b


# -- reading: one module per target kind ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reading:
    """What every module of one adapter is read against: the weights file's name (errors name it), the model, its
    bridge and parameters, and PEFT's scale per module."""

    file: str
    model: torch.nn.Module
    bridge: Bridge
    params: dict[str, torch.nn.Parameter]
    scale: Callable[[str, int], float]


def _wrapped_experts(rd: _Reading, hf_module: str) -> str | None:
    """The moerl experts module (``layers.{i}.mlp.experts``) when ``hf_module`` is PEFT's ParamWrapper on a layer's
    3D experts (``{experts}`` or its inner ``{experts}.base_layer``); None for any other module."""
    if rd.bridge.peft_experts is None:
        return None
    layer = match(_compile(rd.bridge.peft_experts), hf_module.removesuffix(".base_layer"))
    if layer is None:
        return None
    # the moerl layer of HF layer i, as the bridge's expert rules place it (LongCat-Flash's: 2i)
    rule = next((r for r in rd.bridge.rules if r.moerl.endswith(".mlp.experts.gate_up_proj")), None)
    i = layer["i"] if rule is None else rule.moerl_groups(layer)["i"]
    return f"layers.{i}.mlp.experts" if f"layers.{i}.mlp.experts.gate_up_proj" in rd.params else None


def _read_experts(rd: _Reading, hf_module: str, moerl_module: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """One 3D-experts projection (``target_parameters``): A's rows are expert-major [r * E, in], B's columns
    rank-major [out, r * E]; gate_up or down is told by the shapes (by B's rows unless 2 * I == H)."""
    mcfg = rd.model.config
    e, h, i = mcfg.num_experts, mcfg.hidden_size, mcfg.moe_intermediate_size
    is_gate_up = b.shape[0] == 2 * i if 2 * i != h else a.shape[1] == h
    # transformers stacks gate_up rows for the zero-computation experts too (LongCat-Flash's): theirs are dropped
    n = e + mcfg.zero_experts if is_gate_up else e
    rank = a.shape[0] // n
    if rank == 0 or a.shape[0] % n:
        raise CheckpointError(
            f"{rd.file}: expert module {hf_module!r} has lora_A {tuple(a.shape)}: its rows must be "
            f"{'num_experts + zero_experts' if n != e else 'num_experts'}={n} x rank r >= 1"
        )
    a_e = a.view(n, rank, a.shape[1])[:e]  # [E, r, in]
    b_e = b.view(b.shape[0], rank, n).permute(2, 0, 1)[:e]  # [E, out, r]
    name = "gate_up_proj" if is_gate_up else "down_proj"
    b_e = b_e * rd.scale(f"{hf_module.removesuffix('.base_layer')}.{name}", rank)
    b_e = _rows_of(moerl_rules(rd.bridge, f"{moerl_module}.{name}"), mcfg, b_e, save=False)
    part = "gate_up" if is_gate_up else "down"
    return {
        f"{moerl_module}.{part}_A": a_e,
        f"{moerl_module}.{part}_B": b_e,
        f"{moerl_module}.scale": torch.tensor(1.0),
    }


def _read_linear(
    rd: _Reading,
    hf_module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    out: dict[str, torch.Tensor],
    per_expert: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One linear layer (``target_modules``) into ``out``; one expert's linear layer (the pre-v5 layout) into
    ``per_expert``, joined once every expert's gate / up / down is read."""
    place = resolve(rd.bridge, rd.params, f"{hf_module}.weight")
    if place is None:
        raise CheckpointError(
            f"{rd.file}: adapter module {hf_module!r} matches no layer of this "
            f"{rd.model.hf_config['architectures'][0]} model"
        )
    rule, groups, target, _ = place
    b = _rows(rule, rd.model.config, b * rd.scale(hf_module, a.shape[0]))
    if "e" in groups:  # one expert's linear layer (pre-v5 layout)
        part = rule.part or "down"
        per_expert[(target.rsplit(".", 1)[0], part, int(groups["e"]))] = (a, b)
        return
    module = target.removesuffix(".weight")
    out[f"{module}.lora_A"], out[f"{module}.lora_B"], out[f"{module}.scale"] = a, b, torch.tensor(1.0)


def _join_per_expert(
    rd: _Reading, module: str, per_expert: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """``module``'s per-expert gate / up / down LoRAs as moerl's expert adapter: gate and up joined as one LoRA of
    rank 2r (A stacked, B block-diagonal); refused unless every expert has all three."""
    num_experts = rd.model.config.num_experts
    got = {(part, e) for (mod, part, e) in per_expert if mod == module}
    want = {(p, e) for p in ("gate", "up", "down") for e in range(num_experts)}
    if got != want:
        missing = sorted(want - got)[:3]
        raise CheckpointError(f"{rd.file}: per-expert adapter of {module!r} lacks (part, expert) {missing}")
    gu_a, gu_b, dn_a, dn_b = [], [], [], []
    for e in range(num_experts):
        (ga, gb), (ua, ub), (da, db) = (per_expert[(module, p, e)] for p in ("gate", "up", "down"))
        gu_a.append(torch.cat([ga, ua]))
        gu_b.append(torch.block_diag(gb, ub))
        dn_a.append(da)
        dn_b.append(db)
    return {
        f"{module}.gate_up_A": torch.stack(gu_a),
        f"{module}.gate_up_B": torch.stack(gu_b),
        f"{module}.down_A": torch.stack(dn_a),
        f"{module}.down_B": torch.stack(dn_b),
        f"{module}.scale": torch.tensor(1.0),
    }


def _pad_untargeted(out: dict[str, torch.Tensor], mcfg) -> None:
    """Experts with only one projection targeted get a zero rank-1 LoRA on the other: the expert adapter holds
    both."""
    for key in [k for k in out if k.endswith(".gate_up_A") or k.endswith(".down_A")]:
        module, part = key.rsplit(".", 1)
        other = "down" if part == "gate_up_A" else "gate_up"
        if f"{module}.{other}_A" not in out:
            e, h, i = mcfg.num_experts, mcfg.hidden_size, mcfg.moe_intermediate_size
            d_in, d_out = (i, h) if other == "down" else (h, 2 * i)
            out[f"{module}.{other}_A"], out[f"{module}.{other}_B"] = torch.zeros(e, 1, d_in), torch.zeros(e, d_out, 1)


# -- writing ----------------------------------------------------------------------------------------------------


# model types whose Mamba out_proj PEFT refuses to adapt (peft's own list: its fused CUDA kernels read the weight)
PEFT_NO_MAMBA_OUT_PROJ = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")


def write_peft_adapter(model, out_dir: str | os.PathLike, slot: int = 0, base: str | None = None) -> Path:
    """Write adapter ``slot`` of ``model`` as a PEFT directory that ``peft.PeftModel.from_pretrained`` loads onto
    the transformers model (and vLLM reads): linear layers by ``target_modules``, the 3D experts by
    ``target_parameters`` (gate_up the inner ParamWrapper, down the outer).

    Scales are folded into B (``lora_alpha`` = r). ``shared_outer`` experts are written per expert: the shared
    gate_up A and down B are repeated for every expert, which gives the same function; PEFT and vLLM know no
    shared layout. Dense-MLP and shared-expert adapters are refused: on transformers v5 MoE models PEFT maps
    every ``gate_proj`` / ``up_proj`` / ``down_proj`` target to the fused experts, so it cannot load them.
    ``base``: the base checkpoint's path, recorded as ``base_model_name_or_path``.
    """
    from moerl.model.lora import LinearLora, lora_modules

    bridge = get_bridge(model.hf_config)
    tensors, target_modules, linear_ranks, expert_ranks = {}, set(), set(), set()
    for path, lora in lora_modules(model).items():
        if isinstance(lora, LinearLora):
            hf_name, a, b = _write_linear(model, bridge, path, lora, slot)
            tensors[f"{PREFIX}{hf_name}.lora_A.weight"], tensors[f"{PREFIX}{hf_name}.lora_B.weight"] = a, b
            target_modules.add(hf_name.rsplit(".", 1)[-1])
            linear_ranks.add(a.shape[0])
        else:
            rank, expert_tensors = _write_experts(model, bridge, path, lora, slot)
            tensors |= expert_tensors
            expert_ranks.add(rank)
    gate_up = "up_proj" if model.config.activation == "relu2" else "gate_up_proj"  # un-gated experts: the up rows
    config = _peft_config(bridge, target_modules, linear_ranks, expert_ranks, gate_up)
    config["base_model_name_or_path"] = base
    config["auto_mapping"] = _auto_mapping(model.hf_config)  # the architecture: read_peft_adapter checks it
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def _write_linear(model, bridge: Bridge, path: str, lora, slot: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """A linear layer's HF module name, A [r, in] and B [out, r] (scale folded in, rows in HF order); dense-MLP
    and shared-expert layers are refused (PEFT would put them on the fused experts)."""
    from moerl.bridges.checkpoint import to_hf

    s = lora.scale[slot].detach().float()
    model_type = (model.hf_config or {}).get("model_type")
    if path.rsplit(".", 1)[-1] == "out_proj" and model_type in PEFT_NO_MAMBA_OUT_PROJ:
        raise CheckpointError(
            f"adapter on {path!r} cannot be written for PEFT: PEFT refuses LoRA on a Mamba layer's out_proj for "
            f"model_type {model_type!r}; export merged weights instead "
            "(export_model(..., state_dict=merged_state_dict(model))) or leave out_proj out of lora.targets"
        )
    if path.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj"):
        raise CheckpointError(
            f"adapter on {path!r} cannot be written for PEFT: on transformers v5 MoE models PEFT maps "
            f"gate_proj / up_proj / down_proj targets to the fused experts; export merged weights instead "
            f"(export_model(..., state_dict=merged_state_dict(model))) or leave dense MLPs out of lora.targets"
        )
    weight = model.get_parameter(f"{path}.weight")
    hf_name = next(iter(to_hf(bridge, f"{path}.weight", weight, model.config)))[0].removesuffix(".weight")
    hf_name = model_name(hf_name)  # the module's path in transformers' model
    for f in bridge.fused:
        if any(p.match(f"{hf_name}.weight") for p in f._parts_re):
            raise CheckpointError(
                f"adapter on {path!r} cannot be written for PEFT: the checkpoint stores that projection fused "
                f"with others ({f.hf.format(i='{i}')}), and one PEFT adapter cannot hold two; export merged weights "
                "instead (export_model(..., state_dict=merged_state_dict(model)))"
            )
    ((rule, _),) = moerl_rules(bridge, f"{path}.weight")
    a, b = lora.lora_A[slot].detach().float(), lora.lora_B[slot].detach().float() * s
    return hf_name, a, _rows(rule, model.config, b, save=True)


def _write_experts(model, bridge: Bridge, path: str, lora, slot: int) -> tuple[int, dict[str, torch.Tensor]]:
    """An expert adapter's rank and its two ParamWrapper tensor pairs (gate_up the inner ``base_layer``, down the
    outer): A expert-major [E * r, in], B rank-major [out, r * E], scale folded in, rows in HF order."""
    if bridge.peft_experts is None:
        raise CheckpointError(
            f"adapter on {path!r} cannot be written for PEFT: {bridge.architectures[0]}'s experts in transformers "
            "are a module per projection, which PEFT's target_parameters do not address; export merged weights "
            "instead (export_model(..., state_dict=merged_state_dict(model))) or leave experts out of lora.targets"
        )
    s = lora.scale[slot].detach().float()
    e = lora.num_experts
    gu_a, gu_b, dn_a, dn_b = (
        getattr(lora, k)[slot].detach().float() for k in ("gate_up_A", "gate_up_B", "down_A", "down_B")
    )
    if gu_a.ndim == 2:  # shared_outer: the shared factors, once per expert
        gu_a, dn_b = gu_a.expand(e, *gu_a.shape), dn_b.expand(e, *dn_b.shape)
    gu_b, dn_b = gu_b * s, dn_b * s
    gu_b = _rows_of(moerl_rules(bridge, f"{path}.gate_up_proj"), model.config, gu_b)
    dn_b = _rows_of(moerl_rules(bridge, f"{path}.down_proj"), model.config, dn_b)
    if model.config.zero_experts:  # transformers' gate_up has the zero-computation experts' rows too: zero adapters
        z = model.config.zero_experts
        gu_a, gu_b = (torch.cat([t, t.new_zeros(z, *t.shape[1:])]) for t in (gu_a, gu_b))
    rank = gu_a.shape[1]
    hf_experts = bridge.peft_experts.format(i=_hf_layer(bridge, path))
    tensors = {}
    for name, a, b in ((f"{hf_experts}.base_layer", gu_a, gu_b), (hf_experts, dn_a, dn_b)):
        n = a.shape[0]
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.reshape(n * rank, a.shape[-1]).contiguous()  # expert-major
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * n).contiguous()
    return rank, tensors


def _hf_layer(bridge: Bridge, path: str) -> str:
    """The HF layer index of moerl experts module ``path`` (``layers.{i}.mlp.experts``)."""
    ((_, groups), *_) = moerl_rules(bridge, f"{path}.gate_up_proj")
    return groups["i"]


def _auto_mapping(hf_config: dict) -> dict[str, str]:
    """PEFT's record of the base model class (the architecture) and the transformers module that defines it."""
    import transformers

    arch = (hf_config.get("architectures") or ["?"])[0]
    try:
        library = getattr(transformers, arch).__module__
    except (AttributeError, ImportError):  # a family transformers does not have (yet): the package itself
        library = "transformers"
    return {"base_model_class": arch, "parent_library": library}


def _peft_config(
    bridge: Bridge, target_modules: set[str], linear_ranks: set[int], expert_ranks: set[int], gate_up: str
) -> dict:
    """``adapter_config.json``: one rank (or one for linear layers and one for the experts, by ``rank_pattern``),
    ``lora_alpha`` = r since the scales are folded into B; ``gate_up``: the experts' first parameter's name."""
    if len(linear_ranks) > 1 or len(expert_ranks) > 1:
        raise CheckpointError(f"adapter ranks differ between modules ({linear_ranks | expert_ranks}); cannot write")
    r = next(iter(linear_ranks or expert_ranks))
    experts = (bridge.peft_experts or "").removeprefix("model.layers.{i}.")  # e.g. mlp.experts
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": r,  # the scales are folded into B
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(target_modules),
        "target_parameters": [f"{experts}.{gate_up}", f"{experts}.down_proj"] if expert_ranks else None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "task_type": "CAUSAL_LM",
    }
    if expert_ranks and linear_ranks and expert_ranks != linear_ranks:
        re_ = next(iter(expert_ranks))
        config["rank_pattern"] = {r".*\.gate_up_proj": re_, r".*\.down_proj": re_}
        config["alpha_pattern"] = dict(config["rank_pattern"])
    return config
