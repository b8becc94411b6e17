"""What a bridge is: a config mapping and weight-name rules between a HF architecture and the generic model."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moerl.errors import ConfigError
from moerl.model.config import ModelConfig, RopeConfig


@dataclass(frozen=True)
class Rule:
    """One HF tensor name pattern <-> one moerl parameter (or a slice of it).

    Placeholders: ``{i}`` layer index, ``{e}`` expert index (the HF tensor is expert e's slice of the 3D
    moerl tensor), ``{x}`` any dotted path. ``part`` = "gate" | "up" selects that half of the
    ``gate_up_proj`` rows. ``load(tensor, cfg)`` / ``save(tensor, cfg)`` transform the tensor on the way in / out
    (``cfg``: the ModelConfig, for per-head permutations and the like).

    A LoRA adapter of the same module must follow the transform: ``rows(B, cfg)`` / ``rows_save(B, cfg)`` apply
    the reordering of the parameter's output rows that ``load`` / ``save`` make to LoRA B factors ``[..., out, r]``
    (PEFT import / export). A rule with ``load`` but no ``rows`` takes no adapters (refused by name).
    ``write=False``: a name that loads but that export does not write (a second spelling of a tensor another rule
    writes). ``stride`` / ``offset``: HF layer ``{i}`` is moerl layer ``stride * i + offset`` (LongCat-Flash's
    layers hold two sublayers, each a moerl layer).
    """

    hf: str
    moerl: str
    part: str | None = None
    load: Callable[[torch.Tensor, ModelConfig], torch.Tensor] | None = None
    save: Callable[[torch.Tensor, ModelConfig], torch.Tensor] | None = None
    rows: Callable[[torch.Tensor, ModelConfig], torch.Tensor] | None = None
    rows_save: Callable[[torch.Tensor, ModelConfig], torch.Tensor] | None = None
    write: bool = True
    stride: int = 1
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "_hf_re", _compile(self.hf))
        object.__setattr__(self, "_moerl_re", _compile(self.moerl))

    def moerl_groups(self, groups: dict) -> dict:
        """The placeholder values of an HF name's match as the moerl name takes them."""
        if "i" not in groups or (self.stride, self.offset) == (1, 0):
            return groups
        return groups | {"i": str(self.stride * int(groups["i"]) + self.offset)}

    def hf_groups(self, groups: dict) -> dict | None:
        """The placeholder values of a moerl name's match as the HF name takes them; None: a layer this rule does not
        hold."""
        if "i" not in groups or (self.stride, self.offset) == (1, 0):
            return groups
        i, j = divmod(int(groups["i"]) - self.offset, self.stride)
        return None if j or i < 0 else groups | {"i": str(i)}


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    pattern = pattern.replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    pattern = pattern.replace(r"\{x\}", r"(?P<x>[\w.]+)")
    return re.compile(pattern + "$")


def model_name(name: str) -> str:
    """A checkpoint tensor's name as transformers' model names it: Nemotron-H's checkpoints keep the decoder under
    ``backbone.``, its model under ``model.``."""
    return re.sub(r"^backbone\.", "model.", name)


def match(template_re: re.Pattern, name: str) -> dict | None:
    m = template_re.match(name)
    return m.groupdict() if m else None


def expert_rules(prefix: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Per-expert 2D checkpoint tensors (HF's on-disk layout) stacked into the 3D moerl experts."""
    hf = f"model.layers.{{i}}.{prefix}.experts.{{e}}"
    moerl = "layers.{i}.mlp.experts"
    return (
        Rule(f"{hf}.{gate}.weight", f"{moerl}.gate_up_proj", part="gate"),
        Rule(f"{hf}.{up}.weight", f"{moerl}.gate_up_proj", part="up"),
        Rule(f"{hf}.{down}.weight", f"{moerl}.down_proj"),
    )


COMMON_RULES = (
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("lm_head.bias", "lm_head.bias"),
    Rule("lm_head.bias", "lm_head_bias"),  # a tied head's bias (Ernie-4.5)
    Rule("model.{x}", "{x}"),  # everything else: the same name under "model."
)


@dataclass(frozen=True)
class Fused:
    """One checkpoint tensor that holds several of the bridge's tensors (Qwen3-Next's ``in_proj_qkvz``): on load
    ``split`` cuts it into ``parts`` (names the rules then place, e.g. the unfused family's names), on export
    ``join`` puts them back. Templates take ``{i}``."""

    hf: str
    parts: tuple[str, ...]
    split: Callable[[torch.Tensor, ModelConfig], list[torch.Tensor]]
    join: Callable[[list[torch.Tensor], ModelConfig], torch.Tensor]

    def __post_init__(self):
        object.__setattr__(self, "_hf_re", _compile(self.hf))
        object.__setattr__(self, "_parts_re", tuple(_compile(p) for p in self.parts))


@dataclass(frozen=True)
class Preset:
    """Model sizes shared by every architecture's preset (see moerl.presets)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class Bridge:
    """A HF architecture family: config mapping, weight-name rules and a preset config writer."""

    architectures: tuple[str, ...]
    model_type: str
    config_from_hf: Callable[[HFConfig], ModelConfig]
    preset_config: Callable[[Preset], dict]
    rules: tuple[Rule, ...] = ()
    fused: tuple[Fused, ...] = ()
    ignore: Callable[[str, ModelConfig], bool] = field(default=lambda name, cfg: False)
    # where transformers v5 keeps a layer's fused experts module: PEFT's target_parameters address it by that path;
    # None: a family whose experts PEFT cannot address so (JetMoE's: a module per projection)
    peft_experts: str | None = "model.layers.{i}.mlp.experts"
    # tensors an export writes beside the model's own, from those (HF names) and the config: what transformers' model
    # holds and moerl's computes without (LongCat-Flash's zero-computation experts' gate / up rows)
    export_extra: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]] | None = None

    @property
    def all_rules(self) -> tuple[Rule, ...]:
        return self.rules + COMMON_RULES


_MISSING = object()


class HFConfig:
    """Typed access to a config.json dict; errors name the field, the expected type and what was found."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source

    def _check(self, key: str, value, typ: type | tuple):
        ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            want = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            raise ConfigError(f"{self.source}: field {key!r} must be {want}, got {type(value).__name__} {value!r}")
        return value

    def req(self, key: str, typ: type | tuple):
        """A required field of the given type."""
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            raise ConfigError(f"{self.source}: required field {key!r} is missing")
        return self._check(key, value, typ)

    def opt(self, key: str, typ: type | tuple, default=None):
        """An optional field: ``default`` when absent or null."""
        value = self.data.get(key)
        return default if value is None else self._check(key, value, typ)

    def first(self, keys: tuple[str, ...], typ: type | tuple):
        """The first of several alias fields that is present (e.g. num_experts / num_local_experts)."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.req(key, typ)
        raise ConfigError(f"{self.source}: required field {keys[0]!r} is missing (also looked for {keys[1:]})")

    def rope(self) -> RopeConfig:
        """RoPE from ``rope_parameters`` (transformers v5) or ``rope_theta`` + ``rope_scaling`` (older)."""
        params = self.opt("rope_parameters", dict) or dict(self.opt("rope_scaling", dict) or {})
        theta = params.get("rope_theta", self.opt("rope_theta", float, 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        sub = HFConfig(params, f"{self.source} rope_parameters")
        return RopeConfig(
            theta=float(theta),
            kind=kind,
            factor=sub.opt("factor", float, 1.0),
            original_max_position_embeddings=sub.opt("original_max_position_embeddings", int),
            beta_fast=sub.opt("beta_fast", float, 32.0),
            beta_slow=sub.opt("beta_slow", float, 1.0),
            mscale=sub.opt("mscale", float),
            mscale_all_dim=sub.opt("mscale_all_dim", float),
            attention_factor=sub.opt("attention_factor", float),
            truncate=sub.opt("truncate", bool, True),
            low_freq_factor=sub.opt("low_freq_factor", float, 1.0),
            high_freq_factor=sub.opt("high_freq_factor", float, 4.0),
            # the share of each half-head that rotates (Gemma 4's proportional RoPE; a partial rotary elsewhere)
            proportion=sub.opt("partial_rotary_factor", float, 1.0) if kind == "proportional" else 1.0,
        )


def sparse_layers(num_layers: int, step: int = 1, dense: list[int] | tuple = (), first_dense: int = 0) -> list[int]:
    """MoE layer indices from the usual patterns: every ``step``-th, an explicit dense list, first-k dense."""
    return [i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense and i >= first_dense]


def common_fields(c: HFConfig) -> dict:
    """ModelConfig fields every Llama-style family spells the same way."""
    hidden, heads = c.req("hidden_size", int), c.req("num_attention_heads", int)
    if heads < 1:  # divides hidden_size below
        raise ConfigError(f"{c.source}: field 'num_attention_heads' must be >= 1, got {heads}")
    return dict(
        vocab_size=c.req("vocab_size", int),
        hidden_size=hidden,
        num_layers=c.req("num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=c.opt("num_key_value_heads", int, heads),
        head_dim=c.opt("head_dim", int, hidden // heads),
        max_position_embeddings=c.opt("max_position_embeddings", int, 4096),
        rms_norm_eps=c.opt("rms_norm_eps", float, 1e-6),
        tie_word_embeddings=c.opt("tie_word_embeddings", bool, False),
        rope=c.rope(),
    )


def layer_types(
    c: HFConfig,
    num_layers: int,
    all_sliding: bool = False,
    linear: bool = False,
    indexed: bool = False,
    mamba: str | None = None,
) -> tuple[list[str], int | None]:
    """Per-layer attention kind from ``layer_types`` (v5) or, when ``all_sliding``, a window on every layer;
    ``linear``: the family's ``linear_attention`` layers are Gated DeltaNet ones; ``indexed``: its
    ``indexed_attention`` layers are full attention narrowed by an indexer (DeepSeek sparse attention); ``mamba``:
    the kind of its ``mamba`` / ``linear_attention`` layers ("mamba": Mamba-2, "mamba1"), which without
    ``layer_types`` are the layers off Jamba's attention period (``attn_layer_period`` / ``_offset``)."""
    window = c.opt("sliding_window", int)
    types = c.opt("layer_types", list)
    if types is None and mamba and "attn_layer_period" in c.data:
        period, offset = c.req("attn_layer_period", int), c.opt("attn_layer_offset", int, 0)
        types = ["attention" if i % period == offset else "mamba" for i in range(num_layers)]
    if types is not None:
        known = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
        if linear:
            known["linear_attention"] = "linear"
        if indexed:
            known["indexed_attention"] = "full"
        if mamba:
            known |= {"mamba": mamba, "linear_attention": mamba, "attention": "full"}
        unknown = [t for t in types if t not in known]
        if unknown:  # e.g. linear_attention (hybrid models): no such layer in the generic decoder
            raise ConfigError(
                f"{c.source}: field 'layer_types' holds {unknown[0]!r} (layer {types.index(unknown[0])}); "
                f"allowed: {', '.join(known)}"
            )
        kinds = [known[t] for t in types]
        return kinds, (window if "sliding" in kinds else None)
    if all_sliding and window:
        return ["sliding"] * num_layers, window
    return ["full"] * num_layers, None


def partial_rope_dim(c: HFConfig, head_dim: int, default: float = 1.0) -> int | None:
    """Rotary dims per head from ``partial_rotary_factor`` (in ``rope_parameters`` or at the top level; ``default``
    when neither has it); None: all of them."""
    rope = HFConfig(c.opt("rope_parameters", dict) or {}, f"{c.source} rope_parameters")
    if rope.data.get("rope_type") == "proportional":  # the whole head, some of its frequencies 0 (RopeConfig)
        return None
    factor = rope.opt("partial_rotary_factor", float, c.opt("partial_rotary_factor", float, default))
    dims = int(head_dim * factor)
    if dims == head_dim:
        return None
    if dims % 2 or not 2 <= dims < head_dim:
        raise ConfigError(f"{c.source}: partial_rotary_factor={factor} gives {dims} rotary dims of {head_dim}")
    return dims


# linear-attention (Gated DeltaNet) layers as the Qwen hybrids name them: config fields and tensors
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def linear_attention_fields(c: HFConfig) -> dict:
    """ModelConfig's linear-attention sizes from those fields."""
    return {f: c.req(f, int) for f in LINEAR_FIELDS} | {"linear_conv_kernel": c.opt("linear_conv_kernel_dim", int, 4)}


# the mixer sits where attention does (layers.{i}.self_attn): its own names only
LINEAR_ATTENTION_RULES = (
    *(
        Rule(f"model.layers.{{i}}.linear_attn.{m}.{{x}}", f"layers.{{i}}.self_attn.{m}.{{x}}")
        for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
    ),
    *(Rule(f"model.layers.{{i}}.linear_attn.{m}", f"layers.{{i}}.self_attn.{m}") for m in ("dt_bias", "A_log")),
)


_MAMBA_TENSORS = {  # the mixer's modules and its bare parameters, by layer kind
    "mamba": (("in_proj", "conv1d", "norm", "out_proj"), ("dt_bias", "A_log", "D")),
    "mamba1": (
        ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "dt_layernorm", "b_layernorm", "c_layernorm"),
        ("A_log", "D"),
    ),
}
MAMBA_RULES = {  # model.layers.{i}.mamba.* -> the layer's mixer
    kind: (
        *(Rule(f"model.layers.{{i}}.mamba.{m}.{{x}}", f"layers.{{i}}.self_attn.{m}.{{x}}") for m in modules),
        *(Rule(f"model.layers.{{i}}.mamba.{m}", f"layers.{{i}}.self_attn.{m}") for m in bare),
    )
    for kind, (modules, bare) in _MAMBA_TENSORS.items()
}


# Mamba fields as Granite-4.0-H / Jamba spell them, and as Nemotron-H does
MAMBA_SYNONYMS = {
    "mamba_n_heads": ("mamba_n_heads", "mamba_num_heads"),
    "mamba_d_head": ("mamba_d_head", "mamba_head_dim"),
    "mamba_d_state": ("mamba_d_state", "ssm_state_size"),
    "mamba_n_groups": ("mamba_n_groups", "n_groups"),
    "mamba_d_conv": ("mamba_d_conv", "conv_kernel"),
    "mamba_expand": ("mamba_expand", "expand"),
    "mamba_conv_bias": ("mamba_conv_bias", "use_conv_bias"),
}


def mamba_fields(c: HFConfig, hidden: int, norm_groups: int, kind: str = "mamba") -> dict:
    """ModelConfig's Mamba fields from a family's ``mamba_*`` ones: Mamba-2's (``kind`` "mamba", Granite-4.0-H's
    or Nemotron-H's spelling; ``norm_groups``: the gated norm's groups, which the names cannot tell: a variant of the
    proof) or Mamba-1's (``kind`` "mamba1", Jamba's: ``mamba_expand`` x hidden channels, a step of rank
    ``mamba_dt_rank``). Nemotron-H's projections take their bias from ``use_bias`` and its step is clamped below at
    ``time_step_min`` (its ``time_step_limit`` unread by its model)."""
    data = dict(c.data)
    for name, spellings in MAMBA_SYNONYMS.items():
        data[name] = next((c.data[s] for s in spellings if c.data.get(s) is not None), None)
    nemotron = "ssm_state_size" in c.data
    if nemotron:
        data["mamba_proj_bias"] = c.data.get("use_bias", False)
        data["time_step_limit"] = [c.data.get("time_step_min", 0.0), float("inf")]
    c = HFConfig(data, c.source)
    shared = dict(
        mamba_state_size=c.req("mamba_d_state", int),
        mamba_conv_kernel=c.opt("mamba_d_conv", int, 4),
        mamba_conv_bias=c.opt("mamba_conv_bias", bool, True),
        mamba_proj_bias=c.opt("mamba_proj_bias", bool, False),
    )
    if kind == "mamba1":
        rank = c.data.get("mamba_dt_rank", "auto")  # transformers' "auto": hidden / 16, rounded up
        rank = -(-hidden // 16) if rank == "auto" else c.req("mamba_dt_rank", int)
        return shared | dict(mamba_inner_size=c.opt("mamba_expand", int, 2) * hidden, mamba_dt_rank=rank)
    heads = c.req("mamba_n_heads", int)
    auto = c.data.get("mamba_d_head") in (None, "auto")  # transformers' default: the expanded width over the heads
    head_dim = c.opt("mamba_expand", int, 2) * hidden // heads if auto else c.req("mamba_d_head", int)
    low, high = c.opt("time_step_limit", list) or [0.0, float("inf")]
    return shared | dict(
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_groups=c.opt("mamba_n_groups", int, 1),
        mamba_norm_groups=norm_groups,
        mamba_dt_min=float(low),
        mamba_dt_max=float(high),
    )


def mtp_layer(name: str, cfg: ModelConfig) -> bool:
    """A ``Bridge.ignore``: multi-token-prediction layers sit after the decoder (a layer index >= num_hidden_layers,
    DeepSeek-V3's, GLM-4.5's ``num_nextn_predict_layers``); not loaded."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= cfg.num_layers


def plus_one(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Load transform of RMSNorm weights stored zero-centred (the norm scales by 1 + w); moerl's scale by w."""
    return t + 1


def minus_one(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return t - 1


def common_preset(p: Preset, architecture: str, model_type: str, bos: int, eos: int, pad: int) -> dict:
    """config.json fields shared by every family's preset."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "num_experts_per_tok": p.top_k,
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
