"""The routed experts in an engine's decode on a CPU: their GEMMs from prepacked panels of K-major weights (a few rows
a group), and a decode step's whole experts block (sort, gather, both GEMMs, the sum, adapters' deltas) as one call
(``moe_decode``) where the grouped path takes a dozen ops."""

from __future__ import annotations

import torch

from moerl.cpu.binding import Binding
from moerl.cpu.kernels import (
    KINDS,
    LORA_PARTS,
    _panel_view,
    bf16_dot,
    graph_panels,
    kept_call,
    kept_copy,
    kernel,
    moe_buffers,
    moe_decode,
    moe_decode_args,
    moe_lora,
    packed_group_mm,
    packed_group_mm_op,
    packed_weight,
    packs,
    panels_shape,
)
from moerl.model.grouped import Groups, streams_weights
from moerl.model.lora import ExpertLora, LoraExperts
from moerl.model.moe import Experts, Route

# the packed kernel's rows of a group sit in registers against each panel of its weight: past this many a group
# (prefill) reuses each panel enough for MKL's blocked GEMM over the K-major weight to be the faster one
PACKED_MAX_ROWS = 32
# bf16 experts on the bf16 dot products take 16 rows a block against a panel kept in cache: a prefill's experts in one
# call too, up to this many (token, expert) rows (the call's fp32 scratch grows with them)
BF16_DOT_MAX_ROWS = 4096


@torch.no_grad()
def k_major(experts: Experts) -> None:
    """Store the expert weights with their reduction dim outermost ([E, H, 2I] and [E, I, H] in memory; shapes, names
    and values unchanged) where streaming them bounds the GEMM (``streams_weights``): each expert's
    ``w.transpose(1, 2)`` is then contiguous for MKL's GEMM (a prefill streams a contiguous reduction dim faster than
    a strided one), and the panels are packed from it. A weight sync's ``copy_`` writes through."""
    for p in (experts.gate_up_proj, experts.down_proj):
        if streams_weights(p) and p.is_contiguous():
            p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)


class KernelExperts(Experts):
    """``Experts`` whose GEMMs without autograd run from packed panels beside their weights (``has_panels``; made
    again after a sync), eager or as an op of the compiled decode step, and whose decode step (SiLU-gated experts
    without biases or zero experts) is one call; the plain experts' paths with autograd or many rows a group."""

    stands_for = Experts
    has_panels = False

    def lay_out(self) -> None:
        """K-major weights (``k_major``), and whether their panels pack (experts of any size and dtype the kernel
        takes)."""
        k_major(self)
        self.has_panels = packs(self.gate_up_proj.transpose(1, 2), self.gated) and packs(
            self.down_proj.transpose(1, 2), False
        )

    @property
    def plain_silu(self) -> bool:
        """SiLU-gated experts without biases or zero experts: what ``moe_decode`` computes."""
        plain = self.activation == "silu" and self.gated and not self.zero
        return plain and self.gate_up_proj_bias is None and self.down_proj_bias is None

    def _packs(self, rows: torch.Tensor, limit: int | None = None) -> bool:
        """Whether this GEMM runs from the panels: no autograd, CPU rows of a kernel dtype, a few rows a group
        (``limit`` rows at most), eager or in the compiled decode step (its panels made before it:
        ``refresh_panels``)."""
        if not self.has_panels or torch.is_grad_enabled() or rows.device.type != "cpu":
            return False
        if rows.dtype not in KINDS or self.down_proj.dtype not in KINDS:  # cast since: torch's GEMM
            return False
        if torch.compiler.is_compiling():  # decode batches only (max_num_seqs rows at most)
            return graph_panels(self, "down") is not None
        return rows.shape[0] <= (limit or PACKED_MAX_ROWS * self.num_experts)

    def _one_call(self, x: torch.Tensor, idx: torch.Tensor) -> bool:
        """Whether the experts of rows ``x`` run as one call (``moe_decode``), eager or in the compiled step: packed
        SiLU-gated experts without biases or zero experts; bf16 ones on the bf16 dot products for a prefill too."""
        on_bf16_dot = x.dtype == self.down_proj.dtype == torch.bfloat16 and bf16_dot()
        limit = BF16_DOT_MAX_ROWS if on_bf16_dot else PACKED_MAX_ROWS * self.num_experts
        if not self.plain_silu or not self._packs(x, limit):
            return False
        return torch.compiler.is_compiling() or idx.numel() <= limit

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self._one_call(x, idx):
            return self._in_one_call(x, idx, weights)
        return super()._grouped(x, idx, weights)

    def _gate_up_hidden(self, xs: torch.Tensor, route: Route) -> torch.Tensor:
        if self._packs(xs) and self.activation == "silu" and self.gate_up_proj_bias is None:
            # SiLU(gate) * up * the routing weight as each panel's result is stored (the kernel's mode 2), kept in
            # fp32 for the down kernel (which widens bf16 rows first anyway)
            return self._packed_mm(xs, "gate_up", route.by_expert, 2, route.gate.reshape(-1), torch.float32)
        return super()._gate_up_hidden(xs, route)

    def _expert_mm(
        self, x: torch.Tensor, name: str, groups: Groups, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if self._packs(x):
            return self._packed_mm(x, name, groups, int(name == "gate_up" and self.gated), out_dtype=out_dtype)
        return super()._expert_mm(x, name, groups, out_dtype)

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
        if torch.compiler.is_compiling():
            return packed_group_mm_op(x, graph_panels(self, name), groups.keys, groups.n_groups, mode, scale, out_dtype)
        return packed_group_mm(x, self.panels(name), groups.offs, mode, scale, out_dtype)

    def panels(self, name: str) -> torch.Tensor:
        """Weight ``name``'s (gate_up, down) packed panels, up to date with it (``packed_weight``)."""
        return packed_weight(self, name, getattr(self, f"{name}_proj"), name == "gate_up" and self.gated)

    def refresh_panels(self) -> None:
        """Make (or pack again after a sync) the panels a compiled graph reads, outside it."""
        if self.has_panels:
            self.panels("gate_up")
            self.panels("down")

    def _in_one_call(self, x, idx, weights, lora: list[torch.Tensor] | None = None, prepared=None) -> torch.Tensor:
        """``moe_decode`` on this layer's panels (``lora``: an adapter's slots and factors; ``prepared``: their
        checked kernel struct, ``moe_lora``'s)."""
        if torch.compiler.is_compiling():
            gate_up, down = graph_panels(self, "gate_up"), graph_panels(self, "down")
        else:
            gate_up, down = self.panels("gate_up"), self.panels("down")
        return moe_decode(x, idx, weights, gate_up, down, lora, prepared)

    def bound_refusal(self, dtype: torch.dtype) -> str | None:
        """What of these experts a bound decode step of a ``dtype`` model cannot run."""
        if not (self.has_panels and self.grouped and self.plain_silu) or self.down_proj.dtype != dtype:
            return "experts not packed SiLU ones without biases, or in another dtype than the model's"
        return None

    def bind(self, step: Binding, h: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
        """The call of these experts on rows ``h`` routed by ``idx`` / ``gate``, their sum into ``out``."""
        gate_up, down = self.panels("gate_up"), self.panels("down")
        adapters = self._bound_adapters(step)
        work, ints = moe_buffers(step.rows, idx.shape[1], gate_up, down, adapters)
        work, ints = step.buf("work", *work.shape), step.buf("ints", *ints.shape, dtype=ints.dtype)
        step.call(kernel().moerl_moe_decode, moe_decode_args(h, idx, gate, gate_up, down, out, work, ints, adapters))

    def _bound_adapters(self, step: Binding):
        """The adapters' checked kernel struct a bound step's call takes (None: none)."""
        return None


class KernelLoraExperts(LoraExperts, KernelExperts):
    """``LoraExperts`` whose decode step takes the adapters' deltas inside the experts' one call (``moe_decode``'s
    LoRA list); else the plain adapters' grouped GEMMs, around the panels' GEMMs."""

    stands_for = LoraExperts

    def _grouped(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.lora.ctx.active and self._one_call(x, idx):
            return self._in_one_call(x, idx, weights, *self._decode_args(self.lora.ctx.row_slots(x.shape[0])))
        return super()._grouped(x, idx, weights)

    def _one_call(self, x: torch.Tensor, idx: torch.Tensor) -> bool:
        # in a compiled graph: where the adapter's fp32 factors were made before it, as the panels were
        made = not torch.compiler.is_compiling() or graph_panels(self.lora, LORA_PARTS[-1]) is not None
        return made and super()._one_call(x, idx)

    def _decode_args(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """``moe_decode``'s LoRA list and its checked kernel struct, kept while the slots and the factors stay
        (``kept_call``); in a compiled graph the list alone (its op checks it)."""
        lora = self.lora
        if torch.compiler.is_compiling():
            return [slots, *expert_decode_factors(lora)], None
        sources = (lora.scale, lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B)
        return kept_call(self, "_lora_memo", slots, sources, lambda: self.decode_lora(slots))

    def decode_lora(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """``moe_decode``'s LoRA list for rows of ``slots`` [N] int64 and its checked struct, made now."""
        args = [slots.contiguous(), *expert_decode_factors(self.lora)]
        return args, moe_lora(args, self.panels("gate_up"), slots.shape[0])

    def refresh_panels(self) -> None:
        super().refresh_panels()
        if self.has_panels:
            expert_decode_factors(self.lora)

    def _bound_adapters(self, step: Binding):
        if step.adapters is None:
            return None
        made = self.decode_lora(step.adapters)
        step.keep.append(made)
        return made[1]


def expert_decode_factors(lora: ExpertLora) -> list[torch.Tensor]:
    """The fp32 factors of expert adapter slots ``lora`` that ``moe_decode`` takes (``LORA_PARTS`` after the slot:
    scale, gate-up A, gate-up B's panels, down A, down B^T), kept beside the adapter while it is unchanged; in a
    compiled graph the copies made before it (``KernelLoraExperts.refresh_panels``)."""
    if torch.compiler.is_compiling():
        return [graph_panels(lora, name) for name in LORA_PARTS[1:]]
    f32, (s, e, rows, r) = torch.float32, lora.gate_up_B.shape
    return [
        kept_copy(lora, "scale", lora.scale, dtype=f32),
        kept_copy(lora, "gate_up_A", lora.gate_up_A, dtype=f32),
        # B^T of every (slot, expert) as a gate-up weight of K = r, in its panels
        kept_copy(lora, "gate_up_B", lora.gate_up_B, _gate_up_b_view, f32, panels_shape(s * e, r, rows)),
        kept_copy(lora, "down_A", lora.down_A, dtype=f32),
        kept_copy(lora, "down_B^T", lora.down_B, lambda b: b.transpose(-1, -2), f32),
    ]


def _gate_up_b_view(b: torch.Tensor) -> torch.Tensor:
    return _panel_view(b.float().transpose(-1, -2).flatten(0, 1), True)  # fp32 panels: K rows, not K-pairs
