"""Paged KV cache: per-layer block pools, the block allocator, and the per-step view attention reads."""

from __future__ import annotations

import torch

from moerl.model.config import ModelConfig


def kv_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(kv heads, key dim, value dim) one cached token holds per layer (MLA caches expanded per-head k/v)."""
    if cfg.attention == "mla":
        return cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.num_kv_heads, cfg.head_dim, cfg.head_dim


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    heads, dk, dv = kv_shape(cfg)
    return cfg.num_layers * block_size * heads * (dk + dv) * dtype.itemsize


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

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)


class KVCache:
    """Preallocated key/value pools: per layer ``[num_blocks, block_size, heads, dim]``."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"):
        heads, dk, dv = kv_shape(cfg)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.k = [torch.zeros(num_blocks, block_size, heads, dk, dtype=dtype, device=device) for _ in cfg.layer_types]
        self.v = [torch.zeros(num_blocks, block_size, heads, dv, dtype=dtype, device=device) for _ in cfg.layer_types]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.k + self.v)
        self.sliding_window = cfg.sliding_window

    def copy_block(self, src: int, dst: int) -> None:
        for pool in self.k + self.v:
            pool[dst].copy_(pool[src])


class StepView:
    """The cache as one forward sees it: rows of new tokens, their block tables, positions and lengths.

    ``positions`` [B, C] absolute positions of the new tokens; ``lengths`` [B] real new tokens per row (the
    rest is padding); ``block_tables`` [B, nb]; keys are visible up to each query's own position.
    """

    def __init__(self, cache: KVCache, block_tables: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor):
        self.cache, self.block_tables = cache, block_tables
        b, c = positions.shape
        bs = cache.block_size
        real = torch.arange(c)[None, :] < lengths[:, None]  # [B, C]
        block = block_tables.gather(1, (positions // bs).clamp(max=block_tables.shape[1] - 1))
        self.slots = torch.where(real, block * bs + positions % bs, -1).reshape(-1)
        self.write = self.slots >= 0
        self.write_rows = self.write.nonzero().squeeze(1)
        self.write_slots = self.slots[self.write_rows]
        s = block_tables.shape[1] * bs
        key_pos = torch.arange(s)[None, None, :]
        q_pos = positions[:, :, None]
        visible = key_pos <= q_pos
        # padded queries see key 0 only, so their rows stay finite
        self._base = torch.where(real[:, :, None], visible, key_pos == 0).unsqueeze(1)  # [B, 1, C, S]
        self._q_pos, self._key_pos, self._real = q_pos, key_pos, real
        self._sliding: torch.Tensor | None = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kflat, vflat = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
        kflat.index_copy_(0, self.write_slots, k.reshape(-1, *k.shape[2:])[self.write_rows])
        vflat.index_copy_(0, self.write_slots, v.reshape(-1, *v.shape[2:])[self.write_rows])
        return kc[self.block_tables].flatten(1, 2), vc[self.block_tables].flatten(1, 2)

    def mask(self, sliding: bool) -> torch.Tensor:
        if not sliding or not self.cache.sliding_window:
            return self._base
        if self._sliding is None:
            near = (self._q_pos - self._key_pos) < self.cache.sliding_window
            self._sliding = self._base & torch.where(self._real[:, :, None], near, True).unsqueeze(1)
        return self._sliding
