"""Continuous batching: admit requests while slots and cache blocks last, prefill in chunks, then decode."""

from __future__ import annotations

from collections import deque
from math import ceil

from moerl.engine.config import EngineConfig
from moerl.engine.kv_cache import BlockAllocator, KVCache
from moerl.engine.sequence import Group, Sequence


class Scheduler:
    """Owns the queues. A group (one request, n samples) is admitted whole: its blocks are allocated up front
    (the prompt's full blocks once, shared by the samples), so a running sequence never waits for memory."""

    def __init__(self, cfg: EngineConfig, cache: KVCache):
        self.cfg, self.cache = cfg, cache
        self.blocks = BlockAllocator(cache.num_blocks)
        self.waiting: deque[Group] = deque()
        self.prefilling: list[Group] = []
        self.running: list[Sequence] = []

    def blocks_needed(self, group: Group) -> int:
        bs = self.cache.block_size
        prompt = len(group.prompt)
        own = ceil((prompt + group.max_tokens - 1) / bs) - prompt // bs  # the last token never enters the cache
        return prompt // bs + group.params.n * own

    def fits(self, group: Group) -> str | None:
        """Why the group can never run here (None when it can)."""
        if group.params.n > self.cfg.max_num_seqs:
            return f"n={group.params.n} samples exceed EngineConfig.max_num_seqs={self.cfg.max_num_seqs}"
        need = self.blocks_needed(group)
        if need > self.cache.num_blocks:
            return f"needs {need} KV cache blocks, the cache has {self.cache.num_blocks}"
        return None

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    @property
    def num_active(self) -> int:
        return len(self.running) + sum(g.params.n for g in self.prefilling)

    def _admit(self) -> None:
        bs = self.cache.block_size
        while self.waiting:
            group = self.waiting[0]
            if self.num_active + group.params.n > self.cfg.max_num_seqs:
                return
            if self.blocks_needed(group) > self.blocks.num_free:
                return
            self.waiting.popleft()
            shared = self.blocks.allocate(len(group.prompt) // bs)
            own = (self.blocks_needed(group) - len(shared)) // group.params.n
            for seq in group.seqs:
                if seq.index > 0:
                    self.blocks.share(shared)
                seq.block_table = shared + self.blocks.allocate(own)
                if self.cache.states is not None:  # admitted within max_num_seqs: a slot is free
                    seq.state_slot = self.cache.states.take()
            self.prefilling.append(group)

    def next_batch(self) -> tuple[str, list[tuple[Sequence, int]]] | None:
        """("prefill", [(parent sequence, chunk length)]) or ("decode", [(sequence, 1)]), or None when idle."""
        self._admit()
        if self.prefilling:
            budget, batch = self.cfg.max_num_batched_tokens, []
            for group in self.prefilling:
                seq = group.seqs[0]
                chunk = min(len(group.prompt) - seq.num_cached, budget)
                if chunk <= 0:
                    break
                batch.append((seq, chunk))
                budget -= chunk
            return "prefill", batch
        if self.running:
            return "decode", [(s, 1) for s in self.running]
        return None

    def prompts_done(self, groups: list[Group]) -> None:
        """The parents have prefilled these prompts: the other samples take each parent's cache (the partial last
        block copied, every group's in one copy a pool)."""
        bs, copies = self.cache.block_size, []
        for group in groups:
            self.prefilling.remove(group)
            parent, prompt = group.seqs[0], len(group.prompt)
            if prompt % bs:
                last = prompt // bs
                copies += [(parent.block_table[last], seq.block_table[last]) for seq in group.seqs[1:]]
            for seq in group.seqs[1:]:
                if self.cache.states is not None:  # the prompt's linear-attention states, exactly
                    self.cache.states.copy(parent.state_slot, seq.state_slot)
                seq.num_cached = prompt
            self.running.extend(group.seqs)
        self.cache.copy_blocks(copies)

    def finish(self, seq: Sequence, reason: str, zero: bool = False) -> None:
        """End a running sequence and release its blocks (``zero``: wipe those that become free, see KVCache.zero)."""
        seq.finish_reason = reason
        freed = self.blocks.release(seq.block_table)
        if zero:
            self.cache.zero(freed)
        seq.block_table = []
        self._give_slot(seq)
        self.running.remove(seq)

    def abort(self, groups: list[Group]) -> None:
        """Drop these groups wherever they are (waiting, prefilling, running) and free and zero all their blocks.

        Used when a generate call is interrupted: the next one then finds the scheduler as a fresh engine would.
        """
        dropped = set(groups)
        self.waiting = deque(g for g in self.waiting if g not in dropped)
        self.prefilling = [g for g in self.prefilling if g not in dropped]
        self.running = [s for s in self.running if s.group not in dropped]
        freed = []
        for group in groups:
            for seq in group.seqs:
                freed += self.blocks.release(seq.block_table)
                seq.block_table = []
                self._give_slot(seq)
                seq.finish_reason = seq.finish_reason or "abort"
        self.cache.zero(freed)  # the fault may have come from non-finite values

    def _give_slot(self, seq: Sequence) -> None:
        if self.cache.states is not None and seq.state_slot >= 0:
            self.cache.states.give(seq.state_slot)
            seq.state_slot = -1

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)
