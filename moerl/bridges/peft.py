"""PEFT adapter directories -> moerl adapter tensors (the format ``LLMEngine.add_adapter`` and LoRA slots take).

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
from pathlib import Path

import torch
from safetensors.torch import load_file

from moerl.bridges.checkpoint import resolve
from moerl.bridges.registry import get_bridge
from moerl.errors import CheckpointError

PREFIX = "base_model.model."


def _pattern_value(patterns: dict, key: str, default):
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(pattern, key) or re.fullmatch(rf"(.*\.)?{pattern}", key):
            return value
    return default


def read_peft_adapter(path: str | os.PathLike, model) -> dict[str, torch.Tensor]:
    """moerl-named adapter tensors (scales folded into B) for ``model`` from a PEFT adapter directory."""
    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise CheckpointError(f"{f} does not exist: not a PEFT adapter directory")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise CheckpointError(f"{cfg_file}: DoRA adapters are not supported")
    alpha, rslora = float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))

    def scale(key: str, rank: int) -> float:
        a = float(_pattern_value(cfg.get("alpha_pattern"), key, alpha))
        return a / rank**0.5 if rslora else a / rank

    raw = {k.removeprefix(PREFIX): v for k, v in load_file(weights).items()}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight", key)
        if m is None:
            raise CheckpointError(
                f"{weights.name}: unexpected tensor {key!r} (expected *.lora_A.weight / *.lora_B.weight)"
            )
        modules.setdefault(m.group(1), {})[m.group(2)] = t.float()

    bridge = get_bridge(model.hf_config)
    params = dict(model.named_parameters())
    mcfg = model.config
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (module, part, e) -> A, B
    for hf_module, ab in modules.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{weights.name}: module {hf_module!r} has {sorted(ab)}, needs lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        experts_module = hf_module.removesuffix(".base_layer")
        place = resolve(bridge, params, f"{experts_module}.gate_up_proj")
        if experts_module.endswith("experts") and place is not None:  # a ParamWrapper on the 3D experts
            moerl_module = place[2].removesuffix(".gate_up_proj")
            e, h, i = mcfg.num_experts, mcfg.hidden_size, mcfg.moe_intermediate_size
            rank = a.shape[0] // e
            a_e = a.view(e, rank, a.shape[1])  # [E, r, in]
            b_e = b.view(b.shape[0], rank, e).permute(2, 0, 1)  # [E, out, r]
            is_gate_up = b.shape[0] == 2 * i if 2 * i != h else a.shape[1] == h
            name = "gate_up_proj" if is_gate_up else "down_proj"
            b_e = b_e * scale(f"{experts_module}.{name}", rank)
            if is_gate_up:
                if bridge.gate_up_rows is not None:
                    b_e = bridge.gate_up_rows(b_e)
                out[f"{moerl_module}.gate_up_A"], out[f"{moerl_module}.gate_up_B"] = a_e, b_e
            else:
                out[f"{moerl_module}.down_A"], out[f"{moerl_module}.down_B"] = a_e, b_e
            out[f"{moerl_module}.scale"] = torch.tensor(1.0)
            continue
        place = resolve(bridge, params, f"{hf_module}.weight")
        if place is None:
            raise CheckpointError(
                f"{weights.name}: adapter module {hf_module!r} matches no layer of this "
                f"{model.hf_config['architectures'][0]} model"
            )
        rule, groups, target, _ = place
        b = b * scale(hf_module, a.shape[0])
        if "e" in groups:  # one expert's linear layer (pre-v5 layout)
            part = rule.part or "down"
            per_expert[(target.rsplit(".", 1)[0], part, int(groups["e"]))] = (a, b)
            continue
        module = target.removesuffix(".weight")
        out[f"{module}.lora_A"], out[f"{module}.lora_B"], out[f"{module}.scale"] = a, b, torch.tensor(1.0)

    for module in sorted({k[0] for k in per_expert}):
        got = {(part, e) for (mod, part, e) in per_expert if mod == module}
        want = {(p, e) for p in ("gate", "up", "down") for e in range(mcfg.num_experts)}
        if got != want:
            missing = sorted(want - got)[:3]
            raise CheckpointError(f"{weights.name}: per-expert adapter of {module!r} lacks (part, expert) {missing}")
        gu_a, gu_b, dn_a, dn_b = [], [], [], []
        for e in range(mcfg.num_experts):
            (ga, gb), (ua, ub), (da, db) = (per_expert[(module, p, e)] for p in ("gate", "up", "down"))
            gu_a.append(torch.cat([ga, ua]))
            gu_b.append(torch.block_diag(gb, ub))
            dn_a.append(da)
            dn_b.append(db)
        out[f"{module}.gate_up_A"], out[f"{module}.gate_up_B"] = torch.stack(gu_a), torch.stack(gu_b)
        out[f"{module}.down_A"], out[f"{module}.down_B"] = torch.stack(dn_a), torch.stack(dn_b)
        out[f"{module}.scale"] = torch.tensor(1.0)

    for key in [k for k in out if k.endswith(".gate_up_A") or k.endswith(".down_A")]:  # one projection targeted
        module, part = key.rsplit(".", 1)
        other = "down" if part == "gate_up_A" else "gate_up"
        if f"{module}.{other}_A" not in out:
            e, h, i = mcfg.num_experts, mcfg.hidden_size, mcfg.moe_intermediate_size
            d_in, d_out = (i, h) if other == "down" else (h, 2 * i)
            out[f"{module}.{other}_A"], out[f"{module}.{other}_B"] = torch.zeros(e, 1, d_in), torch.zeros(e, d_out, 1)
    return out
