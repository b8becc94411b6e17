"""The compiled decode step (``EngineConfig.compile_decode``): one ``torch.compile`` graph for every decode batch.

A decode step runs hundreds of small ops whose per-op cost, not arithmetic, decides its speed on a small model (CPU)
and whose launches dominate on a GPU. Here the batch is padded to a bucket size (``BUCKETS``, at least 2: a size-1
dimension would be specialised into a graph of its own) and, on CUDA, the block tables to a power of two (each shape
a CUDA graph of its own; a CPU graph's key length is symbolic and the padding would only add keys to gather), so few
shapes reach the graph; its shapes are symbolic (``dynamic=True``, traced without duck sizing: a bucket of 16 rows
once shared a symbol with the cache's 16-token blocks and was compiled again for the next bucket; the pools' and the
kept MX weights' shapes static), so one compilation covers every bucket on the CPU. On CUDA it asks for CUDA graphs
(``mode="reduce-overhead"``, one per bucket): the KV cache pools the graph writes are marked static (mutated inputs
that are not make cudagraph trees skip the graph), and nothing in the graph reads the device on the host (the
grouped GEMM's offsets come from a search on the device). Padding rows decode token 0 at position 0 into the cache's
scratch block, never into a sequence's. Prefill stays eager, and so does any batch larger than ``max_num_seqs``
(which the scheduler never forms).

Inside the graph the routed experts take the dense path (every expert on every token, ``Experts._dense``) where
that is cheap, and on CUDA where the grouped GEMM has no kernel for the dtype (torch's fallback reads offsets on the
host); else the grouped GEMM as one opaque op. MXFP8 engines' experts quantize their operands on either path, as
eager; the weights come quantized from outside the graph, kept between steps and refreshed after a sync
(``moerl.model.mx.weight_quant``), so a step quantizes only its activations. LoRA slots: each row's slot is a tensor
in the graph; every projection computes every slot's shrink in one GEMM and keeps the row's own by a mask
(``LinearLora``, ``LoraExperts``' deltas on the dense path); on the grouped path adapted experts group their rows by
(slot, expert), rows without an adapter weighted 0. Padding rows use no adapter. An fp32 CPU engine's packed
experts (``moerl.model.packed``) run their kernel as one opaque op in the graph, on panels made outside it before
each step (in place after a sync), as the MX weights are.
"""

from __future__ import annotations

import torch

from moerl.dynamo import first_compile, graph_key, price, unducked
from moerl.engine.kv_cache import KVCache, StepView
from moerl.model.grouped import device_kernel
from moerl.model.mx import MXExperts, MXLinear, refresh_kept
from moerl.model.transformer import MoEModel

BUCKETS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # then multiples of 64
# per token, all experts' GEMMs at most this many FLOPs: the dense path beats sort / gather / scatter. Measured
# on the CPU (64 rows, fp32): tiny preset (0.4 MFLOP) 3.4 ms per compiled step dense vs 6.3 grouped; small
# (12.6 MFLOP) 140 ms dense vs 68 grouped
DENSE_MAX_FLOPS_PER_TOKEN = 1e6
# ``compile_decode: auto``: the share of decode time the compiled step saves and what compiling costs, measured
# (BENCHMARKS.md, "Compiled decode"): 1.14-1.19x fp32 decode on tiny / small, 1.16x LoRA, 1.58x MXFP8, 1.66x bf16
# (the lowest, 0.12 saved, taken); 8-23 s to compile with inductor's cache warm, up to 40 s cold on 2 cores (a
# slower host: 20-29 s warm, 60-90 s cold, benchmarks/compile_cost.py). In a LoRA run on tiny
# (benchmarks/compile_decode_run.py) the step saved 15% for 18 s: it paid after 273 steps, where this rule waits for
# 540. COMPILE_SECONDS prices a graph never compiled here; one that was is priced at its last first call
# (moerl.dynamo's ledger)
STEP = "the engine's decode step"  # what the console calls it
GAIN = 0.12
COMPILE_SECONDS = 30.0


def bucket(n: int) -> int:
    """The padded batch size for ``n`` decode rows."""
    for size in BUCKETS:
        if n <= size:
            return size
    return -(-n // 64) * 64


def pays(steps_left: int, decode_seconds_per_step: float, cost: float = COMPILE_SECONDS) -> bool:
    """Whether compiling the decode step now saves more over ``steps_left`` steps, each spending
    ``decode_seconds_per_step`` in decode forwards, than the compilation's ``cost`` (seconds)."""
    return steps_left * GAIN * decode_seconds_per_step >= cost


def decode_price(remembered: float | None) -> tuple[float, str]:
    """(seconds, how known) compiling the decode step costs: ``remembered`` (an engine's ``compile_seconds``) where
    known, else ``COMPILE_SECONDS``."""
    return price(remembered, COMPILE_SECONDS)


def decode_graph_key(model: MoEModel, cache: KVCache, capture: bool) -> str:
    """The decode step's graph identity across runs (``moerl.dynamo.graph_key``): the model, the cache's pools (static
    in the graph: another size is another graph) and whether it captures the routing."""
    return graph_key(STEP, model, capture, [tuple(pool.shape) for pool in cache.pools()])


def dense_experts_pay(model: MoEModel) -> bool:
    """Whether every expert on every token costs fewer FLOPs per token than ``DENSE_MAX_FLOPS_PER_TOKEN``."""
    cfg = model.config
    return 2 * 3 * cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size <= DENSE_MAX_FLOPS_PER_TOKEN


class CompiledDecode:
    """Runs decode steps of ``model`` over ``cache`` through one compiled graph (see the module docstring)."""

    def __init__(self, model: MoEModel, cache: KVCache, capture: bool, setting: bool | str = True):
        if cache.scratch_block is None:
            raise ValueError("CompiledDecode needs a KVCache built with scratch=True")
        device, dtype = model.embed_tokens.weight.device, model.dtype
        # on CUDA the grouped GEMM goes into the graph only where it has its kernel (no host read): bf16 on sm90 /
        # sm100; elsewhere the dense path, which reads every expert as the grouped GEMMs of a decode batch nearly do
        dense = dense_experts_pay(model) or (device.type == "cuda" and not device_kernel(dtype, device))
        for i in model.moe_layer_ids:
            model.layers[i].mlp.experts.dense_in_graph = dense
        self.model, self.cache, self.capture = model, cache, capture
        # the pools the graph writes keep their shapes and addresses (release_cache is refused with compile_decode):
        # marked static, CUDA graphs write them in place (an unmarked mutated input makes cudagraph trees skip the
        # graph), and no pool's size becomes a symbol of its own
        for pool in cache.pools():
            torch._dynamo.mark_static(pool)
            torch._dynamo.mark_static_address(pool)
        cuda = device.type == "cuda"
        # an fp32 CPU graph not from inductor's on-disk cache: the one it hands back runs 0.6x the one it compiles
        # (tiny, 12.3k against 19.4k tokens/s; bf16 the same either way; BENCHMARKS.md, issue 42's fourteenth
        # session), for ~5 s more of the first call
        options = {"fx_graph_cache": False} if not cuda and dtype == torch.float32 else None
        mode = "reduce-overhead" if cuda else None
        self._graph = unducked(torch.compile(self._forward, dynamic=True, mode=mode, options=options))
        self.first, self.setting = True, setting  # the first step compiles the graph (said on the console)
        self.key = decode_graph_key(model, cache, capture)  # what the first step takes is remembered under it

    def _forward(self, ids, positions, view: StepView, adapters) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.model(ids, positions=positions, capture=self.capture, cache=view, adapters=adapters)
        return out.logits[:, 0], out.routed

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, adapters: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step for rows ``ids`` / ``positions`` [B, 1] with block tables [B, nb] (and LoRA slots
        ``adapters`` [B], -1 = none): logits [B, V] and the chosen experts [B, 1, L_moe, k] (None without
        capture)."""
        b, nb = tables.shape
        device = ids.device
        rows, cols = bucket(b) - b, (1 << (nb - 1).bit_length()) - nb if device.type == "cuda" else 0
        if cols:  # extra columns repeat each row's first block: masked, as the eager step pads short tables
            tables = torch.cat([tables, tables[:, :1].expand(b, cols)], dim=1)
        if rows:
            ids = torch.cat([ids, ids.new_zeros(rows, 1)])
            positions = torch.cat([positions, positions.new_zeros(rows, 1)])
            tables = torch.cat([tables, tables.new_full((rows, tables.shape[1]), self.cache.scratch_block)])
            if adapters is not None:
                adapters = torch.cat([adapters, adapters.new_full((rows,), -1)])
        lengths = torch.ones(b + rows, dtype=torch.long, device=device)
        view = StepView(self.cache, tables, positions, lengths, graph=True)
        for t, dim in ((view._base, 3), (view._key_pos, 2), (view.read, 0), (view.key_slots, 1)):  # keys: symbolic
            torch._dynamo.mark_dynamic(t, dim)
        if self.first:  # the modules as the graph is compiled for them (a later swap recompiles it: see below)
            modules = list(self.model.modules())
            self._mx = [m for m in modules if isinstance(m, MXLinear | MXExperts)]
            self._packed = [m for m in modules if hasattr(m, "refresh_packed")]
        # MXFP8 (applied to the engine's model after it is built): the quantized weights the graph reads, made before
        # it first compiles and quantized again (in place) after a sync, outside the graph; the packed experts' and
        # projections' panels (CPU engines) likewise. A module swapped in after the first step has none made: the
        # graph it recompiles for takes torch's ops there
        refresh_kept(self._mx)
        for m in self._packed:
            m.refresh_packed()
        compiling, self.first = self.first, False
        with first_compile(STEP, "rollout.compile_decode", self.setting, compiling, self.key):
            logits, routed = self._graph(ids, positions, view, adapters)
        return logits[:b], routed[:b] if routed is not None else None
