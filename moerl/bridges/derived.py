"""Zero-code bridges: a checkpoint whose architecture has no bridge file gets one derived from its config, then
proven against transformers before it is used.

Deriving: config fields from the synonyms Llama-style MoE families use (``SYNONYMS``); everything else that shapes
the model from the tensor names of a tiny random instance of the same config built with transformers (router under
``gate`` / ``router``, per-expert or fused experts, shared experts and their gate, q/k norms per head or per
projection, biases, LayerNorm, post-sublayer norms, which layers are MoE). A config field the derivation neither
reads nor knows to be inert (``INERT``) is refused by name, as is any tensor no rule places.

Proving: the tiny instance and the derived moerl model run the same tokens; the bridge is accepted at fp32 parity
(``TOL``) with equal router choices. Behaviour names cannot show (renormalised top-k or not, softmax before or after
the top-k, q/k norms before or after the rotation) is tried in ``VARIANTS`` order: the first that passes wins.
Otherwise the refusal names the first layer and quantity that differ. ``moerl check-arch DIR`` runs this and prints
the derived bridge as a file to commit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from moerl.bridges.base import (
    LINEAR_ATTENTION_RULES,
    LINEAR_FIELDS,
    Bridge,
    HFConfig,
    Preset,
    Rule,
    common_fields,
    layer_types,
    linear_attention_fields,
    minus_one,
    partial_rope_dim,
    plus_one,
    sparse_layers,
)
from moerl.errors import ConfigError, UnknownArchitectureError
from moerl.model.config import ModelConfig

TOL = 1e-4
SYNONYMS = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "shared_expert_size": ("shared_expert_intermediate_size",),
    "n_shared_experts": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
}
READ = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_theta",
    "rope_scaling", "intermediate_size", "norm_topk_prob", "attention_bias", "sliding_window", "use_sliding_window",
    "layer_types", "max_window_layers", "hidden_act", "clip_qkv",
    # what the tensor names decide (biases, which layers are MoE)
    "qkv_bias", "mlp_bias", "use_bias", "lm_head_bias", "decoder_sparse_step", "mlp_only_layers",
    "first_k_dense_replace", "moe_layer_freq", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
    # linear-attention (Gated DeltaNet) layers and the partial rotary of hybrid families
    *LINEAR_FIELDS, "linear_conv_kernel_dim", "partial_rotary_factor", "full_attention_interval",
}  # fmt: skip
INERT = {  # fields that do not change the forward pass (ids, bookkeeping, training-only losses)
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef",
    "attention_dropout", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "id2label", "label2id", "tokenizer_class",
    "pretraining_tp", "tie_encoder_decoder", "auto_map", "router_z_loss_coef", "use_return_dict", "eod_token_id",
    "sep_token_id",
    # routing noise in training; where a family uses one at inference too (PhiMoE), the proof finds the difference
    "router_jitter_noise", "input_jitter_noise",
}  # fmt: skip
# behaviour tensor names cannot show, tried in this order (norm_offset: RMSNorms that scale by 1 + w, Qwen3.5's)
VARIANTS = [
    dict(topk_before_softmax=t, qk_norm_after_rope=a, norm_offset=o)
    for o in (False, True)
    for t in (False, True)
    for a in (False, True)
]


# what the derived path reads as sizes and switches: checked for type and range before transformers sees them
COUNTS = {  # ints >= 1 (null: absent)
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "intermediate_size", "sliding_window", "max_window_layers", "decoder_sparse_step",
    "moe_layer_freq", "moe_layer_interval", *(n for names in SYNONYMS.values() for n in names),
    *LINEAR_FIELDS, "linear_conv_kernel_dim", "full_attention_interval",
}  # fmt: skip
NOT_NULL = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", *SYNONYMS["top_k"]}
INDICES = {"first_k_dense_replace", "moe_layer_start_index", "moe_layer_end_index"}  # ints >= 0
SWITCHES = {"tie_word_embeddings", "norm_topk_prob", "attention_bias", "use_sliding_window", "qkv_bias", "mlp_bias"}
POSITIVE = {"rms_norm_eps", "rope_theta", "clip_qkv", "partial_rotary_factor"}  # numbers > 0


def _typed(hf: dict) -> None:
    """Every size, index, switch and positive number of ``hf`` the derived path reads has its type and range: a
    ConfigError naming the field, not transformers' traceback."""
    for key, value in hf.items():
        if value is None and key not in NOT_NULL:
            continue
        if key in COUNTS or key in INDICES:
            least = 1 if key in COUNTS else 0
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ConfigError(f"config.json: field {key!r} must be an int >= {least}, got {value!r}")
        elif key in SWITCHES and not isinstance(value, bool):
            raise ConfigError(f"config.json: field {key!r} must be true or false, got {value!r}")
        elif key in POSITIVE and not (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ):
            raise ConfigError(f"config.json: field {key!r} must be a number > 0, got {value!r}")
    layers = hf.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        got = hf["mlp_only_layers"]
        raise ConfigError(f"config.json: field 'mlp_only_layers' must list layer indices, got {got!r}")


def _known(hf: dict) -> None:
    _typed(hf)
    synonyms = {name for names in SYNONYMS.values() for name in names}
    unknown = sorted(set(hf) - READ - INERT - synonyms)
    if unknown:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: config field(s) {', '.join(map(repr, unknown))} are not "
            "understood (a bridge file can map them; see moerl/bridges/README.md)"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise UnknownArchitectureError(f"cannot derive a bridge for {_arch(hf)}: hidden_act={hf['hidden_act']!r}")


def _arch(hf: dict) -> str:
    return (hf.get("architectures") or ["?"])[0]


def _pattern(name: str) -> str:
    """A tensor name with its layer and expert indices as placeholders."""
    name = re.sub(r"^model\.layers\.\d+\.", "model.layers.{i}.", name)
    return re.sub(r"\.experts\.\d+\.", ".experts.{e}.", name)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the tensor names (and shapes) of a checkpoint of the family say."""

    block: str  # "mlp" | "block_sparse_moe": the MoE block's module name
    router: str  # its router's module name under the block: "gate" | "router"
    experts: tuple[str, str, str] | None  # per-expert (gate, up, down) names, or None for fused 3D experts
    shared: str | None  # the shared expert's module name under the block
    shared_gate: bool
    moe_layers: tuple[int, ...]
    qk_norm: str  # none | head | full
    qk_norm_names: tuple[str, str]  # the q and k norms' module names under self_attn
    qkv_bias: bool
    o_bias: bool
    router_bias: bool
    layer_norm: bool  # LayerNorm with bias instead of RMSNorm
    post_norm: bool  # post-sublayer norms, no input norm
    tied: bool
    lm_head_bias: bool
    linear: str | None = None  # linear-attention projections: "split" (in_proj_qkv, _z, _b, _a) | "fused" (_qkvz, _ba)
    output_gate: bool = False  # q_proj yields a per-head output gate too (twice o_proj's input)


def read_layout(shapes: dict[str, tuple[int, ...]]) -> Layout:
    """The layout the tensor names ``shapes`` (name -> shape) show (names no rule then places are refused by the
    loader, by name)."""
    patterns = {_pattern(n) for n in shapes}
    router_re = r"model\.layers\.(\d+|\{i\})\.(mlp|block_sparse_moe)\.((?:gate|router)(?:\.wg|\.layer)?)\.weight"
    moe = sorted({int(m.group(1)) for n in shapes if (m := re.fullmatch(router_re, n))})
    found = [m for p in patterns if (m := re.fullmatch(router_re, p))]
    if not found:
        raise UnknownArchitectureError("no router tensor (model.layers.{i}.mlp.gate.weight, .router.weight, ...)")
    block, router = found[0].group(2), found[0].group(3)
    per_expert = {p.split(".experts.{e}.")[1].removesuffix(".weight") for p in patterns if ".experts.{e}." in p}
    experts = None
    if per_expert:
        for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            if per_expert == set(names):
                experts = names
        if experts is None:
            raise UnknownArchitectureError(f"per-expert tensors {sorted(per_expert)} are not gate / up / down")
    shared = next(
        (s for s in ("shared_expert", "shared_experts", "shared_mlp") if any(f".{block}.{s}." in p for p in patterns)),
        None,
    )
    names = next(
        (
            (q, k)
            for q, k in (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))
            if any(f"self_attn.{q}." in p for p in patterns)
        ),
        ("q_norm", "k_norm"),
    )
    q_norm = next((shape for n, shape in shapes.items() if n.endswith(f"self_attn.{names[0]}.weight")), None)
    q_proj = next((shape for n, shape in shapes.items() if n.endswith("self_attn.q_proj.weight")), None)
    if q_proj is None:
        raise UnknownArchitectureError("no self_attn.q_proj tensor (only grouped-query attention is derived)")
    o_proj = next((shape for n, shape in shapes.items() if n.endswith("self_attn.o_proj.weight")), None)
    output_gate = o_proj is not None and q_proj[0] == 2 * o_proj[1]
    qk_norm = "none" if q_norm is None else ("full" if q_norm[0] * (2 if output_gate else 1) == q_proj[0] else "head")
    linear = next(
        (
            kind
            for kind, proj in (("split", "in_proj_qkv"), ("fused", "in_proj_qkvz"))
            if any(f"linear_attn.{proj}." in p for p in patterns)
        ),
        None,
    )
    return Layout(
        block=block,
        router=router,
        experts=experts,
        shared=shared,
        shared_gate=any(p.endswith(f"{block}.shared_expert_gate.weight") for p in patterns),
        moe_layers=tuple(moe),
        qk_norm=qk_norm,
        qk_norm_names=names,
        qkv_bias=any(p.endswith("self_attn.q_proj.bias") for p in patterns),
        o_bias=any(p.endswith("self_attn.o_proj.bias") for p in patterns),
        router_bias=any(p.endswith(f"{block}.{router}.bias") for p in patterns),
        layer_norm=any(
            p.endswith("input_layernorm.bias") or p.endswith("post_attention_layernorm.bias") for p in patterns
        ),
        post_norm=any("post_feedforward_layernorm" in p for p in patterns)
        and not any("input_layernorm" in p for p in patterns),
        tied="lm_head.weight" not in shapes,
        lm_head_bias="lm_head.bias" in shapes,
        linear=linear,
        output_gate=output_gate,
    )


def moe_layers(c: HFConfig, n: int) -> list[int]:
    """The MoE layers by the config's pattern fields (every layer when it has none)."""
    d = c.data
    if "decoder_sparse_step" in d or "mlp_only_layers" in d:
        return sparse_layers(n, c.opt("decoder_sparse_step", int, 1), c.opt("mlp_only_layers", list, []))
    if "first_k_dense_replace" in d:
        return sparse_layers(n, c.opt("moe_layer_freq", int, 1), first_dense=c.opt("first_k_dense_replace", int, 0))
    if "moe_layer_start_index" in d or "moe_layer_interval" in d:
        start, end = c.opt("moe_layer_start_index", int, 0), c.opt("moe_layer_end_index", int, n - 1)
        end = n - 1 if end == -1 else end
        step = c.opt("moe_layer_interval", int, 1)
        return [i for i in range(n) if (i + 1) % step == 0 and start <= i <= end]
    return list(range(n))


def derive(hf: dict, layout: Layout, variant: dict) -> Bridge:
    """The bridge for a family with tensors laid out as ``layout``, in behaviour ``variant`` (``hf``: its config,
    for the names)."""

    def config_from_hf(c: HFConfig) -> ModelConfig:
        _known(c.data)
        f = common_fields(c)
        f["tie_word_embeddings"] = layout.tied
        n = f["num_layers"]
        use = c.opt("use_sliding_window", bool)
        if use and not c.opt("layer_types", list):
            raise UnknownArchitectureError(f"{c.source}: use_sliding_window without layer_types: not derivable")
        # a window with neither switch nor layer types slides on every layer (Mixtral's convention)
        types, window = layer_types(c, n, all_sliding=use is None, linear=layout.linear is not None)
        moe_size = c.first(SYNONYMS["moe_intermediate_size"] + ("intermediate_size",), int)
        shared = 0
        if layout.shared is not None:  # its own size, else n shared experts' worth, else one expert's
            count = next((c.req(k, int) for k in SYNONYMS["n_shared_experts"] if c.data.get(k) is not None), 1)
            shared = c.opt("shared_expert_intermediate_size", int, 0) or moe_size * count
        before = variant["topk_before_softmax"]
        moe = moe_layers(c, n)
        return ModelConfig(
            **f,
            intermediate_size=c.opt("intermediate_size", int, 0) if len(moe) < n else 0,
            num_experts=c.first(SYNONYMS["num_experts"], int),
            top_k=c.first(SYNONYMS["top_k"], int),
            moe_intermediate_size=moe_size,
            moe_layers=moe,
            qkv_bias=layout.qkv_bias,
            o_bias=layout.o_bias,
            qk_norm=layout.qk_norm,
            qk_norm_after_rope=variant["qk_norm_after_rope"] and layout.qk_norm == "head",
            clip_qkv=c.opt("clip_qkv", float),
            layer_types=types,
            sliding_window=window,
            norm="layer" if layout.layer_norm else "rms",
            norm_placement="post" if layout.post_norm else "pre",
            lm_head_bias=layout.lm_head_bias,
            router_bias=layout.router_bias,
            topk_before_softmax=before,
            norm_topk_prob=False if before else c.opt("norm_topk_prob", bool, False),
            shared_expert_size=shared,
            shared_expert_gate=layout.shared_gate,
            attn_output_gate=layout.output_gate,
            rope_dim=partial_rope_dim(c, f["head_dim"]),
            **(linear_attention_fields(c) if layout.linear is not None else {}),
        )

    hf_block = f"model.layers.{{i}}.{layout.block}"
    rules = [Rule(f"{hf_block}.{layout.router}.weight", "layers.{i}.mlp.router.weight")]
    if layout.router_bias:
        rules.append(Rule(f"{hf_block}.{layout.router}.bias", "layers.{i}.mlp.router.bias"))
    if layout.experts is not None:
        gate, up, down = layout.experts
        hf_e = f"{hf_block}.experts.{{e}}"
        rules += [
            Rule(f"{hf_e}.{gate}.weight", "layers.{i}.mlp.experts.gate_up_proj", part="gate"),
            Rule(f"{hf_e}.{up}.weight", "layers.{i}.mlp.experts.gate_up_proj", part="up"),
            Rule(f"{hf_e}.{down}.weight", "layers.{i}.mlp.experts.down_proj"),
        ]
    elif layout.block != "mlp":
        rules.append(Rule(f"{hf_block}.experts.{{x}}", "layers.{i}.mlp.experts.{x}"))
    if layout.shared is not None:
        rules.append(Rule(f"{hf_block}.{layout.shared}.{{x}}", "layers.{i}.mlp.shared_experts.{x}"))
    offset = {"load": plus_one, "save": minus_one} if variant.get("norm_offset") else {}
    if layout.qk_norm_names != ("q_norm", "k_norm") or offset:
        for theirs, ours in zip(layout.qk_norm_names, ("q_norm", "k_norm"), strict=True):
            rules.append(
                Rule(f"model.layers.{{i}}.self_attn.{theirs}.weight", f"layers.{{i}}.self_attn.{ours}.weight", **offset)
            )
    if offset:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            rules.append(Rule(f"model.layers.{{i}}.{norm}.weight", f"layers.{{i}}.{norm}.weight", **offset))
        rules.append(Rule("model.norm.weight", "norm.weight", **offset))
    fused = ()
    if layout.linear is not None:
        from moerl.bridges.qwen3_next import FUSED

        rules += LINEAR_ATTENTION_RULES
        fused = FUSED if layout.linear == "fused" else ()
    if layout.shared_gate:
        rules.append(Rule(f"{hf_block}.shared_expert_gate.weight", "layers.{i}.mlp.shared_experts_gate.weight"))
    return Bridge(
        architectures=(_arch(hf),),
        model_type=str(hf.get("model_type", "?")),
        config_from_hf=config_from_hf,
        preset_config=_no_preset,
        rules=tuple(rules),
        fused=fused,
    )


def _no_preset(p: Preset, bos: int, eos: int, pad: int) -> dict:
    raise UnknownArchitectureError("a derived bridge writes no preset configs (init-model needs a bridge file)")


SHRINK = {
    "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 256,
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
    kinds = hf.get("layer_types") if isinstance(hf.get("layer_types"), list) else []
    keep = max([keep, *(kinds.index(k) + 1 for k in set(kinds))])  # a layer of every kind
    small["num_hidden_layers"] = min(n, max(keep, 2), max(4, keep if kinds else 4))
    if isinstance(small.get("layer_types"), list):
        small["layer_types"] = small["layer_types"][: small["num_hidden_layers"]]
    if small.get("sliding_window"):
        small["sliding_window"] = min(small["sliding_window"], 8)
    # linear-attention layers: 2 key heads, twice as many value heads if it has more
    if "linear_num_key_heads" in small:
        more = (hf.get("linear_num_value_heads") or 0) > (hf.get("linear_num_key_heads") or 0)
        small |= {"linear_num_key_heads": 2, "linear_num_value_heads": 4 if more else 2}
        small |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    for key, default in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(small.get(key), int) and small[key] >= small.get("vocab_size", 128):
            small[key] = default
    return small


def hf_forward(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor], tuple]:
    """A transformers model's logits, each MoE layer's chosen experts [N, k] (read off its routers, modules whose
    class name ends in Router or Gate, as the one integer tensor of their output) and its per-layer hidden states."""
    choices, hooks = [], []

    def record(module, args, out):
        ints = [t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if len(ints) != 1:
            raise UnknownArchitectureError(f"{type(module).__name__} returned {len(ints)} integer tensors, not 1")
        choices.append(ints[0].detach())

    for module in model.modules():
        name = type(module).__name__.lower()
        if name.endswith("router") or name.endswith("gate"):
            hooks.append(module.register_forward_hook(record))
    if not hooks:
        raise UnknownArchitectureError(f"no router found in {type(model).__name__} (no module class *Router or *Gate)")
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out.logits, choices, out.hidden_states


def _first_difference(model, bridge_hidden, ref_hidden, ours_routed, ref_choices) -> str:
    for i, (a, b) in enumerate(zip(bridge_hidden, ref_hidden[1:], strict=False)):
        diff = float((a - b).abs().max())
        if diff > TOL:
            return f"layer {i} output differs by {diff:.2e}"
    for j, ref in enumerate(ref_choices):
        ours = ours_routed[:, :, j].reshape(-1, ours_routed.shape[-1])
        if not torch.equal(ours.sort(-1).values, ref.sort(-1).values):
            return f"MoE layer {j} (model layer {model.moe_layer_ids[j]}) chose other experts"
    return "the logits differ"


def prove(hf: dict) -> tuple[Bridge, dict, Layout]:
    """Derive the bridge for config ``hf`` and prove it on a tiny transformers instance; returns (bridge, variant,
    layout) or raises UnknownArchitectureError naming what could not be derived or where the proof failed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moerl.bridges.checkpoint import load_model

    _known(hf)
    small = tiny_config(hf)
    fields = {k: v for k, v in small.items() if k not in ("architectures", "model_type", "transformers_version")}
    try:
        config = AutoConfig.for_model(small.get("model_type"), **fields)
    except (ValueError, KeyError) as e:
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: transformers does not know it ({e})"
        ) from None
    except Exception as e:  # noqa: BLE001 - transformers' own check of a value moerl does not read itself
        first = " ".join(str(e).split())[:300]
        raise ConfigError(f"config.json: transformers refuses it for {_arch(hf)}: {first}") from None
    config.architectures = [_arch(hf)]
    torch.manual_seed(0)
    try:
        ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 - a value transformers' model cannot be built with
        first = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"config.json: transformers cannot build {_arch(hf)} from it: {type(e).__name__}: {first}"
        ) from None
    if type(ref).__name__ != _arch(hf):
        raise UnknownArchitectureError(
            f"cannot derive a bridge for {_arch(hf)}: model_type {small.get('model_type')!r} builds "
            f"{type(ref).__name__} in transformers, not the architecture config.json names"
        )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) * (0.02 if p.ndim >= 2 else 0.1) + (1.0 if "norm" in name else 0.0)
            )
    ids = torch.randint(0, small.get("vocab_size", 128), (2, 16), generator=gen)
    logits, choices, hidden = hf_forward(ref, ids)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        saved = json.loads((Path(tmp) / "config.json").read_text())
        from safetensors import safe_open

        shapes = {}
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(f, "pt") as handle:
                shapes |= {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}
        try:
            layout = read_layout(shapes)
        except UnknownArchitectureError as e:
            raise UnknownArchitectureError(f"cannot derive a bridge for {_arch(hf)}: {e}") from None
        by_config = moe_layers(HFConfig(saved, "the tiny config"), saved["num_hidden_layers"])
        if tuple(by_config) != layout.moe_layers:
            raise UnknownArchitectureError(
                f"cannot derive a bridge for {_arch(hf)}: its config's layer pattern gives MoE layers {by_config}, "
                f"its tensors show {list(layout.moe_layers)}"
            )
        for variant in VARIANTS:
            if variant["qk_norm_after_rope"] and layout.qk_norm != "head":
                continue
            bridge = derive(saved, layout, variant)
            try:
                model = load_model(tmp, torch.float32, bridge=bridge)
            except Exception as e:  # noqa: BLE001 - a tensor it cannot place, a knob it cannot build: the reason
                raise UnknownArchitectureError(f"cannot derive a bridge for {_arch(hf)}: {e}") from None
            ours_hidden = []
            hooks = [
                layer.register_forward_hook(lambda m, a, out: ours_hidden.append(out[0])) for layer in model.layers
            ]
            with torch.no_grad():
                out = model(ids, capture=True)
            for h in hooks:
                h.remove()
            routed_ok = len(choices) == len(model.moe_layer_ids) and all(
                torch.equal(out.routed[:, :, j].reshape(-1, model.config.top_k).sort(-1).values, c.sort(-1).values)
                for j, c in enumerate(choices)
            )
            if float((out.logits - logits).abs().max()) <= TOL and routed_ok:
                return derive(hf, layout, variant), variant, layout
            failures.append(_first_difference(model, ours_hidden, hidden, out.routed, choices))
    raise UnknownArchitectureError(
        f"cannot derive a bridge for {_arch(hf)}: no variant matches transformers at fp32 {TOL} "
        f"(first difference: {failures[0]})"
    )


@lru_cache(maxsize=16)
def _proven(key: str) -> Bridge:
    return prove(json.loads(key))[0]


def derived_bridge(hf: dict) -> Bridge:
    """The proven derived bridge for config ``hf`` (once per process and config)."""
    return _proven(json.dumps(hf, sort_keys=True))


def bridge_source(hf: dict, variant: dict, layout: Layout) -> str:
    """The derived bridge as a Python file that registers it (what ``moerl check-arch`` prints)."""
    arch = _arch(hf)
    return f'''"""{arch}: derived by `moerl check-arch` and proven against transformers at fp32 {TOL}."""

from moerl.bridges.derived import Layout, derive
from moerl.bridges.registry import register

LAYOUT = {layout!r}
VARIANT = {variant!r}
CONFIG = {json.dumps({k: v for k, v in hf.items() if k in ("architectures", "model_type")})}

BRIDGE = register(derive(CONFIG, LAYOUT, VARIANT))
'''
