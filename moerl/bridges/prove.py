"""Zero-code bridges, proven: the tiny transformers instance of a config and the moerl model of its derived bridge
(``moerl.bridges.derive``) run the same tokens; the bridge is accepted at fp32 parity (``TOL``) with equal router
choices. Behaviour names cannot show (renormalised top-k or not, softmax before or after the top-k, q/k norms before
or after the rotation, ...) is tried in ``variants`` order: the first that passes wins. Otherwise the refusal names
the first layer and quantity that differ. ``moerl check-arch DIR`` runs this and prints the derived bridge as a file
to commit (``bridge_source``).
"""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from moerl.bridges.base import Bridge, HFConfig
from moerl.bridges.checkpoint import loads_config
from moerl.bridges.derive import (
    SYNONYMS,
    TENSOR_FEATURES,
    TOL,
    Layout,
    arch_name,
    by_kind,
    check_known,
    derive,
    moe_layers,
    one_block_kinds,
    read_layout,
    variants,
)
from moerl.errors import ConfigError, UnknownArchitectureError

SHRINK = {
    "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 256,
    "moe_shared_expert_intermediate_size": 48,
}  # fmt: skip


def tiny_config(hf: dict) -> dict:
    """``hf`` at test size: the same switches, small dimensions, 8 experts (top-2 at most), up to 4 layers."""
    small = dict(hf)
    for key, value in SHRINK.items():
        if key in small and small[key] is not None:
            small[key] = min(small[key], value) if key != "head_dim" else value
    heads, kv = hf.get("num_attention_heads", 4), hf.get("num_key_value_heads") or hf.get("num_attention_heads", 4)
    small["num_key_value_heads"] = 4 if kv == heads else 2
    for key in SYNONYMS["num_experts"]:
        if key in small:
            small[key] = 8
    for key in SYNONYMS["top_k"]:
        if key in small:
            small[key] = min(small[key], 2)
    n = hf.get("num_hidden_layers", 2)
    keep = max([2, hf.get("first_k_dense_replace", 0) + 1, *[i + 1 for i in hf.get("mlp_only_layers") or []]])
    kinds = []
    if isinstance(hf.get("hybrid_override_pattern"), str) and not hf.get("layers_block_type"):  # Nemotron-H's
        small["layers_block_type"] = list(hf["hybrid_override_pattern"])  # its letters, one a layer
        small.pop("hybrid_override_pattern")
    if isinstance(small.get("layers_block_type"), list):  # Nemotron-H: the list is the layer count
        n = len(small["layers_block_type"])
    lists = []
    for key in ("layer_types", "mlp_layer_types", "layers_block_type", "indexer_types"):
        listed = small.get(key) if isinstance(small.get(key), list) else []
        keep = max([keep, *(listed.index(k) + 1 for k in set(listed))])  # a layer of every kind
        kinds += listed
        lists += [listed] if listed else []
    if len(lists) > 1:  # and of every combination of kinds (Cohere2-MoE's full MoE layers, not only its dense one)
        combos = list(zip(*lists, strict=False))
        keep = max([keep, *(combos.index(k) + 1 for k in set(combos))])
    # Jamba's period fields: up to the first attention layer and the first MoE layer
    offsets = [hf[k] + 1 for k in ("attn_layer_offset", "expert_layer_offset") if isinstance(hf.get(k), int)]
    keep = max([keep, *offsets])
    small["num_hidden_layers"] = min(n, max(keep, 2), max(4, keep if kinds or offsets else 4))
    for key in (
        "layer_types", "mlp_layer_types", "layer_rope_theta", "layers_block_type", "indexer_types",
        "num_attention_heads_per_layer", "no_rope_layers",
    ):  # fmt: skip
        if isinstance(small.get(key), list):
            small[key] = small[key][: small["num_hidden_layers"]]
    if isinstance(small.get("per_layer_config"), dict):  # Gemma 4's full layers' own head size and KV heads, cut
        small["per_layer_config"] = _tiny_per_layer(hf, small)
    if isinstance(hf.get("global_head_dim"), int) and isinstance(hf.get("head_dim"), int):  # its hub configs' spelling
        small["global_head_dim"] = SHRINK["head_dim"] * (2 if hf["global_head_dim"] > hf["head_dim"] else 1)
    kv = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    if isinstance(hf.get("num_global_key_value_heads"), int) and isinstance(kv, int):
        small["num_global_key_value_heads"] = max(
            1, small["num_key_value_heads"] * hf["num_global_key_value_heads"] // kv
        )
    if isinstance(small.get("moe_layers"), list):  # Llama 4's MoE layers by index
        small["moe_layers"] = [i for i in small["moe_layers"] if isinstance(i, int) and i < small["num_hidden_layers"]]
    if isinstance(small.get("num_attention_heads_per_layer"), list):  # the checkpoint's own head counts, not 4
        small["num_attention_heads"] = hf["num_attention_heads"]
    if isinstance(hf.get("hybrid_override_pattern"), str) and not hf.get("layers_block_type"):
        small["hybrid_override_pattern"] = "".join(small.pop("layers_block_type"))
    factors = _rotary_factors(hf)
    if factors and "head_dim" in small and not small.get("kv_lora_rank"):  # the tiny head keeps its rotary dims even
        small["head_dim"] = next((d for d in (16, 32, 48, 64) if _even_rotary(d, factors)), small["head_dim"])
    for key, size in (("sliding_window", 8), ("attention_chunk_size", 8), ("floor_scale", 4)):
        if small.get(key):  # a window, a chunk, a temperature step the proof's 16 tokens cross
            small[key] = min(small[key], size)
    # linear-attention layers: 2 key heads, twice as many value heads if it has more
    if "linear_num_key_heads" in small:
        more = (hf.get("linear_num_value_heads") or 0) > (hf.get("linear_num_key_heads") or 0)
        small |= {"linear_num_key_heads": 2, "linear_num_value_heads": 4 if more else 2}
        small |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    if (small.get("n_group") or 1) > 1:  # group-limited routing: 4 groups of 2 of the 8 experts, 2 groups chosen
        small |= {"n_group": 4, "topk_group": 2}
    if small.get("kv_lora_rank"):  # latent attention: small ranks, the rotary part transformers reads as head_dim
        small |= {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
        small |= {"head_dim": 8} | ({"qk_head_dim": 24} if "qk_head_dim" in small else {})
        if small.get("q_lora_rank"):
            small["q_lora_rank"] = 32
    # an indexer keeping 4 of the proof's 16 keys: the selection shows; 16 heads, so that no two keys tie at a score of
    # exactly 0 (every head's ReLU zero: 1 in 2^16), where transformers' top-k picks by its own layout
    if small.get("mamba_n_heads"):  # 4 heads of 32 (expand 2 x 64), 16 states, chunks of 8: several per sequence
        small |= {"mamba_n_heads": 4, "mamba_d_head": "auto", "mamba_d_state": 16, "mamba_chunk_size": 8}
        small |= {"mamba_expand": 2, "mamba_n_groups": 2 if (hf.get("mamba_n_groups") or 1) > 1 else 1}
    if small.get("mamba_num_heads"):  # Nemotron-H's spelling: 4 heads of 32, 16 states, chunks of 8
        small |= {"mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16, "chunk_size": 8}
        small["n_groups"] = 2 if (hf.get("n_groups") or 1) > 1 else 1
    if small.get("index_topk"):
        small |= {"index_topk": 4, "index_n_heads": 16, "index_head_dim": 16}
    for key, default in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(small.get(key), int) and small[key] >= small.get("vocab_size", 128):
            small[key] = default
    return small


def _tiny_per_layer(hf: dict, small: dict) -> dict:
    """Gemma 4's ``per_layer_config`` for the tiny layers: twice the tiny head size where the checkpoint's is larger
    than its top-level one, its KV heads in the same ratio to the tiny top-level ones (at least 1)."""
    out = {}
    for key, over in hf["per_layer_config"].items():
        if not (str(key).isdigit() and int(key) < small["num_hidden_layers"] and isinstance(over, dict)):
            out[key] = over  # out of the tiny model's layers, or not a layer's: refused by name where it matters
            continue
        over = dict(over)
        if isinstance(over.get("head_dim"), int) and isinstance(hf.get("head_dim"), int):
            over["head_dim"] = 2 * SHRINK["head_dim"] if over["head_dim"] > hf["head_dim"] else SHRINK["head_dim"]
        kv = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
        if isinstance(over.get("num_key_value_heads"), int) and isinstance(kv, int):
            over["num_key_value_heads"] = max(1, small["num_key_value_heads"] * over["num_key_value_heads"] // kv)
        out[key] = over
    return {k: v for k, v in out.items() if not (str(k).isdigit() and int(k) >= small["num_hidden_layers"])}


def _rotary_factors(hf: dict) -> list[float]:
    """Every ``partial_rotary_factor`` of config ``hf``: at its top, in its ``rope_parameters``, in those of each layer
    kind."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    found = [hf.get("partial_rotary_factor"), params.get("partial_rotary_factor")]
    found += [p.get("partial_rotary_factor") for p in params.values() if isinstance(p, dict)]
    return [float(f) for f in found if isinstance(f, int | float) and not isinstance(f, bool)]


def _even_rotary(head_dim: int, factors: list[float]) -> bool:
    """Whether each factor rotates an even number (>= 2) of a ``head_dim`` head's dims, or all of them."""
    dims = [int(head_dim * f) for f in factors]
    return all(d == head_dim or (d >= 2 and d % 2 == 0) for d in dims)


def hf_forward(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    """A transformers model's logits, each router's chosen experts [N, k] in the order they ran and its per-layer
    hidden states.

    The choices are read off the routers (modules whose class name ends in Router or Gate, as the one integer tensor
    of their output, or scores zero off the chosen experts: Llama 4's; in Gating, their logits' top-k: JetMoE's) or,
    where the router gives neither (a bare linear layer: Jamba's; logits alone: DBRX's), off the experts' input
    (modules whose class name ends in Experts, as the one integer tensor among their arguments)."""
    by_router, by_experts, hooks = [], [], []

    def one_int(module, tensors, into: list, scores: bool) -> None:
        ints = [t for t in tensors if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if not ints and scores:
            ints = [_nonzero(t) for t in tensors if isinstance(t, torch.Tensor) and _nonzero(t) is not None][:1]
        if len(ints) > 1:
            raise UnknownArchitectureError(f"{type(module).__name__} returned {len(ints)} integer tensors, not 1")
        into.extend(t.detach() for t in ints)

    for module in model.modules():
        name = type(module).__name__.lower()
        if name.endswith(("router", "gate")):
            hooks.append(module.register_forward_hook(lambda m, args, out: one_int(m, out, by_router, True)))
        elif name.endswith("gating"):  # JetMoE's TopKGating returns its pairs sorted by expert: its logits' top-k
            hooks.append(module.register_forward_hook(lambda m, args, out: by_router.append(top_logits(m, out))))
        elif name.endswith("experts"):
            hooks.append(module.register_forward_pre_hook(lambda m, args: one_int(m, args, by_experts, False)))
    if not hooks:
        raise UnknownArchitectureError(
            f"no router found in {type(model).__name__} (no module class *Router or *Gate, nor *Experts)"
        )
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out.logits, by_router or by_experts, out.hidden_states


def top_logits(module, out) -> torch.Tensor:
    """The chosen experts [N, k] of a gating module whose last output is its logits [N, E] (``top_k`` of them)."""
    return out[-1].detach().topk(module.top_k, dim=-1).indices


def _nonzero(scores: torch.Tensor) -> torch.Tensor | None:
    """The chosen experts [N, k] of router scores [N, E] that are zero off them (the same k in every row), else
    None."""
    if scores.ndim != 2 or not scores.is_floating_point():
        return None
    counts = (scores != 0).sum(-1)
    k = int(counts[0]) if counts.numel() else 0
    if not 0 < k < scores.shape[1] or not bool((counts == k).all()):
        return None
    return scores.abs().topk(k, dim=-1).indices


def _close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """A layer's output within TOL of transformers', relative to the output's magnitude when that exceeds 1."""
    return float((ours - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max()))


def _first_difference(model, bridge_hidden, ref_hidden, ours_routed, ref_choices) -> str:
    for i, (a, b) in enumerate(zip(bridge_hidden, ref_hidden[1:], strict=False)):
        if not _close(a, b):
            return f"layer {i} output differs by {float((a - b).abs().max()):.2e}"
    for j, ref in enumerate(ref_choices):
        ours = ours_routed[:, :, j].reshape(-1, ours_routed.shape[-1])
        if not torch.equal(ours.sort(-1).values, ref.sort(-1).values):
            return f"router {j} (model layer {model.route_columns[j]}) chose other experts"
    return "the logits differ"


SHARP = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "wq_b.weight", "wk.weight")


def prove(hf: dict) -> tuple[Bridge, dict, Layout]:
    """Derive the bridge for config ``hf`` and prove it on a tiny transformers instance; returns (bridge, variant,
    layout) or raises UnknownArchitectureError naming what could not be derived or where the proof failed."""
    check_known(hf)
    small = tiny_config(hf)
    ref, gen = _reference(hf, small)
    ids = torch.randint(0, small.get("vocab_size", 128), (2, 16), generator=gen)
    try:
        logits, choices, hidden = hf_forward(ref, ids)
    except UnknownArchitectureError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' own model fails on this config at test size
        first = " ".join(str(e).split())[:300]
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: transformers' model fails on its tiny instance: "
            f"{type(e).__name__}: {first}"
        ) from None
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        # every process proves its own: transformers writes a checkpoint on rank 0 alone once torch.distributed is up
        ref.should_save_on_this_rank = lambda is_main_process: True
        ref.save_pretrained(tmp)
        saved = loads_config((Path(tmp) / "config.json").read_text())
        layout = _layout(hf, Path(tmp), saved)
        for variant in variants(saved, layout):
            failure = _differs(hf, tmp, derive(saved, layout, variant), ids, logits, choices, hidden)
            if failure is None:
                bridge = derive(hf, layout, variant)
                # the checkpoint's own fields, which the tiny instance cut (its layers, their RoPEs): refused here too
                bridge.config_from_hf(HFConfig(hf, f"{arch_name(hf)} config"))
                return bridge, variant, layout
            failures.append(failure)
    raise UnknownArchitectureError(
        f"cannot derive a bridge for {arch_name(hf)}: no variant matches transformers at fp32 {TOL} "
        f"(first difference: {failures[0]})"
    )


def _reference(hf: dict, small: dict) -> tuple[torch.nn.Module, torch.Generator]:
    """transformers' model of config ``small`` (``hf`` at test size), fp32, with random weights and buffers, and
    the generator that drew them (the proof's tokens come next from it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in small.items() if k not in ("architectures", "model_type", "transformers_version")}
    try:
        config = AutoConfig.for_model(small.get("model_type"), **fields)
    except (ValueError, KeyError) as e:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: transformers does not know it ({e})"
        ) from None
    except Exception as e:  # noqa: BLE001 - transformers' own check of a value moerl does not read itself
        first = " ".join(str(e).split())[:300]
        raise ConfigError(f"config.json: transformers refuses it for {arch_name(hf)}: {first}") from None
    config.architectures = [arch_name(hf)]
    torch.manual_seed(0)
    try:
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 - a value transformers' model cannot be built with
        first = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"config.json: transformers cannot build {arch_name(hf)} from it: {type(e).__name__}: {first}"
        ) from None
    if type(ref).__name__ != arch_name(hf):
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: model_type {small.get('model_type')!r} builds "
            f"{type(ref).__name__} in transformers, not the architecture config.json names"
        )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # q and k sharper than the rest: attention far from uniform, so where RoPE goes (or not) shows
            scale = (0.16 if name.endswith(SHARP) else 0.02) if p.ndim >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
        saved = set(ref.state_dict())  # every buffer the checkpoint holds (a selection bias): make it matter too
        for name, b in ref.named_buffers():
            if name in saved and b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
    return ref, gen


def _layout(hf: dict, directory: Path, saved: dict) -> Layout:
    """The tensor layout of the tiny checkpoint in ``directory`` (its config ``saved``); refused where its tensors
    show what moerl's decoder does not compute, or its MoE layers differ from what its config says."""
    from safetensors import safe_open

    shapes = {}
    for f in directory.glob("*.safetensors"):
        with safe_open(f, "pt") as handle:
            shapes |= {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}
    features = {f for n in shapes for key, f in TENSOR_FEATURES.items() if f".{key}." in n}
    if features:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: its tensors show {'; '.join(sorted(features))}, which "
            "moerl's decoder does not compute"
        )
    try:
        layout = by_kind(read_layout(shapes), saved.get("layer_types") or [])
    except UnknownArchitectureError as e:
        raise UnknownArchitectureError(f"cannot derive a bridge for {arch_name(hf)}: {e}") from None
    tiny = HFConfig(saved, "the tiny config")
    if layout.one_block:  # Nemotron-H: the MoE blocks of its layer kinds
        by_config = [i for i, b in enumerate(one_block_kinds(tiny)) if b == "moe"]
    else:
        by_config = moe_layers(tiny, saved["num_hidden_layers"])
    if tuple(by_config) != layout.moe_layers:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {arch_name(hf)}: its config's layer pattern gives MoE layers {by_config}, "
            f"its tensors show {list(layout.moe_layers)}"
        )
    return layout


def _differs(hf: dict, directory: str, bridge: Bridge, ids, logits, choices, hidden) -> str | None:
    """Where the moerl model of the tiny checkpoint in ``directory`` through ``bridge`` first differs from
    transformers' (its ``logits``, router ``choices`` and ``hidden`` states on ``ids``), or None: it matches."""
    from moerl.bridges.checkpoint import read_model

    try:
        model = read_model(directory, bridge, torch.float32)
    except Exception as e:  # noqa: BLE001 - a tensor it cannot place, a knob it cannot build: the reason
        why = str(e).removeprefix(f"cannot derive a bridge for {arch_name(hf)}: ")
        raise UnknownArchitectureError(f"cannot derive a bridge for {arch_name(hf)}: {why}") from None
    ours_hidden = []
    hooks = [layer.register_forward_hook(lambda m, a, out: ours_hidden.append(out[0])) for layer in model.layers]
    with torch.no_grad():
        out = model(ids, capture=True)
    for h in hooks:
        h.remove()
    routed_ok = len(choices) == len(model.route_columns) and all(
        torch.equal(out.routed[:, :, j].reshape(-1, model.config.top_k).sort(-1).values, c.sort(-1).values)
        for j, c in enumerate(choices)
    )
    # every layer but the last (transformers hands that one back normed) within TOL of its own scale: logits alone
    # can hide a wrong variant (GraniteMoe's logits_scaling shrinks them below TOL)
    layers_ok = all(_close(a, b) for a, b in zip(ours_hidden[:-1], hidden[1:-1], strict=False))
    if float((out.logits - logits).abs().max()) <= TOL and routed_ok and layers_ok:
        return None
    return _first_difference(model, ours_hidden, hidden, out.routed, choices)


@lru_cache(maxsize=16)
def _proven(key: str) -> Bridge:
    return prove(json.loads(key))[0]


def derived_bridge(hf: dict) -> Bridge:
    """The proven derived bridge for config ``hf`` (once per process and config)."""
    return _proven(json.dumps(hf, sort_keys=True))


def bridge_source(hf: dict, variant: dict, layout: Layout) -> str:
    """The derived bridge as a Python file (what ``moerl check-arch`` prints): saved as moerl/bridges/NAME.py with
    ``"ARCH": "NAME"`` added to ``moerl.bridges.registry.FAMILIES``, it is the architecture's bridge file."""
    arch = arch_name(hf)
    return f'''"""{arch}: derived by `moerl check-arch` and proven against transformers at fp32 {TOL}.
A bridge file: add "{arch}": "<this file's name>" to FAMILIES in moerl/bridges/registry.py."""

from moerl.bridges.derive import Layout, derive

LAYOUT = {layout!r}
VARIANT = {variant!r}
CONFIG = {json.dumps({k: v for k, v in hf.items() if k in ("architectures", "model_type")})}

BRIDGE = derive(CONFIG, LAYOUT, VARIANT)
'''
