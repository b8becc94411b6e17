"""Context parallelism (``parallel.cp``), applied from outside the model: the cp ranks of a data rank take the same
rows, and each runs the model on its contiguous part of every row's tokens (a row padded to a multiple of cp).

Everything but attention works token by token, so a rank computes its part as one process would. Attention needs
every earlier key: each attention layer's core (``Attention.core``, ``MLAttention.core``, JetMoE's
``MixtureOfAttention.core``) is swapped for one that
exchanges a part of the tokens for a part of the heads over the cp group (all-to-all, DeepSpeed-Ulysses' scheme),
attends over the whole row for its heads with the whole row's mask (packing, padding, sliding windows, chunks, sinks),
and exchanges back. The all-to-alls are differentiable: the backward sends the gradients back the way the rows came.
R3's replayed experts, positions and per-token adapter slots are split with their tokens.

The logprob head runs on the rank's part: each row predicts the next token (the first token of the next rank's part
for its last row), and the ranks' logprobs are gathered whole, so every cp rank computes the step's loss over whole
rows (per-sequence normalisations included) as one process does. The gather's backward hands each rank the
gradient of its own part only: the ranks' parameter gradients are parts of one gradient, summed by FSDP (which
shards over dp x ep x cp) and, for expert slices, over the dp and cp groups.

Layers that keep a state across a sequence (Gated DeltaNet, Mamba) and DeepSeek sparse attention's indexer (each
query scores every key) are not split: such models are refused by name, as is cp with pipeline stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moerl.model.attention import Attention, MLAttention, attend, build_mask
from moerl.model.moa import MixtureOfAttention
from moerl.parallel.expert import exchange
from moerl.parallel.plan import check_context
from moerl.parallel.world import World


class Masks:
    """The whole rows' attention masks of the last forward, by layer kind (None: plainly causal). Kept after it: a
    block recomputed in the backward (activation checkpointing) reads them again, and the trainer runs each
    micro-batch's backward before the next forward."""

    def __init__(self):
        self.by_kind: dict[str, torch.Tensor | None] = {}


class SplitAttention:
    """An attention layer's core on a cp rank: q / k / v of this rank's tokens in, the attention of those tokens out,
    computed over the whole row for this rank's share of the heads (``attend``'s signature)."""

    def __init__(self, world: World, masks: Masks, kind: str):
        self.group, self.n, self.rank = world.group("cp"), world.cp, world.cp_rank
        self.masks, self.kind = masks, kind

    def __call__(self, q, k, v, mask, scale, sinks=None) -> torch.Tensor:
        hq, hkv = q.shape[1], k.shape[1]
        if hkv % self.n:  # fewer kv heads than ranks: each q head's own kv head travels with it
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        if not self.masks.by_kind:
            raise RuntimeError("a context-parallel attention layer ran outside its ContextSplit's forward")
        q, k, v = (self._to_heads(z) for z in (q, k, v))
        share = hq // self.n
        mine = sinks[self.rank * share : (self.rank + 1) * share] if sinks is not None else None
        out = attend(q, k, v, self.masks.by_kind[self.kind], scale, mine)
        return self._to_tokens(out)

    def _to_heads(self, z: torch.Tensor) -> torch.Tensor:
        """[B, H, c, d] (this rank's tokens, every head) -> [B, H / n, n * c, d] (every token, this rank's heads)."""
        b, h, c, d = z.shape
        parts = z.reshape(b, self.n, h // self.n, c, d).transpose(0, 1).reshape(self.n * b, h // self.n, c, d)
        got = exchange(parts, [b] * self.n, [b] * self.n, self.group)  # rank j's tokens of this rank's heads
        return got.view(self.n, b, h // self.n, c, d).permute(1, 2, 0, 3, 4).reshape(b, h // self.n, self.n * c, d)

    def _to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """[B, n * c, H / n * dv] -> [B, c, H * dv], heads in order (rank j's share is heads j * H / n ...)."""
        b, t, width = out.shape
        c = t // self.n
        parts = out.reshape(b, self.n, c, width).transpose(0, 1).reshape(self.n * b, c, width)
        got = exchange(parts, [b] * self.n, [b] * self.n, self.group)
        return got.view(self.n, b, c, width).permute(1, 2, 0, 3).reshape(b, c, self.n * width)


def _gathered(part: torch.Tensor, group, n: int) -> torch.Tensor:
    """Every rank's ``part`` [B, c, ...] of ``group`` (``n`` ranks), side by side along dim 1."""
    pieces = [torch.empty_like(part) for _ in range(n)]
    dist.all_gather(pieces, part.contiguous(), group=group)
    return torch.cat(pieces, dim=1)


class _Gather(torch.autograd.Function):
    """``_gathered`` whose backward keeps this rank's part of the gradient (each rank computes the same loss of the
    whole: its own part's gradient is the part it owes)."""

    @staticmethod
    def forward(ctx, part, group, n, rank):
        ctx.rank, ctx.c = rank, part.shape[1]
        return _gathered(part, group, n)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c], None, None, None


class ContextSplit:
    """``model``'s trainer forward (``MoEModel.forward`` with a logprob ``head``: ``moerl.trainer.logprobs``) on this
    cp rank's part of every row's tokens; the head's results come back whole on every cp rank. Installs the split
    attention cores on ``model`` (once)."""

    def __init__(self, model: torch.nn.Module, world: World):
        check_context(world.cp, world.pp, model.config)
        self.model, self.world, self.masks = model, world, Masks()
        for module in model.modules():
            split = isinstance(module, (Attention, MLAttention, MixtureOfAttention))
            if split and not isinstance(module.core, SplitAttention):
                module.core = SplitAttention(world, self.masks, module.kind)

    def __call__(self, input_ids, positions=None, attention_mask=None, replay=None, adapters=None, head=None):
        if head is None:
            raise ValueError("a context-parallel forward gives a logprob head's results only: pass head=")
        model, n, r = self.model, self.world.cp, self.world.cp_rank
        b, t = input_ids.shape
        c = -(-t // n)
        pad, whole = c * n - t, c * n
        device = input_ids.device
        if positions is None:
            positions = torch.arange(t, device=device).expand(b, t)
        if pad:  # padding after the last token: hidden by the mask, or after every real key in a causal row
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=device)], 1)
        if replay is not None:
            replay = F.pad(model.check_replay(replay, b, t), (0, 0, 0, 0, 0, pad), value=-1)
        if isinstance(adapters, torch.Tensor) and adapters.ndim == 2:
            adapters = F.pad(adapters, (0, pad), value=int(adapters[0, 0]))[:, r * c : (r + 1) * c]
        mask = F.pad(attention_mask, (0, pad)) if attention_mask is not None else None
        window = model.config.sliding_window
        window = window if window and window < whole else None
        chunk = model.config.attention_chunk
        self.masks.by_kind = {
            "full": None if mask is None else build_mask(mask, b, whole, None, device),
            "sliding": None if mask is None and window is None else build_mask(mask, b, whole, window, device),
            "chunked": build_mask(mask, b, whole, None, device, chunk, positions) if chunk else None,
        }
        mine = slice(r * c, (r + 1) * c)
        out = model(
            F.pad(input_ids, (0, pad))[:, mine],
            positions=positions[:, mine],
            replay=replay[:, mine] if replay is not None else None,
            adapters=adapters,
            head=head.part(r * c, (r + 1) * c),
        )
        lp, ent = out.head
        lp = self._whole(lp)
        ent = self._whole(ent) if ent is not None else None
        out.head = head.from_next(lp[:, :t], ent[:, :t] if ent is not None else None)
        return out

    def check_replay(self, replay: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """The model's ``check_replay`` (the rows' replay checked whole, before it is split)."""
        return self.model.check_replay(replay, b, t)

    def _whole(self, part: torch.Tensor) -> torch.Tensor:
        w = self.world
        if part.requires_grad:
            return _Gather.apply(part, w.group("cp"), w.cp, w.cp_rank)
        return _gathered(part, w.group("cp"), w.cp)
