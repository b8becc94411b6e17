"""MoE block: fp32 router with routing capture and replay, 3D experts with a grouped and a loop path.

Plain PyTorch in one dtype: training modes swap modules from outside (``moerl.model.lora``: ``LoraExperts``,
``moerl.model.mx``: ``MXExperts``), replacing the methods marked below as what a mode replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.grouped import Groups, group_mm
from moerl.model.linear import Linear
from moerl.model.norms import layer_norm, unit_rms


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
        self.softcap = cfg.router_softcap
        e = self.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32)) if cfg.router_bias else None
        if cfg.score_correction_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(e, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # Gemma 4's: the input scaled to unit RMS, times a learned scale and 1 / sqrt(H); a learned scale per expert
        # on the gate weights
        self.input_scale = nn.Parameter(torch.ones(cfg.hidden_size)) if cfg.router_input_norm else None
        self.input_eps = cfg.rms_norm_eps
        self.expert_scale = nn.Parameter(torch.ones(e)) if cfg.router_expert_scale else None

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
        own = self.input_scale is None and self.expert_scale is None
        return plain and own and self.n_group <= 1 and not self.norm_min and not self.softcap

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
        return self._scaled(w, idx)

    def _scaled(self, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.expert_scale is not None:
            w = w * self.expert_scale[idx]
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
        x = x.float()
        if self.input_scale is not None:
            x = unit_rms(x, self.input_eps) * self.input_scale * x.shape[-1] ** -0.5
        logits = F.linear(x, self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = self.scores(logits)
        if replay is None and scores is not None and self.e_score_correction_bias is None and self.n_group <= 1:
            # the top-k of the scores themselves: its values are the gather of them at its indices (one op fewer)
            w, idx = scores.topk(self.top_k, dim=-1)
            return self._scaled(self._normalized(w), idx), idx
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
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
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

    @property
    def zero(self) -> bool:
        """Whether the router also chooses zero-computation experts (slots past ``num_experts``)."""
        return self.zero_slots > 0

    @property
    def gated(self) -> bool:
        """Whether gate_up_proj holds gate rows then up rows (every activation but the un-gated ``relu2``)."""
        return self.activation != "relu2"

    def _gmm(self, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        """A grouped GEMM of the experts (what MXFP8 replaces)."""
        return group_mm(x, w, groups)

    def _expert_mm(
        self, x: torch.Tensor, name: str, groups: Groups, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows ``x`` sorted by expert times their experts' weight ``name`` (gate_up, down): ``_gmm``. ``out_dtype``:
        the dtype the caller wants back (x's by default), a backend's GEMM may give it in one step."""
        return self._gmm(x, getattr(self, f"{name}_proj").transpose(1, 2), groups)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One expert's GEMM in the reference loop (what MXFP8 replaces)."""
        return F.linear(x, w, bias)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx/weights [N, k] -> sum_k weights * expert_idx(x), [N, H] in x's dtype."""
        if self.grouped:
            return self._grouped(x, idx, weights)
        return self._loop(x, idx, weights)

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        route = Route(idx, weights, self.num_experts, x.dtype, self.zero)
        h = self._gate_up_hidden(x.index_select(0, route.token), route)
        return self._down_sum(x, self._expert_mm(h, "down", route.by_expert, x.dtype), route)

    def _gate_up_hidden(self, xs: torch.Tensor, route: Route) -> torch.Tensor:
        """The expert-sorted rows ``xs`` -> the gate-weighted activations that down_proj takes (``_hidden`` of
        their gate_up rows)."""
        return self._hidden(self._expert_mm(xs, "gate_up", route.by_expert), route)

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
    """Dense SwiGLU MLP (also the shared expert), GELU-tanh gated with ``activation`` "gelu_tanh" (Gemma's); with
    "relu2" un-gated: ``down(relu(up(x))^2)`` (Nemotron-H's), no ``gate_proj``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.gated = activation != "relu2"
        self.gelu = activation == "gelu_tanh"
        if self.gated:
            self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(F.relu(self.up_proj(x)).square())
        gate = self.gate_proj(x)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * self.up_proj(x))


def mlp_activation(cfg: ModelConfig) -> str:
    """The dense and shared MLPs' activation: the experts' (GPT-OSS's clamped SwiGLU is its experts' alone: SwiGLU)."""
    return "silu" if cfg.activation == "swiglu_clamped" else cfg.activation


class MoE(nn.Module):
    """Router + routed experts + optional (gated) shared expert; or (``moe_beside_mlp``, Gemma 4's) a dense MLP beside
    the experts, the block taking the residual stream: each part its own norm in and out, the router its own."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        size = cfg.intermediate_size if cfg.moe_beside_mlp else cfg.shared_expert_size
        self.shared_experts = MLP(cfg.hidden_size, size, cfg.mlp_bias, mlp_activation(cfg)) if size else None
        self.beside = cfg.moe_beside_mlp
        if self.beside:
            for name in ("shared_input_norm", "shared_output_norm", "routed_input_norm", "routed_output_norm"):
                setattr(self, name, layer_norm(cfg, cfg.hidden_size))
        self.shared_experts_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        self.shared_combine = cfg.shared_combine
        self.weight_on_input = cfg.router_weight_on_input
        # the router's slots from here on are zero-computation experts (whatever share of the experts a rank holds)
        self.real_experts = cfg.num_experts
        self.bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.moe_output_bias else None  # JetMoE's

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (output [N, H], chosen experts [N, k])."""
        if self.beside:
            return self._beside(x, replay)
        weights, idx = self.router(x, replay)
        if self.weight_on_input:  # one expert a token (ModelConfig): its input scaled, its output summed as is
            out = self._experts(x * weights.to(x.dtype), idx, torch.ones_like(weights))
        else:
            out = self._experts(x, idx, weights)
        if self.experts.zero:  # zero-computation experts return their input: each adds its gate weight times x
            share = weights.masked_fill(idx < self.real_experts, 0.0).sum(-1, keepdim=True)
            out = out + share.to(x.dtype) * x
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(x)) * shared
            out = out + shared if self.shared_combine == "sum" else (out + shared) * 0.5
        if self.bias is not None:
            out = out + self.bias
        return out, idx

    def _beside(self, x: torch.Tensor, replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma 4's block of the residual stream ``x``: the MLP and the experts side by side, summed."""
        weights, idx = self.router(x, replay)
        routed = self.routed_output_norm(self._experts(self.routed_input_norm(x), idx, weights))
        return self.shared_output_norm(self.shared_experts(self.shared_input_norm(x))) + routed, idx

    def _experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for rows ``x`` (a compiled decode step's MoE may take their dense path,
        ``Experts._dense``: ``moerl.engine.compiled.GraphMoE``)."""
        return self.experts(x, idx, weights)
