"""MoE block: fp32 router with routing capture and replay, 3D experts with a grouped and a loop path.

Plain PyTorch in one dtype: training modes swap modules from outside (``moerl.model.lora``: ``LoraExperts``,
``moerl.model.mx``: ``MXExperts``), replacing the methods marked below as what a mode replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.grouped import Groups, group_mm, streams_weights
from moerl.model.linear import Linear
from moerl.model.packed import (
    KINDS,
    bf16_dot,
    graph_panels,
    moe_decode,
    packed_group_mm,
    packed_group_mm_op,
    packed_weight,
    packs,
)

# the packed kernel's rows of a group sit in registers against each panel of its weight: past this many a group
# (prefill) reuses each panel enough for MKL's blocked GEMM over the K-major weight to be the faster one
PACKED_MAX_ROWS = 32
# bf16 experts on the bf16 dot products take 16 rows a block against a panel kept in cache: a prefill's experts in one
# call too, up to this many (token, expert) rows (the call's fp32 scratch grows with them)
BF16_DOT_MAX_ROWS = 4096


class Router(nn.Module):
    """Scores tokens against experts in fp32, whatever the model dtype, and picks top-k.

    Its parameters and buffers stay fp32 through ``model.to(dtype)``: ``_apply`` casts them back.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts + cfg.zero_experts, cfg.top_k  # the zero experts' slots too
        self.scoring, self.topk_before_softmax = cfg.scoring, cfg.topk_before_softmax
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.norm_min, self.sparsemixer_eps = cfg.norm_topk_min, cfg.sparsemixer_eps
        self.n_group, self.topk_group, self.group_score = cfg.n_group, cfg.topk_group, cfg.group_score
        e = self.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32)) if cfg.router_bias else None
        if cfg.score_correction_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(e, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for t in [*self._parameters.values(), *self._buffers.values()]:
            if t is not None and t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self

    @property
    def softmax_top_k(self) -> bool:
        """Whether this router's rule is a softmax top-k of the router's own scores (no correction bias, groups or
        floor of the normalisation): the rule a backend's one-call router computes."""
        plain = self.scoring == "softmax" and not self.topk_before_softmax and self.e_score_correction_bias is None
        return plain and self.n_group <= 1 and not self.norm_min

    def _select(self, logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Top-k expert indices [N, k] by the model's rule."""
        if self.topk_before_softmax:
            return logits.topk(self.top_k, dim=-1).indices
        if self.scoring == "sparsemixer":  # the best expert, then the best of the others
            first = logits.argmax(-1, keepdim=True)
            return torch.cat([first, logits.scatter(1, first, float("-inf")).argmax(-1, keepdim=True)], dim=1)
        # top-k of the probabilities, not the logits: the same ties as the HF reference
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.n_group > 1:
            n, per_group = choice.shape[0], self.num_experts // self.n_group
            grouped = choice.view(n, self.n_group, per_group)
            if self.group_score == "max":  # DeepSeek-V2's group_limited_greedy: a group scores its best expert
                group_score = grouped.max(dim=-1).values
            else:  # DeepSeek-V3's noaux_tc: the sum of its best two
                group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
            keep = group_score.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            # masked experts score 0 under softmax (as V2's reference masks them), -inf under sigmoid
            fill = 0.0 if self.scoring == "softmax" and self.e_score_correction_bias is None else float("-inf")
            choice = choice.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), fill)
        return choice.topk(self.top_k, dim=-1).indices

    def scores(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Per-expert fp32 scores: softmax or sigmoid of the logits (None when softmax follows the top-k, and for
        sparsemixer, whose weights depend on the chosen experts)."""
        if self.topk_before_softmax or self.scoring == "sparsemixer":
            return None
        return logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(-1)

    def gate_weights(self, logits: torch.Tensor, scores: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
        """fp32 gate weights [N, k] at indices ``idx`` from this forward's scores, by the model's rule."""
        if self.topk_before_softmax:
            w = logits.gather(1, idx).softmax(-1)
        elif self.scoring == "sparsemixer":
            w = self._sparsemixer_weights(logits, idx)
        else:
            w = self._normalized(scores.gather(1, idx))
        return self._scaled(w)

    def _scaled(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scale if self.scale != 1.0 else w

    def _normalized(self, w: torch.Tensor) -> torch.Tensor:
        """The chosen experts' scores ``w`` [N, k] as gate weights (summing to 1 where ``norm_topk_prob``)."""
        if self.norm_topk_prob:
            total = w.sum(-1, keepdim=True)
            if self.norm_min:
                total = total.clamp(min=self.norm_min)
            elif self.scoring == "sigmoid":
                total = total + 1e-20
            w = w / total
        return w

    def _sparsemixer_weights(self, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """PhiMoE's sparsemixer weights in its deterministic (eval) form, for the experts ``idx`` [N, 2]: each
        expert's softmax weight among the experts whose logits lie within ``2 eps`` (relative) of its own, the
        second one's with the first taken out. With the router's own choice (the best, then the best of the rest)
        this is PhiMoE's eval routing; with replayed experts (R3) the same rule around the replayed ones (the
        training form samples its experts: R3 replays what the engine sampled, with these weights)."""
        out, masked = [], logits
        for j in range(2):
            own = masked.gather(1, idx[:, j : j + 1])
            factor = logits.abs().clamp(min=own)
            gates = masked.masked_fill((own - logits) / factor > 2 * self.sparsemixer_eps, float("-inf"))
            out.append(gates.softmax(-1).gather(1, idx[:, j : j + 1]))
            masked = masked.scatter(1, idx[:, j : j + 1], float("-inf"))
        return torch.cat(out, dim=1)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (gate weights [N, k] fp32, expert indices [N, k] int64).

        ``replay`` [N, k] replaces the router's own choice; rows holding -1 keep the router's own choice.
        """
        logits = F.linear(x.float(), self.weight, self.bias)
        scores = self.scores(logits)
        if replay is None and scores is not None and self.e_score_correction_bias is None and self.n_group <= 1:
            # the top-k of the scores themselves: its values are the gather of them at its indices (one op fewer)
            w, idx = scores.topk(self.top_k, dim=-1)
            return self._scaled(self._normalized(w)), idx
        if replay is None:
            idx = self._select(logits, scores)
        else:
            # rows holding -1 route themselves; chosen for every row and picked, not tested: no host sync per layer
            idx = replay.long()
            idx = torch.where(idx[:, :1] < 0, self._select(logits, scores), idx)
        return self.gate_weights(logits, scores, idx), idx


def _activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "relu2":  # un-gated: the rows are the up projection alone
        return F.relu(gate_up).square()
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    # GPT-OSS: clamped SwiGLU with (up + 1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class Route:
    """The (token, slot) pairs of a forward sorted by expert: ``token`` and ``expert`` per pair, ``by_expert`` (the
    grouped GEMMs' groups) and ``gate`` [pairs, 1] (each pair's gate weight, in the activations' dtype)."""

    __slots__ = ("token", "expert", "by_expert", "gate")

    def __init__(self, idx: torch.Tensor, weights: torch.Tensor, n_experts: int, dtype: torch.dtype, zero=False):
        """``zero``: the model has zero-computation experts (ids >= ``n_experts``), whose pairs sort last and are left
        out: no GEMM runs for them (``MoE`` adds their share)."""
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        if zero:  # how many pairs go to real experts: a host read (free on a CPU; zero experts are LongCat's alone)
            order = order[: int((flat < n_experts).sum())]
        self.token, self.expert = order // k, flat[order]
        self.by_expert = Groups(self.expert, n_experts)
        self.gate = weights.reshape(-1)[order, None].to(dtype)


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # per expert, dim 0


class Experts(nn.Module):
    """E experts as 3D tensors: ``gate_up_proj`` [E, 2I, H] (gate rows first; un-gated ``relu2`` experts: [E, I, H],
    the up rows alone), ``down_proj`` [E, H, I].

    A mode's subclass replaces the GEMMs (``_gmm``, ``_linear``, ``_packs``: MXFP8) or adds to the projections
    (``_grouped`` around ``_hidden`` and ``_down_sum``, ``_project`` in the reference loop: LoRA)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.zero_slots = e, cfg.zero_experts
        self.activation, self.alpha, self.limit = cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit
        rows = i if cfg.activation == "relu2" else 2 * i
        self.gate_up_proj = nn.Parameter(torch.empty(e, rows, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, rows)) if cfg.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h)) if cfg.expert_bias else None
        self.grouped = True  # False: the per-expert loop, kept as the reference
        self.dense_in_graph = False  # inside a compiled graph: every expert on every token (see _dense)
        self.packed = False  # an engine's decode: GEMMs from prepacked weights (``k_major``, ``moerl.model.packed``)

    @property
    def zero(self) -> bool:
        """Whether the router also chooses zero-computation experts (slots past ``num_experts``)."""
        return self.zero_slots > 0

    @torch.no_grad()
    def k_major(self) -> None:
        """The CPU engine's decode layout. Where streaming the weights bounds the GEMM (``streams_weights``) the
        weights are stored with their reduction dim outermost ([E, H, 2I] and [E, I, H] in memory; shapes, names and
        values unchanged), so each expert's ``w.transpose(1, 2)`` is contiguous for MKL's GEMM (prefill:
        it streams a contiguous reduction dim faster than a strided one); and decode's GEMMs (a few rows a
        group) run from prepacked panels of them (``moerl.model.packed``, where its kernel builds: a packed copy
        beside each weight, made again after a sync). A weight sync's ``copy_`` writes through both."""
        for p in (self.gate_up_proj, self.down_proj):
            if streams_weights(p) and p.is_contiguous():
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        # experts of any size and dtype: decode's experts then run as one kernel call (``moe_decode``), where the
        # grouped path takes a dozen ops
        self.packed = packs(gate_up, self.gated) and packs(down, False)

    @property
    def gated(self) -> bool:
        """Whether gate_up_proj holds gate rows then up rows (every activation but the un-gated ``relu2``)."""
        return self.activation != "relu2"

    def _packs(self, rows: torch.Tensor, limit: int | None = None) -> bool:
        """Whether this GEMM runs from the packed weights: an engine's decode (no autograd, a few rows a group:
        ``limit`` rows at most), eager or in the compiled decode step (whose panels are made before it:
        ``refresh_packed``)."""
        if not self.packed or torch.is_grad_enabled() or rows.device.type != "cpu":
            return False
        if rows.dtype not in KINDS or self.down_proj.dtype not in KINDS:  # cast since: torch's GEMM
            return False
        if torch.compiler.is_compiling():  # decode batches only (max_num_seqs rows at most)
            return graph_panels(self, "down") is not None
        return rows.shape[0] <= (limit or PACKED_MAX_ROWS * self.num_experts)

    def _one_call(self, x: torch.Tensor, idx: torch.Tensor) -> bool:
        """Whether a decode step's experts run as one kernel call, eager or in the compiled step
        (``moerl.model.packed.moe_decode``: sort, gather, both GEMMs and the sum, where the grouped path takes a dozen
        ops): packed SiLU-gated experts without biases or zero experts; bf16 ones on the bf16 dot products for a
        prefill too."""
        on_bf16_dot = x.dtype == self.down_proj.dtype == torch.bfloat16 and bf16_dot()
        limit = BF16_DOT_MAX_ROWS if on_bf16_dot else PACKED_MAX_ROWS * self.num_experts
        if not self.plain_silu or not self._packs(x, limit):
            return False
        return torch.compiler.is_compiling() or idx.numel() <= limit

    @property
    def plain_silu(self) -> bool:
        """SiLU-gated experts without biases or zero experts: what ``moe_decode`` computes."""
        plain = self.activation == "silu" and self.gated and not self.zero
        return plain and self.gate_up_proj_bias is None and self.down_proj_bias is None

    def _packed_mm(
        self,
        x: torch.Tensor,
        name: str,
        groups: Groups,
        mode: int,
        scale: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``packed_group_mm`` of rows ``x`` by weight ``name`` (gate_up, down), eager or as a graph's op; the result
        in ``out_dtype`` (x's by default)."""
        out_dtype = out_dtype or x.dtype
        if groups.opaque:
            return packed_group_mm_op(x, graph_panels(self, name), groups.keys, groups.n_groups, mode, scale, out_dtype)
        return packed_group_mm(x, self._panels(name), groups.offs, mode, scale, out_dtype)

    def _panels(self, name: str) -> torch.Tensor:
        """Weight ``name``'s packed panels, up to date with it (``moerl.model.packed.packed_weight``)."""
        return packed_weight(self, name, getattr(self, f"{name}_proj"), name == "gate_up" and self.gated)

    def refresh_packed(self) -> None:
        """Make (or pack again after a sync) the panels a compiled graph reads, outside it."""
        if self.packed:
            self._panels("gate_up")
            self._panels("down")

    def _gmm(self, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        """A grouped GEMM of the experts (what MXFP8 replaces)."""
        return group_mm(x, w, groups)

    def _expert_mm(
        self, x: torch.Tensor, name: str, groups: Groups, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows ``x`` sorted by expert times their experts' weight ``name`` (gate_up, down): from the packed panels
        where an engine's decode takes them (``_packs``; the result in ``out_dtype``, x's by default), else
        ``_gmm``."""
        if self._packs(x):
            return self._packed_mm(x, name, groups, int(name == "gate_up" and self.gated), out_dtype=out_dtype)
        return self._gmm(x, getattr(self, f"{name}_proj").transpose(1, 2), groups)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One expert's GEMM in the reference loop (what MXFP8 replaces)."""
        return F.linear(x, w, bias)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx/weights [N, k] -> sum_k weights * expert_idx(x), [N, H] in x's dtype."""
        if self.dense_in_graph and torch.compiler.is_compiling():
            return self._dense(x, idx, weights)
        if self.grouped:
            return self._grouped(x, idx, weights)
        return self._loop(x, idx, weights)

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self._one_call(x, idx):
            return self._in_one_call(x, idx, weights)
        route = Route(idx, weights, self.num_experts, x.dtype, self.zero)
        xs = x.index_select(0, route.token)
        if self._packs(xs) and self.activation == "silu" and self.gate_up_proj_bias is None:
            # SiLU(gate) * up * the routing weight as each panel's result is stored (``packed``'s mode 2), kept in
            # fp32 for the down kernel (which widens bf16 rows first anyway)
            h = self._packed_mm(xs, "gate_up", route.by_expert, 2, route.gate.reshape(-1), torch.float32)
        else:
            h = self._hidden(self._expert_mm(xs, "gate_up", route.by_expert), route)
        return self._down_sum(x, self._expert_mm(h, "down", route.by_expert, x.dtype), route)

    def _in_one_call(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        lora: list[torch.Tensor] | None = None,
        prepared=None,
    ) -> torch.Tensor:
        """``moe_decode`` on this layer's panels (``lora``: an adapter's slots and factors, LoraExperts'; ``prepared``:
        their checked kernel struct, ``moe_lora``'s)."""
        panels = graph_panels if torch.compiler.is_compiling() else Experts._panels
        return moe_decode(x, idx, weights, panels(self, "gate_up"), panels(self, "down"), lora, prepared)

    def _hidden(self, h: torch.Tensor, route: Route) -> torch.Tensor:
        """The gate_up rows ``h`` (expert-sorted) -> the gate-weighted activations that down_proj takes."""
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[route.expert]
        # the gate weight scales the small [*, I] activation, not the [*, H] output: down_proj is linear
        return _activate(h, self.activation, self.alpha, self.limit) * route.gate

    def _down_sum(self, x: torch.Tensor, y: torch.Tensor, route: Route) -> torch.Tensor:
        """The down_proj rows ``y`` (expert-sorted) summed per token -> [N, H] in x's dtype."""
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[route.expert] * route.gate
        return torch.zeros_like(x).index_add_(0, route.token, y)

    def _dense(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by a gate matrix that is zero off the chosen experts: two GEMMs
        over all experts and no sort, gather or scatter. E / k times the expert FLOPs, and fewer ops: it pays only
        where the experts are small (the compiled decode step decides, ``moerl.engine.compiled``). Every operand
        passes ``_operand`` (MXFP8: quantized along its reduction dim, as the grouped path's); a mode adds its deltas
        through ``_dense_gate_up_delta`` / ``_dense_down_delta`` (LoRA)."""
        n, e, q = x.shape[0], self.num_experts, self._operand
        # the zero experts' slots scattered too, then cut away: their share is MoE's
        gate = x.new_zeros(n, e + self.zero_slots).scatter_(1, idx, weights.to(x.dtype))[:, :e]  # [N, E]
        bias = self.gate_up_proj_bias.flatten() if self.gate_up_proj_bias is not None else None
        h = F.linear(q(x, -1), q(self.gate_up_proj, 2).flatten(0, 1), bias).view(n, e, -1)
        h = _activate(h + self._dense_gate_up_delta(x), self.activation, self.alpha, self.limit) * gate[:, :, None]
        y = torch.bmm(q(h, -1).transpose(0, 1), q(self.down_proj, 2).transpose(1, 2)).sum(0)  # [N, H]
        y = y + self._dense_down_delta(h)
        return y + gate @ self.down_proj_bias if self.down_proj_bias is not None else y

    def _operand(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """A GEMM operand of the dense path as the grouped GEMMs take it, reduced along ``dim`` (MXFP8 quantizes)."""
        return t

    def _dense_gate_up_delta(self, x: torch.Tensor) -> torch.Tensor | float:
        """What the dense path adds to every expert's gate_up rows of ``x`` [N, H] ([N, E, 2I]; LoRA's slots)."""
        return 0.0

    def _dense_down_delta(self, h: torch.Tensor) -> torch.Tensor | float:
        """What the dense path adds to the routed sum from the gate-weighted activations ``h`` [N, E, I]."""
        return 0.0

    def _loop(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = (idx == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gu = self._project(e, "gate_up", x[token], token)
            y = self._project(e, "down", _activate(gu, self.activation, self.alpha, self.limit), token)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out

    def _project(self, e: int, which: str, rows: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s ``which`` projection (gate_up or down) of ``rows`` (those of tokens ``token``), with its
        bias: one step of the reference loop."""
        bias = getattr(self, f"{which}_proj_bias")
        return self._linear(rows, getattr(self, f"{which}_proj")[e], bias[e] if bias is not None else None)


class MLP(nn.Module):
    """Dense SwiGLU MLP (also the shared expert); with ``activation`` "relu2" un-gated: ``down(relu(up(x))^2)``
    (Nemotron-H's), no ``gate_proj``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.gated = activation != "relu2"
        if self.gated:
            self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(F.relu(self.up_proj(x)).square())
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_activation(cfg: ModelConfig) -> str:
    """The dense and shared MLPs' activation: un-gated relu2 with relu2 experts, else SwiGLU (GPT-OSS's clamped
    SwiGLU is its experts' alone)."""
    return "relu2" if cfg.activation == "relu2" else "silu"


class MoE(nn.Module):
    """Router + routed experts + optional (gated) shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.shared_expert_size, cfg.mlp_bias, mlp_activation(cfg))
            if cfg.shared_expert_size
            else None
        )
        self.shared_experts_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (output [N, H], chosen experts [N, k])."""
        weights, idx = self.router(x, replay)
        out = self.experts(x, idx, weights)
        if self.experts.zero:  # zero-computation experts return their input: each adds its gate weight times x
            share = weights.masked_fill(idx < self.experts.num_experts, 0.0).sum(-1, keepdim=True)
            out = out + share.to(x.dtype) * x
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(x)) * shared
            out = out + shared
        return out, idx
