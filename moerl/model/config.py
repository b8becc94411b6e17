"""ModelConfig: every knob of the generic MoE decoder.

Bridges fill this from a Hugging Face ``config.json``; the model never reads HF configs itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moerl.errors import ConfigError

# layer kinds with a per-sequence state instead of paged keys (their mixers: moerl.model.mixers.RECURRENT)
RECURRENT_KINDS = ("linear", "mamba", "mamba1")
ATTENTION_KINDS = ("full", "sliding", "chunked")  # the layer kinds whose mixer is attention (paged keys)


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding. ``kind``: default | linear | yarn | llama3 | proportional (Gemma 4's: the first
    ``proportion`` of each half of the head rotates at the whole head's frequencies, the rest not at all)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # proportional
    proportion: float = 1.0


@dataclass(slots=True)
class ModelConfig:
    """The generic MoE decoder. Per-layer structure comes from ``layer_types`` and ``moe_layers``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: list[int]  # indices of MoE layers; the others are dense MLP layers (or mixer-only ones)
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # rms | layer (LayerNorm with bias: PhiMoE) | layer_nobias (Cohere's) for the layer and final norms
    norm: str = "rms"
    # pre: x + f(norm(x)) | post: x + norm(f(x)) (OLMo-2, FlexOlmo) | sandwich: x + norm2(f(norm1(x))) (AFMoE, Gemma)
    # | parallel: x + attn(norm(x)) + mlp(norm(x)), one norm (Cohere's)
    norm_placement: str = "pre"
    moe_output_norm: bool = False  # MoE layers norm the MoE block's output, routed and shared (A.X-K1's)
    mlp_bias: bool = False  # dense MLP and shared-expert linears
    lm_head_bias: bool = False
    final_norm_eps: float = 0.0  # the final norm's own epsilon (JetMoE's: its layers' norms keep 1e-6); 0: rms_norm_eps
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma's); 0: none
    layer_scale: bool = False  # each layer's output times a scalar of its own, a buffer (Gemma 4's layer_scalar)
    # multipliers (GraniteMoe): embeddings * m, x + m * sublayer(x), logits / scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # attention
    # gqa | mla | moa: a mixture of attention heads (JetMoE's: a token's queries and outputs from the top_k attention
    # experts its router chooses, over keys and values they share; o_bias: the bias on its output)
    attention: str = "gqa"
    qkv_bias: bool = False
    o_bias: bool = False
    # none | head (per head, Qwen3) | full (whole projection, OLMoE) | l2: each head scaled to unit RMS without a
    # weight, after the rotation, on the layers with RoPE alone (Llama 4's L2Norm)
    qk_norm: str = "none"
    qk_norm_after_rope: bool = False  # per-head q/k norms after the rotation (HunYuan-MoE-V1)
    clip_qkv: float | None = None
    # per layer: "full" | "sliding" | "chunked" (keys of the query's own aligned chunk of ``attention_chunk`` positions:
    # Llama 4) | a recurrent kind ("linear": Gated DeltaNet, "mamba", "mamba1") | "none": no token
    # mixer, the layer is its MLP / MoE alone (Nemotron-H's one-block layers)
    layer_types: list[str] = field(default_factory=list)
    mixer_only_layers: list[int] = field(default_factory=list)  # layers without an MLP / MoE (Nemotron-H's)
    sliding_window: int | None = None
    attention_chunk: int | None = None  # the chunked layers' chunk, in positions
    attention_sinks: bool = False
    sinks_sliding_only: bool = False  # the sinks on the sliding layers alone (MiMo-V2-Flash's)
    attn_value_scale: float = 1.0  # the values scaled before attention (MiMo-V2-Flash's attention_value_scale)
    v_norm: bool = False  # the values scaled to unit RMS per head, without a weight (Gemma 4's)
    attn_k_eq_v: bool = False  # the full layers' values are their keys before norm and RoPE, no v_proj (Gemma 4's)
    sliding_head_dim: int = 0  # the sliding layers' own head size (Gemma 4: half the full ones'); 0: head_dim
    attn_scale: float | None = None  # None: rotary-inclusive q/k head dim ** -0.5
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: o * sigmoid(gate) (Qwen3-Next)
    # an output gate of its own projection (self_attn.gate_proj: AFMoE, Laguna): o * act(gate_proj(x)), one gate per
    # head ("head") or per channel ("element"); act: sigmoid | softplus (Laguna's)
    attn_gate: str = "none"
    attn_gate_act: str = "sigmoid"
    layer_heads: list[int] = field(default_factory=list)  # query heads per layer (Laguna's); empty: num_heads in all
    sliding_kv_heads: int = 0  # the sliding layers' own KV heads (MiMo-V2-Flash: twice the full ones'); 0: num_kv_heads
    # linear-attention layers (Gated DeltaNet: moerl.model.linear_attention)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # Mamba-2 layers (moerl.model.mamba): heads x head_dim channels, a [head_dim, state] state per head
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_groups: int = 1  # B / C groups, each shared by heads / groups heads
    mamba_conv_kernel: int = 4
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    mamba_norm_groups: int = 1  # the gated norm's groups of channels (1: one norm over all of them)
    mamba_dt_min: float = 0.0  # dt clamped to [min, max] after its softplus
    mamba_dt_max: float = float("inf")
    # Mamba-1 layers (moerl.model.mamba1, Jamba's): inner channels each with its own decay per state dim; the step
    # from a rank-``mamba_dt_rank`` projection. They share mamba_state_size / conv_kernel / conv_bias / proj_bias
    mamba_inner_size: int = 0
    mamba_dt_rank: int = 0
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_dim: int | None = None  # rotated dims per head (None: all of head_dim)
    rope_interleave: bool = False  # rotary pairs stored interleaved (DeepSeek, Ernie-4.5)
    nope_layers: list[int] = field(default_factory=list)  # attention layers that rotate nothing (EXAONE's full ones)
    # the NoPE layers' queries scaled by 1 + scale * log(1 + floor((position + 1) / floor)) (Llama 4's temperature
    # tuning); scale 0: none
    attn_temperature_scale: float = 0.0
    attn_temperature_floor: int = 0
    # a RoPE per layer kind (Laguna, Gemma): the sliding layers' own table and rotated dims (None: all of head_dim);
    # None: the sliding layers rotate as the full ones (``rope``, ``rope_dim``)
    sliding_rope: RopeConfig | None = None
    sliding_rope_dim: int | None = None
    # multi-head latent attention (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0  # value head size: latent attention's; grouped-query attention's where it differs (0: head_dim)
    # the low-rank query and the normed kv latent times sqrt(hidden_size / their rank) (LongCat-Flash's)
    mla_lora_scale: bool = False
    # DeepSeek sparse attention (moerl.model.indexer): each latent-attention layer's indexer keeps a query's
    # index_topk best keys; 0: dense attention
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False  # the indexer's rotary pairs interleaved (GLM-5) or split in halves (V3.2)
    # layers without an indexer of their own that keep the keys the last indexer layer before them chose (GLM-5's
    # "shared" indexer layers)
    index_shared_layers: list[int] = field(default_factory=list)
    # router
    router_softcap: float = 0.0  # router logits -> cap * tanh(logits / cap) before scoring (Laguna's); 0: none
    scoring: str = "softmax"  # softmax | sigmoid | sparsemixer (PhiMoE, its deterministic eval form; top_k 2)
    sparsemixer_eps: float = 0.01  # sparsemixer: experts this far (relative) below the chosen one are masked
    topk_before_softmax: bool = False  # softmax over the k chosen logits (GPT-OSS)
    norm_topk_prob: bool = False
    norm_topk_min: float = 0.0  # norm_topk_prob: floor of the sum divided by (Ernie-4.5's moe_norm_min)
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    score_correction_bias: bool = False  # a bias added to the scores for selection only
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"  # a group's score: top2_sum (DeepSeek-V3) | max (DeepSeek-V2)
    # experts
    expert_bias: bool = False
    # silu | swiglu_clamped (GPT-OSS) | gelu_tanh: GELU (tanh form) of the gate rows times the up rows, experts and
    # MLPs (Gemma's) | relu2: relu(x)^2 of un-gated experts and MLPs (Nemotron-H: gate_up_proj holds the up rows alone,
    # [E, I, H]; the MLPs have no gate_proj)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_size: int = 0  # intermediate size of the shared expert MLP; 0 = none
    shared_expert_gate: bool = False  # sigmoid(Linear(H, 1)) on the shared expert output
    shared_combine: str = "sum"  # routed + shared | average: (routed + shared) / 2 (Cohere2-MoE's)
    # zero-computation experts (LongCat-Flash): router slots [num_experts, num_experts + zero_experts) whose expert
    # returns its input; a token routed to one gets its gate weight times itself, and no GEMM runs for it
    zero_experts: int = 0
    # the gate weight scales the chosen expert's input, not its output (Llama 4's; top_k 1)
    router_weight_on_input: bool = False
    # Gemma 4's MoE layers: a dense MLP of intermediate_size beside the experts, each with a norm in and out (the MoE
    # block takes the residual stream), the router of its own unit-RMS norm times a learned scale (router_input_norm)
    # and a learned scale per expert on the gate weights (router_expert_scale)
    moe_beside_mlp: bool = False
    router_input_norm: bool = False
    router_expert_scale: bool = False
    # LongCat-Flash's layers in pairs, the even layers MoE: a pair's MoE runs beside the first layer's dense MLP of
    # intermediate_size, on the same normed input, and its output joins the residual stream at the end of the second
    # layer (the shortcut) rather than the first's
    moe_shortcut: bool = False
    moe_output_bias: bool = False  # a bias on each MoE block's output (JetMoE's)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when the combination cannot be built."""
        if self.attention not in ("gqa", "mla", "moa"):
            raise self._bad("attention", "allowed: gqa, mla, moa")
        if self.qk_norm not in ("none", "head", "full", "l2"):
            raise self._bad("qk_norm", "allowed: none, head, full, l2")
        for name, allowed in (
            ("scoring", ("softmax", "sigmoid", "sparsemixer")),
            ("norm", ("rms", "layer", "layer_nobias")),
            ("norm_placement", ("pre", "post", "sandwich", "parallel")),
            ("group_score", ("top2_sum", "max")),
        ):
            if getattr(self, name) not in allowed:
                raise self._bad(name, f"allowed: {', '.join(allowed)}")
        if self.activation not in ("silu", "swiglu_clamped", "gelu_tanh", "relu2"):
            raise self._bad("activation", "allowed: silu, swiglu_clamped, gelu_tanh, relu2")
        for name in ("rope", "sliding_rope"):
            rope = getattr(self, name)
            kinds = ("default", "linear", "yarn", "llama3", "proportional")
            if rope is not None and rope.kind not in kinds:
                raise ConfigError(f"ModelConfig.{name}.kind={rope.kind!r}: allowed: {', '.join(kinds)}")
            if rope is not None and not 0 < rope.proportion <= 1:
                raise ConfigError(f"ModelConfig.{name}.proportion={rope.proportion!r}: must lie in (0, 1]")
            if rope is not None and rope.proportion != 1 and rope.kind != "proportional":
                raise ConfigError(f"ModelConfig.{name}.proportion set with kind={rope.kind!r} (a proportional RoPE's)")
        if len(self.layer_types) != self.num_layers:
            raise self._bad("layer_types", f"needs {self.num_layers} entries (num_layers)")
        if any(t not in ("full", "sliding", "chunked", *RECURRENT_KINDS, "none") for t in self.layer_types):
            kinds = ", ".join(("full", "sliding", "chunked", *RECURRENT_KINDS, "none"))
            raise self._bad("layer_types", f"entries allowed: {kinds}")
        self._validate_one_block()
        self._validate_mamba()
        if "linear" not in self.layer_types:  # the linear-attention fields would be ignored
            linear_defaults = tuple((f"linear_{n}", 0) for n in ("num_key_heads", "num_value_heads")) + (
                ("linear_key_head_dim", 0),
                ("linear_value_head_dim", 0),
                ("linear_conv_kernel", 4),
            )
            self._only_defaults("without a 'linear' layer (layer_types)", linear_defaults)
        else:
            heads = (self.linear_num_key_heads, self.linear_num_value_heads)
            if min(heads) < 1 or self.linear_num_value_heads % self.linear_num_key_heads:
                raise self._bad("linear_num_value_heads", "needs >= 1 key heads and a multiple of them as value heads")
            if min(self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel) < 1:
                raise self._bad("linear_key_head_dim", "linear layers need head dims and a conv kernel >= 1")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise self._bad("sliding_window", "sliding layers need a window > 0")
        if "chunked" in self.layer_types and not (self.attention_chunk or 0) >= 1:
            raise self._bad("attention_chunk", "chunked layers need a chunk >= 1")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers) or len(set(self.nope_layers)) != len(
            self.nope_layers
        ):
            raise self._bad("nope_layers", f"indices must lie in [0, {self.num_layers}), each once")
        if any(self.layer_types[i] in (*RECURRENT_KINDS, "none") for i in self.nope_layers):
            raise self._bad("nope_layers", "lists a recurrent layer or one without a mixer (it has no RoPE to drop)")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise self._bad("moe_layers", f"indices must lie in [0, {self.num_layers})")
        if not self.zero_experts >= 0:
            raise self._bad("zero_experts", "must be >= 0")
        if self.moe_layers and not 1 <= self.top_k <= self.num_experts + self.zero_experts:
            raise self._bad(
                "top_k",
                f"must lie in [1, num_experts + zero_experts={self.num_experts + self.zero_experts}]"
                if self.zero_experts
                else f"must lie in [1, num_experts={self.num_experts}]",
            )
        self._validate_sizes()  # before the divisions below
        if self.num_heads % self.num_kv_heads:
            raise self._bad("num_kv_heads", f"must divide num_heads={self.num_heads}")
        if self.sliding_kv_heads and (self.sliding_kv_heads < 0 or "sliding" not in self.layer_types):
            raise self._bad("sliding_kv_heads", "must be >= 1 (or 0: num_kv_heads), with a 'sliding' layer")
        if self.layer_heads and (len(self.layer_heads) != self.num_layers or min(self.layer_heads) < 1):
            raise self._bad("layer_heads", f"needs {self.num_layers} entries (num_layers), each >= 1")
        bad = next((i for i in range(self.num_layers) if self.heads(i) % self.kv_heads(i)), None)
        if bad is not None:
            name = "layer_heads" if self.layer_heads else "sliding_kv_heads"
            why = f"layer {bad}'s {self.kv_heads(bad)} KV heads must divide its {self.heads(bad)} heads"
            raise self._bad(name, why)
        if (self.num_experts + self.zero_experts) % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise self._bad("n_group", f"must divide the router's experts and be >= topk_group={self.topk_group}")
        self._validate_unused()

    def _bad(self, name: str, why: str) -> ConfigError:
        """The ConfigError that names field ``name`` and its value."""
        return ConfigError(f"ModelConfig.{name}={getattr(self, name)!r}: {why}")

    def _only_defaults(self, where: str, defaults: tuple[tuple[str, object], ...]) -> None:
        """Refuse any of ``defaults``' fields set away from its default: the decoder ignores it ``where``."""
        for name, default in defaults:
            if getattr(self, name) != default:
                raise self._bad(name, f"not built {where} (only {default!r})")

    def _validate_unused(self) -> None:
        """Refuse every field the decoder would accept and then ignore (a model computed wrongly, silently)."""
        self._validate_sizes()
        self._validate_attention()
        self._validate_router()
        self._validate_multipliers()
        self._validate_experts()

    def _validate_sizes(self) -> None:
        """Every size the built layers use is >= 1; no MoE layer is listed twice."""
        positive = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_position_embeddings"]
        positive += ["head_dim"] if self.attention != "mla" else ["kv_lora_rank", "qk_rope_head_dim", "v_head_dim"]
        if self.moe_layers:
            positive += ["num_experts", "moe_intermediate_size"]
        if len(self.moe_layers) + len(self.mixer_only_layers) < self.num_layers:
            positive.append("intermediate_size")  # the dense MLP layers
        for name in positive:
            if not getattr(self, name) >= 1:
                raise self._bad(name, "must be >= 1")
        if not self.rms_norm_eps > 0:
            raise self._bad("rms_norm_eps", "must be > 0")
        if not self.final_norm_eps >= 0:
            raise self._bad("final_norm_eps", "must be > 0 (or 0: rms_norm_eps)")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise self._bad("moe_layers", "holds an index twice")

    def _validate_attention(self) -> None:
        """Multi-head latent attention fields only with ``attention='mla'``, and GQA-only ones only without it."""
        if self.attention == "moa":
            self._validate_moa()
        if self.attention in ("gqa", "moa"):
            for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "mla_lora_scale"):
                if getattr(self, name):
                    raise self._bad(name, "multi-head latent attention field set with attention='gqa'")
            if self.qk_norm_after_rope and self.qk_norm != "head":
                raise self._bad("qk_norm_after_rope", f"needs per-head norms (qk_norm='head', not {self.qk_norm!r})")
            if self.qk_norm_after_rope and self.rope_interleave:
                raise self._bad(
                    "qk_norm_after_rope", "not built with rope_interleave (the norm would see reordered dims)"
                )
            for name in ("rope_dim", "sliding_rope_dim"):
                dim = getattr(self, name)
                if dim is not None and not (0 < dim <= self.head_dim and dim % 2 == 0):
                    raise self._bad(name, f"must be even and lie in [2, head_dim={self.head_dim}]")
            if self.v_head_dim < 0:
                raise self._bad("v_head_dim", "must be >= 1 (or 0: head_dim)")
            if self.v_head_dim and self.attn_output_gate:
                raise self._bad("v_head_dim", "value heads of their own size with attn_output_gate's gate (not built)")
            if self.attn_gate not in ("none", "head", "element"):
                raise self._bad("attn_gate", "allowed: none, head, element")
            if self.attn_gate_act not in ("sigmoid", "softplus"):
                raise self._bad("attn_gate_act", "allowed: sigmoid, softplus")
            if self.attn_gate != "none" and self.attn_output_gate:
                raise self._bad("attn_gate", "a second output gate beside attn_output_gate's (one gate per layer)")
            if self.attn_gate == "none" and self.attn_gate_act != "sigmoid":
                raise self._bad("attn_gate_act", "set, but there is no gate of its own projection (attn_gate='none')")
        else:
            mla_defaults = (
                ("qk_norm", "none"),
                ("clip_qkv", None),
                ("attention_sinks", False),
                ("rope_dim", None),
                ("qk_norm_after_rope", False),
                ("attn_output_gate", False),
                ("nope_layers", []),
                ("attn_gate", "none"),
                ("attn_gate_act", "sigmoid"),
                ("layer_heads", []),
                ("sliding_rope", None),
                ("sliding_rope_dim", None),
                ("sinks_sliding_only", False),
                ("sliding_kv_heads", 0),
                ("attn_value_scale", 1.0),
                ("attention_chunk", None),
                ("attn_temperature_scale", 0.0),
                ("attn_temperature_floor", 0),
                ("v_norm", False),
                ("attn_k_eq_v", False),
                ("sliding_head_dim", 0),
            )
            self._only_defaults("for attention='mla'", mla_defaults)
            if self.mla_lora_scale and not self.q_lora_rank:
                raise self._bad("mla_lora_scale", "scales a low-rank query, and q_lora_rank is unset")
        self._validate_indexer()
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise self._bad("clip_qkv", "must be > 0 (or None)")
        if self.sliding_window is not None and "sliding" not in self.layer_types:
            raise self._bad("sliding_window", "set, but no layer is 'sliding' (layer_types): it would be ignored")
        if self.sinks_sliding_only and not (self.attention_sinks and "sliding" in self.layer_types):
            raise self._bad("sinks_sliding_only", "needs attention_sinks and a 'sliding' layer (layer_types)")
        if not self.attn_value_scale > 0:
            raise self._bad("attn_value_scale", "must be > 0")
        if self.sliding_rope is None and self.sliding_rope_dim is not None:
            raise self._bad("sliding_rope_dim", "set without sliding_rope (the sliding layers rotate as the full ones)")
        if self.sliding_rope is not None and "sliding" not in self.layer_types:
            raise self._bad("sliding_rope", "set, but no layer is 'sliding' (layer_types): it would be ignored")
        if self.attention_chunk is not None and "chunked" not in self.layer_types:
            raise self._bad("attention_chunk", "set, but no layer is 'chunked' (layer_types): it would be ignored")
        self._validate_temperature()
        if self.attn_k_eq_v and "full" not in self.layer_types:
            raise self._bad("attn_k_eq_v", "set, but no layer is 'full' (layer_types): it would be ignored")
        if self.attn_k_eq_v and (self.v_head_dim or self.attn_output_gate):
            raise self._bad("attn_k_eq_v", "values that are the keys have the keys' size (no v_head_dim, no q gate)")
        if self.sliding_head_dim and (self.sliding_head_dim < 0 or "sliding" not in self.layer_types):
            raise self._bad("sliding_head_dim", "must be >= 1 (or 0: head_dim), with a 'sliding' layer")
        if self.sliding_head_dim and self.sliding_rope is None:
            raise self._bad(
                "sliding_head_dim", "needs sliding_rope (the sliding layers rotate by a table of their size)"
            )
        if self.sliding_head_dim and (self.v_head_dim or self.attn_output_gate):
            raise self._bad("sliding_head_dim", "with values of their own size or a q gate (not built)")
        if not self.final_logit_softcap >= 0:
            raise self._bad("final_logit_softcap", "must be >= 0 (0: no soft-capping)")

    def _validate_moa(self) -> None:
        """A mixture of attention heads (JetMoE's): each of a token's ``top_k`` attention experts makes
        ``num_kv_heads`` query heads over the shared keys, so ``num_heads`` is their product; routed as the MoE
        layers are, over ``num_experts`` experts. The GQA knobs it does not build stay at their defaults."""
        if self.num_heads != self.num_kv_heads * self.top_k:
            raise self._bad("num_heads", f"must be num_kv_heads x top_k={self.num_kv_heads * self.top_k} (moa)")
        if not self.num_experts >= 1 or self.zero_experts:
            raise self._bad("attention", "moa routes over num_experts >= 1 attention experts, no zero-computation ones")
        self._only_defaults(
            "for attention='moa'",
            (
                ("qk_norm", "none"),
                ("clip_qkv", None),
                ("attention_sinks", False),
                ("rope_dim", None),
                ("qkv_bias", False),
                ("attn_output_gate", False),
                ("attn_gate", "none"),
                ("v_head_dim", 0),
                ("v_norm", False),
                ("attn_k_eq_v", False),
                ("layer_heads", []),
                ("sliding_kv_heads", 0),
                ("sliding_head_dim", 0),
                ("attn_value_scale", 1.0),
                ("nope_layers", []),
            ),
        )

    def _validate_temperature(self) -> None:
        """Temperature tuning: a scale > 0 with a floor >= 1 and NoPE layers to scale, or neither set."""
        if not self.attn_temperature_scale:
            self._only_defaults("without attn_temperature_scale", (("attn_temperature_floor", 0),))
            return
        if not self.attn_temperature_scale > 0:
            raise self._bad("attn_temperature_scale", "must be > 0 (or 0: no temperature tuning)")
        if not self.attn_temperature_floor >= 1:
            raise self._bad("attn_temperature_floor", "must be >= 1 with attn_temperature_scale set")
        if not self.nope_layers:
            raise self._bad("attn_temperature_scale", "scales the NoPE layers' queries, and nope_layers is empty")

    def _validate_mamba(self) -> None:
        """Mamba fields: those of Mamba-2 ('mamba' layers) and of Mamba-1 ('mamba1') at their defaults without such a
        layer, the ones they share without either; else sizes a layer can be built with."""
        kinds = set(self.layer_types)
        if "mamba" not in kinds:
            defaults = (("mamba_num_heads", 0), ("mamba_head_dim", 0), ("mamba_groups", 1), ("mamba_norm_groups", 1))
            defaults += (("mamba_dt_min", 0.0), ("mamba_dt_max", float("inf")))
            self._only_defaults("without a 'mamba' layer (layer_types)", defaults)
        if "mamba1" not in kinds:
            mamba1 = (("mamba_inner_size", 0), ("mamba_dt_rank", 0))
            self._only_defaults("without a 'mamba1' layer (layer_types)", mamba1)
        if not kinds & {"mamba", "mamba1"}:
            shared = (("mamba_state_size", 0), ("mamba_conv_kernel", 4))
            shared += (("mamba_conv_bias", False), ("mamba_proj_bias", False))
            self._only_defaults("without a 'mamba' or 'mamba1' layer (layer_types)", shared)
            return
        sizes = ["mamba_state_size", "mamba_conv_kernel"]
        sizes += ["mamba_num_heads", "mamba_head_dim", "mamba_groups"] if "mamba" in kinds else []
        sizes += ["mamba_inner_size", "mamba_dt_rank"] if "mamba1" in kinds else []
        for name in sizes:
            if not getattr(self, name) >= 1:
                raise self._bad(name, "must be >= 1")
        if "mamba" not in kinds:
            return
        if self.mamba_num_heads % self.mamba_groups:
            raise self._bad("mamba_groups", f"must divide mamba_num_heads={self.mamba_num_heads}")
        if not self.mamba_norm_groups >= 1 or (self.mamba_num_heads * self.mamba_head_dim) % self.mamba_norm_groups:
            raise self._bad("mamba_norm_groups", "must be >= 1 and divide the channels (heads x head_dim)")
        if not 0.0 <= self.mamba_dt_min < self.mamba_dt_max:
            raise self._bad("mamba_dt_min", f"needs 0 <= mamba_dt_min < mamba_dt_max={self.mamba_dt_max}")

    def _validate_one_block(self) -> None:
        """Layers of one block (a mixer alone: ``mixer_only_layers``; an MLP / MoE alone: layer type "none") are
        pre-norm layers that keep one of their halves."""
        only = self.mixer_only_layers
        if any(not 0 <= i < self.num_layers for i in only) or len(set(only)) != len(only):
            raise self._bad("mixer_only_layers", f"indices must lie in [0, {self.num_layers}), each once")
        if set(only) & set(self.moe_layers):
            raise self._bad("mixer_only_layers", "lists an MoE layer (moe_layers): a layer without an MLP / MoE")
        if any(self.layer_types[i] == "none" for i in only):
            raise self._bad("mixer_only_layers", "lists a layer of type 'none': it would hold nothing")
        if self.moe_output_norm and self.norm_placement != "pre":
            raise self._bad("moe_output_norm", f"a pre-norm model's (norm_placement={self.norm_placement!r} norms it)")
        if (only or "none" in self.layer_types) and self.norm_placement != "pre":
            raise self._bad("norm_placement", "layers of one block (mixer_only_layers, type 'none') are pre-norm only")

    def _validate_indexer(self) -> None:
        """DeepSeek sparse attention's fields: all unset, or an indexer a latent-attention layer with a low-rank query
        can build (its rotated dims within its head)."""
        if not self.index_topk:
            defaults = (("index_n_heads", 0), ("index_head_dim", 0), ("index_rope_interleave", False))
            self._only_defaults("without an indexer (index_topk 0)", defaults + (("index_shared_layers", []),))
            return
        shared = self.index_shared_layers
        if any(not 1 <= i < self.num_layers for i in shared) or len(set(shared)) != len(shared):
            raise self._bad(
                "index_shared_layers",
                f"indices must lie in [1, {self.num_layers}), each once (a layer before each keeps the keys it chose)",
            )
        if self.index_topk < 0:
            raise self._bad("index_topk", "must be >= 1 (or 0: dense attention)")
        if self.attention != "mla" or not self.q_lora_rank:
            raise self._bad("index_topk", "an indexer needs latent attention with a low-rank query (q_lora_rank)")
        if not self.index_n_heads >= 1:
            raise self._bad("index_n_heads", "must be >= 1")
        if not self.index_head_dim >= self.qk_rope_head_dim:
            raise self._bad("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (its rotated dims)")

    def _validate_router(self) -> None:
        """Router fields a scoring mode ignores (``topk_before_softmax``, sparsemixer) stay at their defaults."""
        if self.topk_before_softmax:
            self._only_defaults(
                "with topk_before_softmax=True",
                (
                    ("scoring", "softmax"),
                    ("norm_topk_prob", False),  # the softmax over k already sums to 1
                    ("score_correction_bias", False),
                    ("n_group", 1),
                ),
            )
        if self.scoring == "sparsemixer":
            self._only_defaults(
                "with scoring='sparsemixer'",
                (
                    ("top_k", 2),
                    ("norm_topk_prob", False),
                    ("score_correction_bias", False),
                    ("n_group", 1),
                    ("routed_scaling_factor", 1.0),
                ),
            )
            if not self.sparsemixer_eps >= 0:
                raise self._bad("sparsemixer_eps", "must be >= 0")
        if self.norm_topk_min and not self.norm_topk_prob:
            raise self._bad("norm_topk_min", "a floor for a normalisation that is off (norm_topk_prob=False)")
        if not self.norm_topk_min >= 0:
            raise self._bad("norm_topk_min", "must be >= 0")
        if self.group_score != "top2_sum" and self.n_group == 1:
            raise self._bad("group_score", "set, but routing is not group-limited (n_group=1)")
        if not self.router_softcap >= 0:
            raise self._bad("router_softcap", "must be >= 0 (0: no soft-capping)")

    def _validate_multipliers(self) -> None:
        """Embedding / residual / logit multipliers and the routed scaling factor are > 0."""
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                raise self._bad(name, "must be > 0")

    def _validate_experts(self) -> None:
        """Clamped-SwiGLU constants only with that activation; a shared-expert gate only with a shared expert."""
        if self.activation != "swiglu_clamped" and (self.swiglu_alpha, self.swiglu_limit) != (1.702, 7.0):
            raise self._bad("activation", "swiglu_alpha / swiglu_limit set: only activation='swiglu_clamped' uses them")
        if self.shared_combine not in ("sum", "average"):
            raise self._bad("shared_combine", "allowed: sum, average")
        if self.shared_combine != "sum" and not self.shared_expert_size:
            raise self._bad("shared_combine", "set, but there is no shared expert (shared_expert_size=0)")
        if self.moe_beside_mlp and not (self.moe_layers and self.intermediate_size >= 1):
            raise self._bad("moe_beside_mlp", "needs MoE layers and the dense MLP's intermediate_size >= 1")
        if self.moe_beside_mlp and (self.shared_expert_size or self.norm_placement != "sandwich"):
            raise self._bad("moe_beside_mlp", "a sandwich-norm model's, without shared experts (its MLP is beside)")
        if (self.router_input_norm or self.router_expert_scale) and not self.moe_beside_mlp:
            name = "router_input_norm" if self.router_input_norm else "router_expert_scale"
            raise self._bad(name, "built with moe_beside_mlp (Gemma 4's router) only")
        if self.router_weight_on_input and (self.top_k != 1 or self.zero_experts):
            why = f"built for one expert a token (top_k=1, not {self.top_k}) without zero-computation experts"
            raise self._bad("router_weight_on_input", why)
        self._validate_shortcut()
        if self.moe_output_bias and not self.moe_layers:
            raise self._bad("moe_output_bias", "a bias of MoE blocks, and there is none (moe_layers is empty)")
        if self.shared_expert_gate and not self.shared_expert_size:
            raise self._bad(
                "shared_expert_gate", "a gate for a shared expert that does not exist (shared_expert_size=0)"
            )

    def _validate_shortcut(self) -> None:
        """LongCat-Flash's pairs: an even number of plain pre-norm layers, the even ones MoE with a dense MLP beside."""
        if not self.moe_shortcut:
            return
        n = self.num_layers
        if n % 2 or sorted(self.moe_layers) != list(range(0, n, 2)):
            why = f"needs layers in pairs, the first of each MoE (moe_layers={self.moe_layers})"
            raise self._bad("moe_shortcut", why)
        if self.norm_placement != "pre" or self.residual_multiplier != 1.0 or self.layer_scale:
            raise self._bad("moe_shortcut", "built for pre-norm layers without multipliers or layer scales")
        plain = not (self.mixer_only_layers or self.moe_beside_mlp or self.shared_expert_size or self.moe_output_norm)
        if not plain or any(t in (*RECURRENT_KINDS, "none") for t in self.layer_types):
            raise self._bad(
                "moe_shortcut", "built with attention in every layer, without shared experts or other MoE blocks"
            )

    def attention_routes(self, layer: int) -> bool:
        """Whether ``layer``'s attention routes its tokens (``attention`` "moa", JetMoE's): an R3 column of its own."""
        return self.attention == "moa" and self.layer_types[layer] in ATTENTION_KINDS

    def route_layers(self) -> list[int]:
        """The layer of each R3 column: one per MoE layer and, before it, one per layer whose attention routes."""
        counts = [int(self.attention_routes(i)) + (i in self.moe_layer_set) for i in range(self.num_layers)]
        return [i for i, n in enumerate(counts) for _ in range(n)]

    def stage_bound(self) -> set[int]:
        """Layers that read what an earlier layer handed on within a forward (GLM-5's shared indexer layers, the
        second layer of LongCat-Flash's pairs): no pipeline stage starts at one."""
        pairs = set(range(1, self.num_layers, 2)) if self.moe_shortcut else set()
        return set(self.index_shared_layers) | pairs

    @property
    def moe_layer_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)

    def heads(self, layer: int) -> int:
        """Layer ``layer``'s query heads (``layer_heads`` where the model lists them per layer)."""
        return self.layer_heads[layer] if self.layer_heads else self.num_heads

    def head_size(self, layer: int) -> int:
        """Layer ``layer``'s head size (the sliding layers' own where the model has one)."""
        if self.sliding_head_dim and self.layer_types[layer] == "sliding":
            return self.sliding_head_dim
        return self.head_dim

    def kv_heads(self, layer: int) -> int:
        """Layer ``layer``'s KV heads (the sliding layers' own where the model has them)."""
        if self.sliding_kv_heads and self.layer_types[layer] == "sliding":
            return self.sliding_kv_heads
        return self.num_kv_heads

    def layer_rope(self, layer: int) -> tuple[RopeConfig, int | None]:
        """Layer ``layer``'s RoPE and rotated dims per head (None: all of head_dim): the sliding layers' own where
        the model has a RoPE per layer kind."""
        if self.sliding_rope is not None and self.layer_types[layer] == "sliding":
            return self.sliding_rope, self.sliding_rope_dim
        return self.rope, self.rope_dim
