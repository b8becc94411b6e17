"""Paged KV cache: per-layer block pools, the block allocator, and the per-step view attention reads."""

from __future__ import annotations

import torch

from moerl.cpu.kernels import KINDS, kernel, paged_decode, paged_write_decode
from moerl.model.config import ModelConfig
from moerl.model.mixers import keeps_keys, recurrent_layers, state_shapes


def kv_shape(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(kv heads, key dim, value dim) one cached token holds in ``layer`` (MLA caches expanded per-head k/v)."""
    if cfg.attention == "mla":
        return cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    d = cfg.head_size(layer)
    return cfg.kv_heads(layer), d, cfg.v_head_dim or d


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    attention = [i for i, t in enumerate(cfg.layer_types) if keeps_keys(t)]  # recurrent layers keep a state
    kv = sum(heads * (dk + dv) for heads, dk, dv in (kv_shape(cfg, i) for i in attention))
    indexed = len(attention) - len(cfg.index_shared_layers) if cfg.index_head_dim else 0  # indexer keys
    return block_size * (kv + indexed * cfg.index_head_dim) * dtype.itemsize


class LinearStates:
    """Per-sequence slots of the recurrent layers' states (Gated DeltaNet, Mamba: ``moerl.model.mixers``), beside the
    paged cache: per such layer the conv input window [slots, C, K-1] (model dtype) and the recurrent state
    [slots, ...] (fp32), shaped by the layer's mixer. A sequence takes a slot when admitted (zeroed) and gives it back
    when it ends; the n samples of a prompt copy its slot."""

    def __init__(self, cfg: ModelConfig, slots: int, dtype: torch.dtype, device):
        shapes = {i: state_shapes(cfg, i) for i in recurrent_layers(cfg)}
        self.conv = {i: torch.zeros(slots, *conv, dtype=dtype, device=device) for i, (conv, _) in shapes.items()}
        self.state = {i: torch.zeros(slots, *state, device=device) for i, (_, state) in shapes.items()}
        self.pools = [*self.conv.values(), *self.state.values()]
        self.free = list(range(slots - 1, -1, -1))
        self.nbytes = sum(t.numel() * t.element_size() for t in self.pools)

    def take(self) -> int:
        slot = self.free.pop()
        for t in self.pools:
            t[slot].zero_()
        return slot

    def give(self, slot: int) -> None:
        if slot >= 0:
            self.free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        for t in self.pools:
            t[dst].copy_(t[src])


class BlockAllocator:
    """Free list of cache blocks with reference counts (the n samples of a prompt share its full blocks)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free), "block allocation beyond what the scheduler admitted"
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> list[int]:
        """Drop one reference to each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
                freed.append(b)
        return freed


class KVCache:
    """Preallocated key/value pools, head-major: per layer ``[heads, num_blocks * block_size, dim]``.

    Token slot ``block * block_size + offset`` of a head is one row; head-major keeps the rows a sequence's
    attention reads contiguous per head, so one ``index_select`` gathers them in the layout the matmul wants.
    """

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu", scratch=False
    ):
        shapes = [kv_shape(cfg, i) for i in range(cfg.num_layers)]
        self.block_size, self.num_blocks = block_size, num_blocks
        # ``scratch``: one more block, never allocated, that the padding rows of a compiled decode step write to
        self.scratch_block = num_blocks if scratch else None
        n = (num_blocks + scratch) * block_size
        # recurrent layers and those without a mixer keep no keys: an empty pool holds their place (states:
        # LinearStates)
        rows = [n if keeps_keys(t) else 0 for t in cfg.layer_types]
        self.k = [torch.zeros(h, r, dk, dtype=dtype, device=device) for r, (h, dk, _) in zip(rows, shapes, strict=True)]
        self.v = [torch.zeros(h, r, dv, dtype=dtype, device=device) for r, (h, _, dv) in zip(rows, shapes, strict=True)]
        self.states: LinearStates | None = None  # set by the engine for a model with recurrent layers
        # DeepSeek sparse attention: one indexer key a token per layer ([1, rows, d]: a single head), paged as k / v
        d = cfg.index_head_dim
        shared = set(cfg.index_shared_layers)  # layers that keep an earlier layer's choice: no indexer keys
        self.index = [
            torch.zeros(1, r if d and i not in shared else 0, d, dtype=dtype, device=device) for i, r in enumerate(rows)
        ]
        self._index_shapes = [t.shape for t in self.index]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.k + self.v + self.index)
        self._k_shapes, self._v_shapes = [t.shape for t in self.k], [t.shape for t in self.v]
        self.dtype, self.device = dtype, device
        # decode reads the pools in place where the paged kernel runs (``StepView.attend``): known once, here, not
        # asked again in each step's view (a compiled step makes its view inside the graph)
        self.paged = dtype in KINDS and torch.device(device).type == "cpu" and kernel() is not None
        self.sliding_window = cfg.sliding_window
        self.attention_chunk = cfg.attention_chunk
        self.rows = n  # every attention pool's [heads, rows, d] (its heads: the layer's own)
        self.attention = [i for i, t in enumerate(cfg.layer_types) if keeps_keys(t)]
        self.released = False
        self._gathered: list[torch.Tensor | None] = [None, None]  # gather_buffer's key and value buffers

    def gather_buffer(self, which: int, rows: int, blocks: torch.Tensor) -> torch.Tensor:
        """A [rows, block width] buffer for a step's key (``which`` 0) or value (1) gather from ``blocks`` (a pool
        seen as [H * blocks, block_size * d]), kept across layers and steps: an eager decode step reads what it
        gathered before the next layer gathers again. Grows to the largest gather seen."""
        buf, n = self._gathered[which], rows * blocks.shape[1]
        if buf is None or buf.numel() < n or buf.dtype != blocks.dtype or buf.device != blocks.device:
            buf = self._gathered[which] = blocks.new_empty(n)
        return buf[:n].view(rows, -1)

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer``'s key, value and indexer-key pools (empty where the layer keeps none)."""
        return self.k[layer], self.v[layer], self.index[layer]

    def pools(self) -> list[torch.Tensor]:
        """Every attention layer's key and value pool (and indexer key pool, where the model has indexers)."""
        indexed = [self.index[i] for i in self.attention if self.index[i].shape[1]]
        return [pool for i in self.attention for pool in (self.k[i], self.v[i])] + indexed

    def release(self) -> None:
        """Give the pools' memory back until ``restore`` (they become empty tensors of the same kind)."""
        self.k = [pool.new_empty(0) for pool in self.k]
        self.v = [pool.new_empty(0) for pool in self.v]
        self.index = [pool.new_empty(0) for pool in self.index]
        self._gathered = [None, None]
        self.released = True

    def restore(self) -> None:
        """The pools again, zeroed (what a fresh cache holds)."""
        if self.released:
            self.released = False
            self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in self._k_shapes]
            self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in self._v_shapes]
            self.index = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in self._index_shapes]

    def zero(self, blocks: list[int]) -> None:
        """Zero these blocks in every pool. Attention weighs the unused slots of a block by 0, and 0 * NaN = NaN:
        blocks a non-finite sequence wrote must not reach the next owner as they are."""
        if not blocks:
            return
        bs = self.block_size
        slots = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).flatten().to(self.device)
        for pool in self.pools():
            pool.index_fill_(1, slots, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Block ``src`` into block ``dst`` for each (src, dst) of ``pairs`` in every pool (prompts' partial last
        blocks to their other samples): one gather and one scatter a pool for them all."""
        if not pairs:
            return
        bs, ar = self.block_size, torch.arange(self.block_size)
        src, dst = (torch.tensor(blocks)[:, None] * bs + ar for blocks in zip(*pairs, strict=True))
        src, dst = src.flatten().to(self.device), dst.flatten().to(self.device)
        for pool in self.pools():
            pool.index_copy_(1, dst, pool.index_select(1, src))


class StepView:
    """The cache as one forward sees it: rows of new tokens, their block tables, positions and lengths.

    ``positions`` [B, C] absolute positions of the new tokens; ``lengths`` [B] real new tokens per row (the
    rest is padding); ``block_tables`` [B, nb]; keys are visible up to each query's own position.
    """

    runs_layers = False  # the model runs its layers (``KVCacheView``)

    def __init__(
        self,
        cache: KVCache,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
        write_rows: torch.Tensor | None = None,
        state_slots: torch.Tensor | None = None,
        graph: bool = False,
        layer_pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        """``write_rows``: the flat [B * C] indices of the real new tokens, when the caller has them (else found
        here: a host sync). ``state_slots`` [B]: each row's slot of the linear-attention states (LinearStates).
        ``graph``: the view a compiled step traces (keys read one by one, see ``update``). ``layer_pools``: the
        key, value and indexer-key pools of the one layer this view serves, whatever layer number it is called with
        (a graph compiled once for every layer takes its layer's pools as inputs, not by a number it would be
        specialised on)."""
        self.cache, self.block_tables, self.layer_pools = cache, block_tables, layer_pools
        self.lengths, self.state_slots = lengths, state_slots
        b, c = positions.shape
        bs = cache.block_size
        real = torch.arange(c, device=lengths.device)[None, :] < lengths[:, None]  # [B, C]
        block = block_tables.gather(1, (positions // bs).clamp(max=block_tables.shape[1] - 1))
        self.slots = torch.where(real, block * bs + positions % bs, -1).reshape(-1)
        self.write = self.slots >= 0
        self.write_rows = write_rows if write_rows is not None else self.write.nonzero().squeeze(1)
        write_slots = self.slots[self.write_rows]
        # by a pool's heads (a model may keep more in its sliding layers): the rows this step's keys go to (``_writes``)
        self._write_at: dict[int, torch.Tensor] = {}
        s = block_tables.shape[1] * bs
        dev = block_tables.device
        self.key_slots: torch.Tensor | None = None
        self.read: dict[int, torch.Tensor] = {}  # by heads, the pools' rows ``update`` gathers (eager: see _reads)
        self.width = bs
        if graph:  # every visible key's row in the pool seen as [H * slots, d], head-major: [H * B * S]
            key_slots = self._visible_slots()
            self.key_slots = key_slots.view(b, s)  # the paged kernel's table in the graph: blocks of one slot
            self.width = 1
        self.b = b
        self.paged = cache.paged  # decode reads the pools in place (``attend``)
        self._q_pos, self._key_pos, self._real = positions[:, :, None], torch.arange(s, device=dev)[None, None, :], real
        # the mask [B, 1, C, S], made on first use: a step the paged kernel attends never needs it (nor ``read``)
        self._base: torch.Tensor | None = self._mask_base() if graph else None
        self.real = real  # [B, C] which new tokens are real (linear-attention layers mask the rest out)
        self._by_kind: dict[str, torch.Tensor] = {}  # ``mask``'s sliding and chunked masks, made on first use
        self._write_slots, self._key_slots = write_slots, s  # update_index's single-head rows (see there)
        self._index_read: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # each row's query position for the paged kernel, made once a step

    def _mask_base(self) -> torch.Tensor:
        """Which keys each new query sees: causal by position; padded queries see key 0 only, so rows stay finite."""
        visible = self._key_pos <= self._q_pos
        return torch.where(self._real[:, :, None], visible, self._key_pos == 0).unsqueeze(1)

    def _reads(self, heads: int) -> torch.Tensor:
        """Every block's row in a pool of ``heads`` heads seen as [H * blocks, bs * d]: a few long copies, not one per
        key. A graph would guard on the blocks per row (S = 16 nb): it reads keys one by one (a pool seen as
        [H * slots, d])."""
        read = self.read.get(heads)
        if read is None and self.key_slots is not None:  # a graph's view: every visible key's row, head-major
            rows = torch.arange(heads, device=self.block_tables.device)[:, None] * self.cache.rows
            read = self.read[heads] = (rows + self.key_slots.reshape(1, -1)).reshape(-1)
        elif read is None:
            blocks = self.cache.rows // self.cache.block_size
            head_base = torch.arange(heads, device=self.block_tables.device)[:, None] * blocks
            read = self.read[heads] = (head_base + self.block_tables.reshape(1, -1)).reshape(-1)
        return read

    def _writes(self, heads: int) -> torch.Tensor:
        """The rows of a pool of ``heads`` heads this step's new keys go to, head-major."""
        at = self._write_at.get(heads)
        if at is None:
            slots, n = self._write_slots, self.cache.rows
            at = self._write_at[heads] = (torch.arange(heads, device=slots.device)[:, None] * n + slots).reshape(-1)
        return at

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The key, value and indexer-key (empty: no indexer) pools ``layer`` reads and writes."""
        return self.layer_pools if self.layer_pools is not None else self.cache.layer_pools(layer)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's real k / v [B, C, H, d] at their slots of the layer's pools."""
        kp, vp, _ = self.pools(layer)
        for pool, new in ((kp, k), (vp, v)):
            h, _, d = pool.shape
            rows = new.reshape(-1, h, d)[self.write_rows].transpose(0, 1).reshape(-1, d)  # [H * n, d]
            pool.view(-1, d).index_copy_(0, self._writes(h), rows)  # dim-0 gathers and scatters are the fast ones

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._write(layer, k, v)
        out = []
        kp, vp, _ = self.pools(layer)
        for which, pool in ((0, kp), (1, vp)):
            h, _, d = pool.shape
            read = self._reads(h)
            src = pool.view(-1, self.width * d)
            if torch.compiler.is_compiling():
                gathered = src.index_select(0, read)
            else:  # into the cache's buffer: the same pages every layer and step, none faulted in again
                gathered = self.cache.gather_buffer(which, read.numel(), src)
                torch.index_select(src, 0, read, out=gathered)
            out.append(gathered.view(h, self.b, -1, d).transpose(0, 1))  # [B, H, S, d], contiguous per head
        return out[0], out[1]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, scale: float, sinks
    ) -> torch.Tensor | None:
        """An fp32 or bf16 CPU decode step's attention read from the pools in place (``moerl.cpu.kernels``'s paged
        kernel, eager or as one op of the compiled step: no gather of the keys and values, no score tensors): store
        k / v [B, 1, Hkv, d], return q [B, 1, Hq, d]'s attention [B, 1, Hq * dv]. None where it does not apply
        (prefill, autograd, another dtype or device, no kernel): the caller takes ``update`` and ``mask``."""
        if not self.paged or q.shape[1] != 1 or q.dtype != self.cache.dtype or torch.is_grad_enabled():
            return None
        if v.shape[-1] != q.shape[-1]:  # the kernel reads values of the keys' size
            return None
        b, _, hq, d = q.shape
        if self._pos is None:  # a padded row reads key 0
            self._pos = torch.where(self._real[:, 0], self._q_pos[:, 0, 0], 0)
        window = self._window(kind)
        pools = (q.reshape(b, hq, d), *self.pools(layer)[:2])
        if self.key_slots is not None:  # the graph's view: its key length symbolic, the blocks per row are not
            self._write(layer, k, v)
            out = paged_decode(*pools, self.key_slots, self._pos, sinks, 1, window, scale)
        else:  # eager: this step's keys and values written by the same call (each row's slot, -1: none)
            new = (k.reshape(b, k.shape[2], -1), v.reshape(b, v.shape[2], -1), self.slots)
            bs = self.cache.block_size
            out = paged_write_decode(*pools, self.block_tables, self._pos, sinks, bs, window, scale, new)
        return out.view(b, 1, -1)

    def _window(self, kind: str) -> int:
        """The paged kernel's key range of a ``kind`` layer: the last ``window`` keys (> 0), the query's chunk of
        ``-window`` positions (< 0), or every key (0)."""
        if kind == "sliding" and self.cache.sliding_window:
            return self.cache.sliding_window
        return -self.cache.attention_chunk if kind == "chunked" else 0

    def _visible_slots(self) -> torch.Tensor:
        """Every visible key's slot, row by row: the block tables' slots in order [B * S]."""
        bs = self.cache.block_size
        return (self.block_tables[:, :, None] * bs + torch.arange(bs, device=self.block_tables.device)).reshape(-1)

    def update_index(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Store this step's indexer keys [B, C, d] (DeepSeek sparse attention) in their single-head pool; return
        every visible key [B, S, d], in the key order ``update`` returns (row = position)."""
        pool = self.pools(layer)[2]
        d = pool.shape[2]
        flat = pool.view(-1, d)
        flat.index_copy_(0, self._write_slots, keys.reshape(-1, d)[self.write_rows])
        if self._index_read is None:
            self._index_read = self._visible_slots()
        return flat.index_select(0, self._index_read).view(self.b, self._key_slots, d)

    def mask(self, kind: str) -> torch.Tensor:
        if self._base is None:
            self._base = self._mask_base()
        window = self._window(kind)  # the paged kernel's key range, as a mask
        if not window:
            return self._base
        if kind not in self._by_kind:
            if window > 0:  # the last ``window`` keys
                near = (self._q_pos - self._key_pos) < window
            else:  # keys from the start of the query's chunk (positions count from 0 in each sequence)
                near = self._key_pos >= torch.div(self._q_pos, -window, rounding_mode="floor") * -window
            self._by_kind[kind] = self._base & torch.where(self._real[:, :, None], near, True).unsqueeze(1)
        return self._by_kind[kind]
