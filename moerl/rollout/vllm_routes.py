"""R3 from vLLM: the experts vLLM's MoE layers chose for every token, recorded in its worker process.

Every MoE router of vLLM's model (one per layer, in the fp32-router model classes moerl registers) reports the
logical expert ids its selection call returned (``BaseRouter.set_capture_fn``: after grouped / biased / softmax
top-k, before any load-balancing remap), so the rows are what the layer computed with, whatever its routing rule.

Rows are kept the way vLLM keeps KV: per KV slot (the step's ``slot_mapping`` of a full-attention cache group).
A prompt token served from the prefix cache was not run again, but its slot still holds the rows computed with its
KV; so do the n samples of one prompt, which share its blocks. After the last MoE layer of each step, every request
in the batch logs the rows of the positions it ran (and, at its first step after prefix-cache hits, those of its
cached positions, read through its block table), which outlive its blocks; the driver collects them once
``generate`` returns (``take``).

vLLM's own routed-experts capture lives in its GPU model runner (Triton); this works on every platform whose model
runner is the V1 one (the CPU runner included), eager or compiled (the hook is a custom op); a CUDA graph replays
kernels without it, which ``take``'s callers see as missing rows and refuse.
"""

from __future__ import annotations

import re
from functools import partial

import torch

# vLLM appends 8 random characters to every request id it is given ("7-1a2b3c4d"); n > 1 samples are child
# requests "0_7-1a2b3c4d", "1_7-..."
_SUFFIX = re.compile(r"-[0-9a-zA-Z]{8}$")


def request_key(internal_id: str) -> str:
    """The id a request's rows are filed under: vLLM's internal id without its random suffix ("3" for the one
    sample of request "3", "1_3" for sample 1 of request "3")."""
    return _SUFFIX.sub("", internal_id)


def moe_routers(model: torch.nn.Module) -> list:
    """The model's MoE routers in layer order (each once)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found = {}
    for module in model.modules():
        router = getattr(module, "router", None)
        if isinstance(router, BaseRouter) and id(router) not in found:
            found[id(router)] = (getattr(module, "layer_id", len(found)), router)
    return [r for _, r in sorted(found.values(), key=lambda lr: lr[0])]


def full_attention_group(runner) -> int:
    """The index of a KV cache group that keeps every block of a sequence (full attention): sliding-window groups
    drop the blocks that leave the window, and rows must survive as long as the sequence."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and not isinstance(spec, SlidingWindowSpec):
            if getattr(spec, "sliding_window", None) is None and getattr(spec, "attention_chunk_size", None) is None:
                return g
    raise RuntimeError("moerl R3: this vLLM model has no full-attention KV cache group to keep routing rows in")


RECORDER: RouteRecorder | None = None  # this worker's, once the driver asked for routing (moerl_record_routes)


# The hook is a custom op: vLLM compiles its model (torch.compile) after building it, and a Python call inside the
# routers would be traced away; an opaque op that writes a sink stays in the graph and runs this at every step.
@torch.library.custom_op("moerl::record_routes", mutates_args=("sink",))
def record_routes(topk_ids: torch.Tensor, layer: int, sink: torch.Tensor) -> None:
    if RECORDER is not None:
        RECORDER.capture(layer, topk_ids)


@record_routes.register_fake
def _(topk_ids: torch.Tensor, layer: int, sink: torch.Tensor) -> None:
    return None


def bind(model: torch.nn.Module) -> int:
    """Hook every MoE router of a vLLM model (when it is built, before vLLM compiles it); returns how many."""
    routers = moe_routers(model)
    sink = torch.zeros(1)
    for layer, router in enumerate(routers):
        router.set_capture_fn(partial(record_routes, layer=layer, sink=sink))
    return len(routers)


class RouteRecorder:
    """Records every MoE layer's chosen experts per KV slot and per request, in one vLLM worker."""

    def __init__(self, runner):
        self.runner = runner
        self.routers = moe_routers(runner.get_model())
        if not self.routers:
            raise RuntimeError("moerl R3: the vLLM model has no MoE routers to record")
        self.k = self.routers[0].top_k
        experts = max(r.global_num_experts for r in self.routers)
        self.dtype = torch.uint8 if experts <= 256 else torch.int16  # moerl's layout
        self.table = runner.input_batch.block_table[full_attention_group(runner)]
        self.store: torch.Tensor | None = None  # [slots, L_moe, k], grown to the highest slot seen
        # (request keys, each token's index into them, its position, its rows [tokens, L_moe, k]) per step
        self.log: list[tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.have: dict[str, int] = {}  # request key -> positions recorded
        self.n = 0  # tokens of the step in flight
        if any(r.capture_fn is None for r in self.routers):
            raise RuntimeError("moerl R3: the vLLM model's routers are not hooked (not a moerl fp32-router model)")

    def _begin(self, topk: torch.Tensor) -> None:
        """At the first MoE layer of a step: which slots its tokens write (none for a warm-up or dummy run)."""
        batch = self.runner.input_batch
        self.n = int(self.runner.query_start_loc.np[batch.num_reqs]) if batch.num_reqs else 0
        if self.n == 0 or topk.shape[0] < self.n:
            self.n = 0
            return
        self.slots = self.table.slot_mapping.gpu[: self.n].to(device=topk.device, dtype=torch.long)
        top = int(self.slots.max()) + 1
        if self.store is None or self.store.shape[0] < top:
            size = max(top, 2 * self.store.shape[0] if self.store is not None else 4096)
            grown = torch.zeros(size, len(self.routers), self.k, dtype=self.dtype, device=topk.device)
            if self.store is not None:
                grown[: self.store.shape[0]] = self.store
            self.store = grown

    def capture(self, layer: int, topk: torch.Tensor) -> None:
        """One MoE layer's chosen experts for the step's tokens ([tokens, k])."""
        if layer == 0:
            self._begin(topk)
        if self.n == 0:
            return
        self.store[self.slots, layer] = topk[: self.n].to(self.dtype)
        if layer == len(self.routers) - 1:
            self._collect()

    def _collect(self) -> None:
        """After the step's last MoE layer: log its rows with their requests and positions (one gather); a request
        whose first position now lies past what it has (prompt tokens served from the prefix cache) first takes
        those rows from its blocks' slots; positions it already has (recomputed after a preemption) stand."""
        runner, batch = self.runner, self.runner.input_batch
        num = batch.num_reqs
        qsl = torch.as_tensor(runner.query_start_loc.np[: num + 1], dtype=torch.long)
        pos = runner.positions[: self.n].to("cpu", torch.long, copy=True)  # the runner's buffer: the next step's
        counts = qsl[1:] - qsl[:-1]
        firsts, lasts = pos[qsl[:-1].clamp(max=self.n - 1)].tolist(), pos[(qsl[1:] - 1).clamp(min=0)].tolist()
        owner = torch.repeat_interleave(torch.arange(num), counts)
        keys, keep = [], None
        for i, rid in enumerate(batch.req_ids[:num]):
            key = request_key(rid)
            keys.append(key)
            if counts[i] == 0:
                continue
            have = self.have.get(key, 0)
            if firsts[i] > have:
                self._from_slots(key, i, have, firsts[i])
            elif firsts[i] < have:
                keep = (keep if keep is not None else torch.ones(self.n, dtype=torch.bool)) & ~(
                    (owner == i) & (pos < have)
                )
            self.have[key] = max(have, lasts[i] + 1)
        rows = self.store[self.slots].cpu()
        if keep is not None:
            owner, pos, rows = owner[keep], pos[keep], rows[keep]
        self.log.append((keys, owner, pos, rows))

    def _from_slots(self, key: str, i: int, start: int, end: int) -> None:
        """Rows of positions [start, end) of the batch's request ``i``, read from its blocks' slots."""
        size = self.table.block_size
        p = torch.arange(start, end)
        blocks = torch.as_tensor(self.table.block_table.np[i], dtype=torch.long)
        slots = (blocks[p // size] * size + p % size).to(self.store.device)
        self.log.append(([key], torch.zeros(end - start, dtype=torch.long), p, self.store[slots].cpu()))

    def take(self) -> dict[str, list]:
        """Every request's rows so far, forgotten here: key -> [dtype, shape, bytes] (the RPC carries no tensors)."""
        log, self.log, self.have = self.log, [], {}
        if not log:
            return {}
        index: dict[str, int] = {}
        owners = [torch.tensor([index.setdefault(k, len(index)) for k in keys])[owner] for keys, owner, _, _ in log]
        owner, pos, rows = torch.cat(owners), torch.cat([e[2] for e in log]), torch.cat([e[3] for e in log])
        order = torch.argsort(owner * (int(pos.max()) + 1) + pos)
        per_key = torch.bincount(owner, minlength=len(index)).tolist()
        out = {}
        for key, chunk in zip(index, torch.split(rows[order], per_key), strict=True):
            chunk = chunk.contiguous()
            out[key] = [str(chunk.dtype).removeprefix("torch."), list(chunk.shape), chunk.numpy().tobytes()]
        return out
