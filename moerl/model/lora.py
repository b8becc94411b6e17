"""LoRA on linear layers and on 3D experts, with several adapters resident at once.

``attach_lora`` swaps each target for its LoRA class from outside the model (gpt-fast's module swap): a ``Linear``
becomes a ``LoraLinear``, the routed ``Experts`` a ``LoraExperts``; each holds its adapter weights as ``.lora`` and
keeps the base's own parameters.

Each adapted module holds ``S`` adapter *slots* (stacked A / B tensors); every token of a forward picks a slot
(or none) through the model's shared ``LoraContext``. The trainer uses one slot, the engine many.

Expert layouts (DESIGN "Expert adapters"):
- ``per_expert``: expert e has its own A/B on gate_up and on down.
- ``shared_outer``: the hidden-size side is shared across experts: one gate_up A ``[r, H]`` (the shrink runs once
  per token) and one down B ``[H, r]`` (the expand runs once per token, after the routed sum); the
  intermediate-size side stays per expert.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from moerl.device import on_gpu
from moerl.model.grouped import Groups, device_kernel, group_mm
from moerl.model.linear import Linear
from moerl.model.moe import Experts, Route
from moerl.model.swap import plain_class, replace_module, state_of, swapped

LAYOUTS = ("per_expert", "shared_outer")


class LoraContext:
    """The adapter slot of every token in the current forward, shared by all LoRA weights of one model.

    One slot for every token (``single``) takes each projection's plain GEMMs. A mix of slots (``token_slots`` [N], -1
    = none) is applied without reading the slots on the host, so no projection syncs with a GPU and a compiled graph
    holds it: a linear layer runs every slot's shrink in one GEMM and keeps each token's own by a mask; the experts'
    grouped GEMMs group the rows by (slot, expert), rows without an adapter weighted 0."""

    def __init__(self):
        self.enabled = True
        self.single: int | None = None  # every token uses this slot
        self.token_slots: torch.Tensor | None = None  # [N] slot per flattened token, -1 = no adapter
        self._filled: dict[tuple[int, int], torch.Tensor] = {}  # row_slots of one slot for all: made once a size
        # slots given as a tensor stay one (never read on the host): a compiled decode step (``moerl.engine.compiled``)
        # sets it, so its graph takes the slots as an input, where a slot read as a number would break the graph or
        # make one of its own
        self.slots_as_tensor = False

    def set(self, adapters: int | torch.Tensor | None, batch: int, seq: int) -> None:
        """``adapters``: None (no LoRA), a slot for all tokens, a slot per sequence [B] or per token [B, T] (-1 =
        none). Slots held on the CPU are read (no sync there): one slot for all takes the single-slot path."""
        self.single, self.token_slots = None, None
        if adapters is None or isinstance(adapters, int):
            self.single = adapters
            return
        adapters = adapters.long()
        if not on_gpu(adapters) and not self.slots_as_tensor:
            first = int(adapters.flatten()[0])
            if bool((adapters == first).all()):
                self.single = first if first >= 0 else None
                return
        self.token_slots = (adapters if adapters.ndim == 2 else adapters[:, None].expand(batch, seq)).flatten()

    @property
    def active(self) -> bool:
        return self.enabled and (self.single is not None or self.token_slots is not None)

    def row_slots(self, rows: int) -> torch.Tensor:
        """Each of the forward's ``rows`` flattened tokens' slot, int64 [rows] (-1 = none)."""
        if self.token_slots is not None:
            return self.token_slots
        key = (rows, -1 if self.single is None else self.single)
        slots = self._filled.get(key)
        if slots is None:  # the same tensor every step of that size: the kernels' prepared arguments stay valid
            if len(self._filled) >= 64:
                self._filled.clear()
            slots = self._filled[key] = torch.full((rows,), key[1], dtype=torch.long)
        return slots

    def pick(self, slots: int, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, slots]: each token's adapter scale at its slot, 0 elsewhere (and everywhere for -1)."""
        s = self.token_slots
        return F.one_hot(s.clamp(min=0), slots).to(dtype) * ((s >= 0).to(dtype)[:, None] * scale.to(dtype))


@dataclass(slots=True)
class LoraConfig:
    """Shape of the adapters a model carries: which modules, rank, scale, expert layout, number of slots."""

    rank: int = 8  # adapter rank r
    alpha: float = 16.0  # scale: alpha / r (alpha / sqrt(r) with rslora)
    targets: list[str] | None = None  # None: every linear layer (not router / lm_head) and the routed experts
    layout: Literal[LAYOUTS] = "per_expert"  # per_expert | shared_outer
    rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    dropout: float = 0.0  # dropout on the adapter's input while training
    expert_rank_norm: bool = False  # expert adapters get rank // top_k
    slots: int = 1  # adapters the model holds at once (engines: one per adapter served)

    def __post_init__(self) -> None:
        from moerl.config import require

        rules = (
            ("rank", self.rank, self.rank >= 1, "must be >= 1"),
            ("alpha", self.alpha, math.isfinite(self.alpha) and self.alpha > 0, "must be finite and > 0"),
            ("layout", self.layout, self.layout in LAYOUTS, f"allowed: {', '.join(LAYOUTS)}"),
            ("dropout", self.dropout, 0 <= self.dropout < 1, "must lie in [0, 1)"),
            ("slots", self.slots, self.slots >= 1, "must be >= 1"),
        )
        require("lora.{}", rules)

    def scale(self, rank: int) -> float:
        return self.alpha / math.sqrt(rank) if self.rslora else self.alpha / rank


class LinearLora(nn.Module):
    """Slots of (A [r, in], B [out, r]) for one linear layer; ``forward`` returns the delta."""

    def __init__(self, ctx: LoraContext, slots: int, rank: int, d_in: int, d_out: int, dropout: float, dtype):
        super().__init__()
        self.ctx = ctx
        self.lora_A = nn.Parameter(torch.zeros(slots, rank, d_in, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(slots, d_out, rank, dtype=dtype))
        self.scale = nn.Buffer(torch.zeros(slots))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base layer's output for ``x``) plus this layer's LoRA delta."""
        x2 = self.dropout(x.reshape(-1, x.shape[-1]).to(self.lora_A.dtype))
        y2 = y.reshape(-1, y.shape[-1])
        if self.ctx.token_slots is not None:  # every slot's shrink in one GEMM, masked, then one expand
            slots, rank = self.lora_A.shape[:2]
            xa = (x2 @ self.lora_A.flatten(0, 1).T).view(-1, slots, rank)
            xa = xa * self.ctx.pick(slots, self.scale, xa.dtype)[:, :, None]
            return y + (xa.flatten(1) @ self.lora_B.transpose(1, 2).flatten(0, 1)).to(y.dtype).view_as(y)
        s = self.ctx.single
        xa = F.linear(x2, self.lora_A[s]) * self.scale[s]
        if xa.dtype == y.dtype:  # expand and add in one GEMM
            return torch.addmm(y2, xa, self.lora_B[s].T).view_as(y)
        return y + F.linear(xa, self.lora_B[s]).to(y.dtype).view_as(y)

    def delta_weight(self, slot: int) -> torch.Tensor:
        """scale * B @ A for merging: [out, in]."""
        return self.lora_B[slot] @ self.lora_A[slot] * self.scale[slot]


class LoraLinear(Linear):
    """A projection with adapter slots: the base product plus the delta of the active slots."""

    lora: LinearLora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lora.ctx.active:
            return super().forward(x)
        return self.lora(x, super().forward(x))


class ExpertLora(nn.Module):
    """Adapters on the 3D experts, both projections, in the ``per_expert`` or ``shared_outer`` layout (``rows``: the
    gate_up projection's, 2I, or I for un-gated experts)."""

    def __init__(self, ctx: LoraContext, slots: int, rank: int, e: int, h: int, rows: int, i: int, layout: str, dtype):
        super().__init__()
        self.ctx, self.layout, self.num_experts = ctx, layout, e
        shared = layout == "shared_outer"
        self.gate_up_A = nn.Parameter(torch.zeros((slots, rank, h) if shared else (slots, e, rank, h), dtype=dtype))
        self.gate_up_B = nn.Parameter(torch.zeros(slots, e, rows, rank, dtype=dtype))
        self.down_A = nn.Parameter(torch.zeros(slots, e, rank, i, dtype=dtype))
        self.down_B = nn.Parameter(torch.zeros((slots, h, rank) if shared else (slots, e, h, rank), dtype=dtype))
        self.scale = nn.Buffer(torch.zeros(slots))

    # -- per (slot, expert) factors, for the naive path and for merging ------------------------------------
    def factors(self, slot: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up A [r, H], gate_up B [2I, r], down A [r, I], down B [H, r]) of one expert in one slot."""
        shared = self.layout == "shared_outer"
        gu_a = self.gate_up_A[slot] if shared else self.gate_up_A[slot, expert]
        dn_b = self.down_B[slot] if shared else self.down_B[slot, expert]
        return gu_a, self.gate_up_B[slot, expert], self.down_A[slot, expert], dn_b

    def delta_weights(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """scale * B @ A for gate_up [E, 2I, H] and down [E, H, I]."""
        s = self.scale[slot]
        gu, dn = [], []
        for e in range(self.num_experts):
            gu_a, gu_b, dn_a, dn_b = self.factors(slot, e)
            gu.append(gu_b @ gu_a * s)
            dn.append(dn_b @ dn_a * s)
        return torch.stack(gu), torch.stack(dn)

    # -- fused path: inside the grouped expert computation ------------------------------------------------
    def groups(self, token: torch.Tensor, expert: torch.Tensor, by_expert):
        """Group the expert-sorted rows by (slot, expert) for the LoRA GEMMs.

        Returns (perm, groups, slot): ``perm`` None when every row uses one slot ``slot`` (the rows are already
        grouped by expert); else every row ordered by (slot, expert), with ``slot`` None. A row without an adapter
        sits in slot 0's groups and gets scale 0 (``_row_scale``): its delta is 0, and no host read drops it.
        """
        if self.ctx.single is not None:
            return None, by_expert, self.ctx.single
        key = self.ctx.token_slots[token].clamp(min=0) * self.num_experts + expert
        order = key.argsort(stable=True)
        return order, Groups(key[order], self.gate_up_B.shape[0] * self.num_experts), None

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the adapters' GEMMs run in: the factors' own; on CUDA the activations' where only that one has
        the grouped kernel (the trainer's fp32 factors would take torch's per-group fallback, a host sync per
        GEMM): the fp32 factors stay the optimizer's, cast on the way in."""
        own = self.gate_up_B.dtype
        if own != x.dtype and device_kernel(x.dtype, x.device) and not device_kernel(own, x.device):
            return x.dtype
        return own

    def _stack(self, t: torch.Tensor, slot: int | None, per_expert: bool, dtype: torch.dtype) -> torch.Tensor:
        """Weights for grouped_mm: [groups, in, out] over experts of one slot or over (slot, expert) pairs."""
        if slot is not None:
            t = t[slot]
        elif per_expert:
            t = t.flatten(0, 1)
        return t.to(dtype).transpose(-1, -2)

    def _row_scale(self, token: torch.Tensor, perm, slot, dtype: torch.dtype) -> torch.Tensor:
        """The adapter scale of each row: a 0-d tensor for one slot (it does not promote bf16 rows), else ``[rows,
        1]`` in ``dtype``, 0 for a row without an adapter."""
        if slot is not None:
            return self.scale[slot]
        row_slot = self.ctx.token_slots[token[perm]]
        scale = torch.where(row_slot >= 0, self.scale[row_slot.clamp(min=0)], 0.0)
        return scale.unsqueeze(1).to(dtype)

    def _slot_rows(self, t: torch.Tensor, w: torch.Tensor, slot: int | None) -> torch.Tensor:
        """Per token of ``t`` [N, d]: ``t @ w[s].T`` for its slot s (one slot, or each token's own, -1 as slot 0 with
        every slot's product in one GEMM), ``w`` [S, out, d] -> [N, out]."""
        if slot is not None:
            return t @ w[slot].T
        n, (slots, out, _) = t.shape[0], w.shape
        every = (t @ w.flatten(0, 1).T).view(n, slots, out)
        own = self.ctx.token_slots.clamp(min=0)[:, None, None].expand(n, 1, out)
        return every.gather(1, own).squeeze(1)

    def gate_up_delta(self, x, xs, token, groups) -> tuple[torch.Tensor, torch.Tensor | None]:
        """LoRA delta of gate_up for the expert-sorted rows: (delta, perm) to add at rows ``perm`` (or all)."""
        perm, groups, slot = groups
        dt = self.compute_dtype(x)
        if self.layout == "shared_outer":  # shrink once per token, then gather the rows
            tok = token if perm is None else token[perm]
            xa = self._slot_rows(x.to(dt), self.gate_up_A.to(dt), slot)[tok]
        else:
            rows = xs if perm is None else xs[perm]
            xa = group_mm(rows.to(dt), self._stack(self.gate_up_A, slot, True, dt), groups)
        xa = xa * self._row_scale(token, perm, slot, dt)
        return group_mm(xa, self._stack(self.gate_up_B, slot, True, dt), groups), perm

    def down_delta(self, hs, token, n_tokens, groups):
        """LoRA delta of down for the (gate-weighted) expert-sorted activations ``hs``.

        per_expert: (delta rows, perm) to add to the expert outputs before the routed sum.
        shared_outer: (delta [N, H] per token, None): the shrinks are summed per token, then expanded once.
        """
        perm, groups, slot = groups
        dt = self.compute_dtype(hs)
        rows = hs if perm is None else hs[perm]
        ha = group_mm(rows.to(dt), self._stack(self.down_A, slot, True, dt), groups)
        ha = ha * self._row_scale(token, perm, slot, dt)
        if self.layout == "per_expert":
            return group_mm(ha, self._stack(self.down_B, slot, True, dt), groups), perm
        tok = token if perm is None else token[perm]
        u = ha.new_zeros(n_tokens, ha.shape[1]).index_add_(0, tok, ha)  # routed sum in rank space
        return self._slot_rows(u, self.down_B.to(dt), slot), None


class LoraExperts(Experts):
    """The routed experts with adapter slots on both projections (``.lora``: an ``ExpertLora``)."""

    lora: ExpertLora

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        lora = self.lora
        if not lora.ctx.active:
            return super()._grouped(x, idx, weights)
        route = Route(idx, weights, self.num_experts, x.dtype, self.zero)
        groups = lora.groups(route.token, route.expert, route.by_expert)
        xs = x.index_select(0, route.token)
        h = self._expert_mm(xs, "gate_up", route.by_expert)
        delta, rows = lora.gate_up_delta(x, xs, route.token, groups)
        h = self._hidden(_add(h, delta, rows), route)
        y = self._expert_mm(h, "down", route.by_expert)
        delta, rows = lora.down_delta(h, route.token, x.shape[0], groups)
        if lora.layout == "shared_outer":  # one expand per token, after the routed sum
            return self._down_sum(x, y, route) + delta.to(x.dtype)
        return self._down_sum(x, _add(y, delta, rows), route)

    # the dense path (``Experts._dense``, the compiled decode step's): every adapter slot's deltas, each token's own
    # slot kept by a mask (no sort, gather or data-dependent branch)
    def _dense_gate_up_delta(self, x: torch.Tensor) -> torch.Tensor | float:
        lora = self.lora
        if lora.ctx.token_slots is None:
            return 0.0
        pick = lora.ctx.pick(lora.gate_up_B.shape[0], lora.scale, lora.gate_up_B.dtype)  # [N, S]
        xd = x.to(lora.gate_up_B.dtype)
        if lora.layout == "shared_outer":  # [S, r, H]: one shrink per token and slot
            xa = torch.einsum("nh,srh->nsr", xd, lora.gate_up_A) * pick[:, :, None]
            return torch.einsum("nsr,seir->nei", xa, lora.gate_up_B).to(x.dtype)
        xa = torch.einsum("nh,serh->nser", xd, lora.gate_up_A) * pick[:, :, None, None]  # [S, E, r, H]
        return torch.einsum("nser,seir->nei", xa, lora.gate_up_B).to(x.dtype)

    def _dense_down_delta(self, h: torch.Tensor) -> torch.Tensor | float:
        lora = self.lora
        if lora.ctx.token_slots is None:
            return 0.0
        pick = lora.ctx.pick(lora.down_A.shape[0], lora.scale, lora.down_A.dtype)
        ha = torch.einsum("nei,seri->nser", h.to(lora.down_A.dtype), lora.down_A) * pick[:, :, None, None]
        if lora.layout == "shared_outer":  # the routed sum in rank space, then one expand per slot
            return torch.einsum("nsr,shr->nh", ha.sum(2), lora.down_B).to(h.dtype)
        return torch.einsum("nser,sehr->nh", ha, lora.down_B).to(h.dtype)

    def _project(self, e: int, which: str, rows: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The reference loop's projection plus the naive LoRA delta: per expert, per adapter slot."""
        out = super()._project(e, which, rows, token)
        lora = self.lora
        if not lora.ctx.active:
            return out
        for s, picked in self._slots(token):
            gu_a, gu_b, dn_a, dn_b = lora.factors(s, e)
            a, b = (gu_a, gu_b) if which == "gate_up" else (dn_a, dn_b)
            d = (rows[picked].to(a.dtype) @ a.T) @ b.T * lora.scale[s]
            out = out.index_add(0, picked, d.to(out.dtype))
        return out

    def _slots(self, token: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(slot, positions among ``token``) of every adapter slot the tokens use."""
        ctx = self.lora.ctx
        if ctx.token_slots is None:
            return [(ctx.single, torch.arange(token.numel(), device=token.device))]
        row_slot = ctx.token_slots[token]
        return [(int(s), (row_slot == s).nonzero().squeeze(1)) for s in row_slot.unique().tolist() if s >= 0]


def _add(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``y`` plus ``delta`` at rows ``rows`` (all rows when None), in y's dtype."""
    return y + delta.to(y.dtype) if rows is None else y.index_add(0, rows, delta.to(y.dtype))


def _streams(generator: torch.Generator | None) -> Callable[[str], torch.Generator]:
    """A random stream for each module path, from one draw of ``generator`` (default: torch's), made at the first
    stream asked for: a model that holds some layers only (a pipeline stage loaded alone) draws their adapters as the
    whole model does."""
    base: list[int] = []

    def stream(path: str) -> torch.Generator:
        if not base:
            base.append(int(torch.randint(2**62, (1,), generator=generator)))
        return torch.Generator().manual_seed((base[0] + zlib.crc32(path.encode())) % 2**63)

    return stream


def _init_A(path: str, stream: Callable[[str], torch.Generator], *tensors: torch.Tensor) -> None:
    # PEFT's default: kaiming-uniform(a=sqrt(5)) on A, i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)); B stays zero
    if tensors[0].is_meta or is_fake(tensors[0]):  # shapes only (a plan's): no values to draw
        return
    generator = stream(path)
    for t in tensors:
        bound = 1 / math.sqrt(t.shape[-1])
        t.copy_(torch.rand(t.shape, generator=generator) * 2 * bound - bound)


def lora_candidates(model: nn.Module) -> list[str]:
    """Names LoRA targets can use: linear layers by leaf name and qualified name, and ``experts``."""
    names = set()
    for path, mod in model.named_modules():
        if isinstance(mod, Linear):
            parts = path.split(".")
            names.add(parts[-1])
            names.add(".".join(parts[-2:]))
        elif isinstance(mod, Experts):
            names.add("experts")
    return sorted(names)


def attach_lora(
    model: nn.Module, cfg: LoraConfig, dtype: torch.dtype | None = None, generator: torch.Generator | None = None
) -> LoraContext:
    """Attach adapters (A random, B zero, every slot) to the modules ``cfg.targets`` names; returns the context.

    A target matches a linear layer whose path ends with it (``gate_proj`` matches dense and shared-expert MLPs,
    ``shared_experts.gate_proj`` only the latter); ``experts`` matches the routed experts.
    """
    from moerl.errors import ConfigError

    mcfg = model.config
    dtype = dtype or torch.float32
    targets = cfg.targets or default_targets(model)
    ctx = LoraContext()
    expert_rank = max(1, cfg.rank // mcfg.top_k) if cfg.expert_rank_norm else cfg.rank
    used, swaps = set(), []
    stream = _streams(generator)
    for path, mod in model.named_modules():
        hit = [t for t in targets if path == t or path.endswith("." + t)]
        if not hit or not isinstance(mod, Linear | Experts):
            continue
        if plain_class(mod) not in (Linear, Experts):  # another mode's class (MXFP8), or adapters attached already
            raise ConfigError(
                f"lora: {path} is a {type(mod).__name__}; adapters attach to a plain model's projections and "
                "experts only (LoRA and MXFP8 are separate modes, and adapters attach once)"
            )
        if isinstance(mod, Linear):
            new = swapped(mod, LoraLinear)
            with torch.device(mod.weight.device):  # made in place, not moved (a plan's fake tensors cannot move)
                new.lora = LinearLora(ctx, cfg.slots, cfg.rank, mod.in_features, mod.out_features, cfg.dropout, dtype)
            new.lora.scale.fill_(cfg.scale(cfg.rank))
            with torch.no_grad():
                _init_A(path, stream, new.lora.lora_A)
        else:
            # every expert's adapters, also where the weights hold one rank's share: the init is the layout's own
            e, (_, rows, h) = mod.num_experts, mod.gate_up_proj.shape
            new = swapped(mod, LoraExperts)
            with torch.device(mod.gate_up_proj.device):
                new.lora = ExpertLora(
                    ctx, cfg.slots, expert_rank, e, h, rows, mod.down_proj.shape[2], cfg.layout, dtype
                )
            new.lora.scale.fill_(cfg.scale(expert_rank))
            with torch.no_grad():
                _init_A(path, stream, new.lora.gate_up_A, new.lora.down_A)
        swaps.append((path, new))
        used.update(hit)
    unmatched = [t for t in targets if t not in used]
    if unmatched:
        raise ConfigError(
            f"lora.targets {unmatched} match no module of this model; candidates: {', '.join(lora_candidates(model))}"
        )
    for path, new in swaps:
        replace_module(model, path, new)
    model.adapter_ctx = ctx  # the model hands each forward's ``adapters`` to it
    return ctx


def lora_modules(model: nn.Module) -> dict[str, LinearLora | ExpertLora]:
    """Module path -> its LoRA weights, for every adapted module."""
    return {p: m.lora for p, m in model.named_modules() if getattr(m, "lora", None) is not None}


@torch.no_grad()
def merged_weights(model: nn.Module, slot: int = 0, dtype: torch.dtype | None = None):
    """The weights adapter ``slot`` touches, merged (W + scale * B @ A, summed in fp32), one module at a time, as
    ``(name, tensor)`` in ``dtype`` (default: the base weight's)."""
    state = state_of(model)
    for path, lora in lora_modules(model).items():
        if isinstance(lora, LinearLora):
            deltas = [("weight", lora.delta_weight(slot))]
        else:
            deltas = list(zip(("gate_up_proj", "down_proj"), lora.delta_weights(slot), strict=True))
        for name, d in deltas:
            w = state[f"{path}.{name}"]
            yield f"{path}.{name}", (w.float() + d.float()).to(dtype or w.dtype)


def merged_state_dict(model: nn.Module, slot: int = 0) -> dict[str, torch.Tensor]:
    """The base state dict with adapter ``slot`` merged into the weights (W + scale * B @ A), no LoRA keys."""
    state = {k: v for k, v in state_of(model).items() if ".lora." not in k}
    return state | dict(merged_weights(model, slot))


def default_targets(model: nn.Module) -> list[str]:
    """Every linear layer (by leaf name) but the router and lm_head, plus the routed experts."""
    return [n for n in lora_candidates(model) if "." not in n]


LINEAR_KEYS = ("lora_A", "lora_B")
EXPERT_KEYS = ("gate_up_A", "gate_up_B", "down_A", "down_B")


@torch.no_grad()
def slot_tensors(model: nn.Module, slot: int = 0) -> dict[str, torch.Tensor]:
    """One adapter slot as moerl-named tensors: ``{module}.lora_A`` [r, in], ``{module}.lora_B`` [out, r],
    ``{experts}.gate_up_A`` ([r, H] shared or [E, r, H]), ``.gate_up_B`` [E, 2I, r], ``.down_A`` [E, r, I],
    ``.down_B`` ([H, r] shared or [E, H, r]), and ``{module}.scale`` (0-d). What the engine loads."""
    out = {}
    for path, lora in lora_modules(model).items():
        keys = LINEAR_KEYS if isinstance(lora, LinearLora) else EXPERT_KEYS
        for key in keys:
            out[f"{path}.{key}"] = getattr(lora, key)[slot].detach().clone()
        out[f"{path}.scale"] = lora.scale[slot].detach().clone()
    return out
