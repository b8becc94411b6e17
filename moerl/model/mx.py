"""MXFP8 emulation: block-32 microscaling with E8M0 scales and E4M3 elements, from torchao's MX primitives,
wired into linear layers and grouped expert GEMMs with autograd.

Every GEMM quantizes both operands along its reduction dimension: the forward ``x @ w.T`` along K, the input
gradient ``g @ w`` along N, the weight gradient ``g.T @ x`` along the tokens (per expert group for the experts,
each group padded with zero rows to a multiple of 32). Casts saturate. A block holding inf or NaN dequantizes to
NaN (the OCP rule: its scale is NaN), so a non-finite value cannot pass through as a large finite one.
Router, embeddings, lm_head and norms are never quantized.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from moerl.model.grouped import Groups, group_mm, group_mm_wgrad
from moerl.model.linear import Linear
from moerl.model.moa import AttentionExperts
from moerl.model.moe import Experts
from moerl.model.swap import plain_class, replace_module, swapped

BLOCK = 32
SCALE_MODES = ("floor", "rceil")
MX_SCALE = ".mx_scale"  # suffix of the E8M0 scales that travel with E4M3 weights in a weight sync


def _mode(mode: str):
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    except ImportError as e:  # e.g. a GPU box with its own torch and no torchao
        from moerl.errors import ConfigError

        raise ConfigError(
            f"MXFP8 (policy.mode=mxfp8) needs torchao 0.18's MX primitives, which do not import here ({e}); "
            "install moerl's dependencies (pip install -e .) or train in lora / full mode"
        ) from None
    if mode not in SCALE_MODES:
        from moerl.errors import ConfigError

        raise ConfigError(f"MX scale mode {mode!r}: allowed: {', '.join(SCALE_MODES)}")
    return ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL


def mx_quantize(x: torch.Tensor, mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 scales [..., K / 32], E4M3 data [..., K]) of ``x`` in blocks of 32 along its last dim (K % 32 == 0)."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    return to_mx(x.contiguous(), torch.float8_e4m3fn, BLOCK, _mode(mode))


def mx_dequantize(scale: torch.Tensor, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from torchao.prototype.mx_formats.mx_tensor import to_dtype

    return to_dtype(data, scale, torch.float8_e4m3fn, BLOCK, dtype)


def mx_fake_quant(x: torch.Tensor, dim: int = -1, mode: str = "rceil") -> torch.Tensor:
    """Quantize to MXFP8 along ``dim`` (zero-padded to a multiple of 32) and back to ``x.dtype``."""
    moved = x.movedim(dim, -1)
    k = moved.shape[-1]
    pad = (-k) % BLOCK
    flat = F.pad(moved, (0, pad)).reshape(-1, k + pad)
    scale, data = mx_quantize(flat, mode)
    out = mx_dequantize(scale, data, x.dtype)
    bad = ~torch.isfinite(flat.view(flat.shape[0], -1, BLOCK)).all(-1, keepdim=True)
    out = out.view(flat.shape[0], -1, BLOCK).masked_fill(bad, float("nan")).view_as(flat)  # no host test per GEMM
    return out.view(*moved.shape[:-1], k + pad)[..., :k].movedim(-1, dim)


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, mode):
        ctx.save_for_backward(x2, w)
        ctx.mode = mode
        return mx_fake_quant(x2, -1, mode) @ mx_fake_quant(w, -1, mode).T

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        m = ctx.mode
        gx = mx_fake_quant(g, -1, m) @ mx_fake_quant(w, 0, m)  # reduce over N
        gw = mx_fake_quant(g, 0, m).T @ mx_fake_quant(x2, 0, m)  # reduce over the tokens
        return gx, gw, None


def mx_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, mode: str, wq: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` with MXFP8 operands in the forward and both backward GEMMs; ``wq``: ``w`` quantized already (a
    forward without autograd, as ``_MXLinear``'s forward computes it)."""
    x2 = x.reshape(-1, x.shape[-1])
    y2 = _MXLinear.apply(x2, w, mode) if wq is None else mx_fake_quant(x2, -1, mode) @ wq.T
    y = y2.view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def _pad_groups(rows: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, Groups]:
    """Rows sorted by group [M, D] -> each group's rows from a multiple of 32 on, zeros up to the next one, in a
    buffer sized from the shapes alone ([M + 31 G rounded up to 32, D]: no host read of the counts), and that
    buffer's groups (its rows past the last group's are zeros, counted in the last group)."""
    n_groups, m = groups.n_groups, rows.shape[0]
    ends = groups.offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    padded_ends = padded.cumsum(0)
    size = -(-(m + (BLOCK - 1) * n_groups) // BLOCK) * BLOCK
    row = torch.arange(m, device=rows.device)
    buf = rows.new_zeros(size, rows.shape[1])
    buf[(padded_ends - padded)[groups.keys] + row - (ends - counts)[groups.keys]] = rows
    keys = torch.searchsorted(padded_ends, torch.arange(size, device=rows.device), right=True)
    return buf, Groups(keys.clamp(max=n_groups - 1), n_groups)


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, groups, mode):
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.mode = groups, mode
        return group_mm(mx_fake_quant(x, -1, mode), mx_fake_quant(w, 1, mode), groups)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        m, groups = ctx.mode, ctx.groups
        gx = group_mm(mx_fake_quant(g.contiguous(), -1, m), mx_fake_quant(w, 2, m).transpose(1, 2), groups)
        # the weight gradient reduces over each group's tokens: quantized along them, a group's blocks its own
        xp, padded = _pad_groups(x, groups)
        gp, _ = _pad_groups(g, groups)
        gw = group_mm_wgrad(mx_fake_quant(xp, 0, m), mx_fake_quant(gp, 0, m), padded)  # [G, K, N]
        return gx, gw, None, None


def mx_group_mm(x: torch.Tensor, w: torch.Tensor, groups, mode: str, wq: torch.Tensor | None = None) -> torch.Tensor:
    """``group_mm`` with MXFP8 operands in the forward and both backward GEMMs; ``wq``: ``w`` quantized already (a
    forward without autograd, as ``_MXGroupedMM``'s forward computes it)."""
    if wq is not None:
        return group_mm(mx_fake_quant(x, -1, mode), wq, groups)
    return _MXGroupedMM.apply(x, w, groups, mode)


def _kept_key(w: torch.Tensor, dim: int, mode: str, tag: str) -> tuple:
    """One kept quantization per weight layout: shape, strides (a transposed view is another), dim, mode, and the
    owner's ``tag`` for the weight where two of its weights can share a layout (JetMoE's q and o experts when
    H == Hkv * d)."""
    return (tuple(w.shape), w.stride(), dim, mode, tag)


def kept_quant(owner: torch.nn.Module, w: torch.Tensor, dim: int, mode: str, tag: str = "") -> torch.Tensor:
    """``mx_fake_quant(w, dim, mode)``, kept on ``owner`` while ``w`` is unchanged. An engine's weights change only
    at a sync (an in-place copy, which bumps the tensor's version counter) but every step quantized them again. One
    entry per weight layout (shape, strides, dim, mode, tag), replaced when the tensor or its version differs."""
    key = _kept_key(w, dim, mode, tag)
    kept = owner.__dict__.setdefault("_mx_kept", {})
    hit = kept.get(key)
    stamp = (w.data_ptr(), w._version)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    q = mx_fake_quant(w, dim, mode)
    if hit is not None:  # into the same tensor: a compiled graph reading it (weight_quant) sees the new values
        q = hit[1].copy_(q)
    else:  # a compiled graph takes it as it takes a parameter: its shape fixed, its address kept (no CUDA graph copy)
        torch._dynamo.mark_static(q)
        torch._dynamo.mark_static_address(q)
    kept[key] = (stamp, q)
    owner.__dict__.setdefault("_mx_graph", {})[key] = q  # never replaced: the graph's guards stay true
    return q


@torch.compiler.substitute_in_graph(kept_quant)
def _kept_quant_in_graph(owner: torch.nn.Module, w: torch.Tensor, dim: int, mode: str, tag: str = "") -> torch.Tensor:
    """``kept_quant`` as a compiled graph traces it, which cannot check a tensor's version: the tensor kept for ``w``,
    an input of the graph that the compiled decode step brings up to date before each step (``refresh_kept``), or
    where none is kept yet ``w`` quantized in the graph."""
    q = owner.__dict__.get("_mx_graph", {}).get(_kept_key(w, dim, mode, tag))
    return mx_fake_quant(w, dim, mode) if q is None else q


def weight_quant(owner: torch.nn.Module, w: torch.Tensor, dim: int, mode: str, tag: str = "") -> torch.Tensor | None:
    """``w`` quantized for a forward without autograd (an engine's, kept: ``kept_quant``), or None with autograd (the
    GEMM's autograd function quantizes). None too where ``owner`` keeps nothing (``apply_mxfp8(keep=False)``: a
    trainer's, quantized at every forward)."""
    if torch.is_grad_enabled() or not owner.keeps:
        return None
    return kept_quant(owner, w, dim, mode, tag)


def refresh_kept(modules: Iterable[torch.nn.Module], dense: frozenset[int] = frozenset()) -> None:
    """Bring every quantized weight a compiled forward reads (``weight_quant``) of the keeping MXFP8 ``modules`` among
    those given up to date with its weight (``kept_quant``: nothing when unchanged, an in-place update after a sync).
    ``dense``: the ids of the experts the graph runs on their dense path (``Experts._dense``)."""
    for m in modules:
        if isinstance(m, MXLinear | MXExperts | MXAttentionExperts) and m.keeps:
            for w, dim, *tag in m.graph_weights(id(m) in dense):
                kept_quant(m, w, dim, m.mode, *tag)


class MXLinear(Linear):
    """A projection whose GEMMs (forward and both backward) take MXFP8 operands; ``mode``: the scale mode."""

    mode: str
    keeps = False  # quantized weights kept between forwards (an engine's: apply_mxfp8(keep=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wq = weight_quant(self, self.weight, -1, self.mode)  # an engine's: once per weight version
        return mx_linear(x, self.weight, self.bias, self.mode, wq)

    def graph_weights(self, dense: bool = False) -> list[tuple[torch.Tensor, int]]:
        """The (weight, reduction dim) pairs a compiled forward quantizes."""
        return [(self.weight, -1)]


class MXExperts(Experts):
    """Routed experts whose grouped GEMMs (and the reference loop's) take MXFP8 operands."""

    mode: str
    keeps = False  # as MXLinear's

    def _gmm(self, x: torch.Tensor, w: torch.Tensor, groups) -> torch.Tensor:
        wq = weight_quant(self, w, 1, self.mode)  # an engine's: once per weight version
        return mx_group_mm(x, w, groups, self.mode, wq)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return mx_linear(x, w, bias, self.mode)

    def _operand(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if t is self.gate_up_proj or t is self.down_proj:
            wq = weight_quant(self, t, dim, self.mode)
            if wq is not None:
                return wq
        return mx_fake_quant(t, dim, self.mode)

    def graph_weights(self, dense: bool = False) -> list[tuple[torch.Tensor, int]]:
        """The (weight, reduction dim) pairs a compiled forward quantizes: the dense path's (``dense``) or the grouped
        one's."""
        if dense:
            return [(self.gate_up_proj, 2), (self.down_proj, 2)]
        return [(self.gate_up_proj.transpose(1, 2), 1), (self.down_proj.transpose(1, 2), 1)]


class MXAttentionExperts(AttentionExperts):
    """JetMoE's attention experts whose grouped GEMMs take MXFP8 operands (their q and o weights kept apart: a tag
    each, their layouts can be equal)."""

    mode: str
    keeps = False  # as MXLinear's

    def queries(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        w = self.q_proj.transpose(1, 2)
        return mx_group_mm(x, w, groups, self.mode, weight_quant(self, w, 1, self.mode, "q"))

    def outputs(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        w = self.o_proj.transpose(1, 2)
        return mx_group_mm(x, w, groups, self.mode, weight_quant(self, w, 1, self.mode, "o"))

    def graph_weights(self, dense: bool = False) -> list[tuple[torch.Tensor, int, str]]:
        """The (weight, reduction dim, tag) triples a compiled forward quantizes."""
        return [(self.q_proj.transpose(1, 2), 1, "q"), (self.o_proj.transpose(1, 2), 1, "o")]


def apply_mxfp8(model: torch.nn.Module, mode: str = "rceil", keep: bool = False) -> None:
    """Swap every projection, the routed experts and the attention experts (JetMoE's) of ``model`` for their MXFP8
    classes (not the router, embeddings, lm_head, norms or the shared-expert gate: plain modules no mode touches).
    ``keep``: forwards without autograd quantize each weight once per version of it (``kept_quant``), for an engine,
    whose weights change only by a sync's in-place copy. Not for a trainer: FSDP writes a layer's gathered weights
    into the same storage without bumping their version, so a kept quantization would outlive an optimizer step."""
    _mode(mode)
    swaps = []
    classes = {Linear: MXLinear, Experts: MXExperts, AttentionExperts: MXAttentionExperts}
    for path, mod in model.named_modules():
        if not isinstance(mod, Linear | Experts | AttentionExperts):
            continue
        if plain_class(mod) not in classes:  # another mode's class (LoRA), or MXFP8 applied already
            from moerl.errors import ConfigError

            raise ConfigError(
                f"mxfp8: {path} is a {type(mod).__name__}; MXFP8 applies to a plain model's projections and experts "
                "only (LoRA and MXFP8 are separate modes, and MXFP8 applies once)"
            )
        new = swapped(mod, classes[plain_class(mod)])
        new.mode, new.keeps = mode, keep
        swaps.append((path, new))
    for path, new in swaps:
        replace_module(model, path, new)


def quantized_weight(name: str, model: torch.nn.Module) -> bool:
    """Whether parameter ``name`` of ``model`` is a weight whose GEMMs MXFP8 quantizes (of an MX linear layer or
    MX experts): a weight sync sends it quantized."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(module, MXAttentionExperts):
        return name.endswith(("q_proj", "o_proj"))
    return isinstance(module, MXLinear | MXExperts) and name.endswith(("weight", "gate_up_proj", "down_proj"))
