"""The compiled decode step (``EngineConfig.compile_decode``): one ``torch.compile`` graph for every decode batch.

What one graph covers (``EngineConfig.compile_scope``): the whole step ("step", described below), or one decoder
layer that every layer of the model runs ("layer": the layer's pools are its inputs, not looked up by its number,
so 48 layers compile as one). The layer scope is a deep model's (a whole step's graph compiles in time that grows
with its depth) and CUDA's: there the whole step, layers and the eager glue between them, is captured as one CUDA
graph per padded shape (``moerl.engine.cuda_graphs``), a launch a step.

A decode step runs hundreds of small ops whose per-op cost, not arithmetic, decides its speed on a small model (CPU)
and whose launches dominate on a GPU. Here the batch is padded to a bucket size (``BUCKETS``, at least 2: a size-1
dimension would be specialised into a graph of its own) and, on CUDA, the block tables to a power of two (each shape
a CUDA graph of its own; a CPU graph's key length is symbolic and the padding would only add keys to gather), so few
shapes reach the graph; its shapes are symbolic (``dynamic=True``, traced without duck sizing: a bucket of 16 rows
once shared a symbol with the cache's 16-token blocks and was compiled again for the next bucket; the pools' and the
kept MX weights' shapes static), so one compilation covers every bucket on the CPU. On CUDA it asks for CUDA graphs
(``mode="reduce-overhead"``, one per bucket): the KV cache pools the graph writes are marked static (mutated inputs
that are not make cudagraph trees skip the graph), and nothing in the graph reads the device on the host (the
grouped GEMM's offsets come from a search on the device; the step's view of the cache is made inside the graph, where
every row's write row is known). The graph's inputs are the token ids, positions, block tables and adapter slots,
copied into buffers kept per padded shape (``StaticInputs``): each its own tensor, whatever the engine hands over (on
CUDA views of one buffer: inputs that alias in one step and not in the next would be traced twice). Padding rows
decode token 0 at position 0 into the cache's scratch block, never into a sequence's. Prefill stays eager, and so
does any batch larger than ``max_num_seqs`` (which the scheduler never forms).

Inside the graph the routed experts take the dense path (every expert on every token, ``Experts._dense``) where
that is cheap, and on CUDA where the grouped GEMM has no kernel for the dtype (torch's fallback reads offsets on the
host); else the grouped GEMM as one opaque op. MXFP8 engines' experts quantize their operands on either path, as
eager; the weights come quantized from outside the graph, kept between steps and refreshed after a sync
(``moerl.model.mx.weight_quant``), so a step quantizes only its activations. LoRA slots: each row's slot is a tensor
in the graph; every projection computes every slot's shrink in one GEMM and keeps the row's own by a mask
(``LinearLora``, ``LoraExperts``' deltas on the dense path); on the grouped path adapted experts group their rows by
(slot, expert), rows without an adapter weighted 0. Padding rows use no adapter. An fp32 CPU engine's packed
experts (``moerl.cpu.kernels``) run their kernel as one opaque op in the graph, on panels made outside it before
each step (in place after a sync), as the MX weights are.
"""

from __future__ import annotations

import torch

from moerl.dynamo import first_compile, graph_key, price, unducked
from moerl.engine.cuda_graphs import StepGraphs
from moerl.engine.kv_cache import KVCache, StepView
from moerl.errors import ConfigError
from moerl.model.grouped import device_kernel
from moerl.model.moe import MoE
from moerl.model.mx import MXAttentionExperts, MXExperts, MXLinear, refresh_kept
from moerl.model.swap import replace_module, swapped
from moerl.model.transformer import MoEModel

BUCKETS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # then multiples of 64
# per token, all experts' GEMMs at most this many FLOPs: below it every expert on every token costs less than the
# grouped path's sort / gather / scatter
DENSE_MAX_FLOPS_PER_TOKEN = 1e6
# ``compile_scope: auto`` compiles the whole step as one graph up to this many decoder layers; a deeper model one
# graph that every layer runs (a whole step's graph compiles in time that grows with its layers)
STEP_GRAPH_MAX_LAYERS = 8
STEP = "the engine's decode step"  # what the console calls it
# ``compile_decode: auto``: the share of decode time the compiled step saves (the lowest measured, so compiling is never
# promised more than it gives) and what compiling costs where no earlier compile of the graph says; one compiled here
# before is priced at its last first call (moerl.dynamo's ledger)
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


def decode_graph_key(model: MoEModel, cache: KVCache, capture: bool, scope: str = "step") -> str:
    """The decode step's graph identity across runs (``moerl.dynamo.graph_key``): the model, the cache's pools (static
    in the graph: another size is another graph), whether it captures the routing and what one graph covers."""
    return graph_key(STEP, model, capture, [tuple(pool.shape) for pool in cache.pools()], scope)


def decode_scope(model: MoEModel, device: torch.device, setting: str = "auto") -> str:
    """What one compiled graph of the decode step covers (``EngineConfig.compile_scope``): "step" or "layer"."""
    if model.config.index_shared_layers:  # layers hand the keys they chose on: a list each layer's graph would see
        if setting == "layer":  # grow, one graph per length
            raise ConfigError(
                "EngineConfig.compile_scope='layer' with index_shared_layers (indexer layers sharing their choice): "
                "not built; take 'step'"
            )
        return "step"
    if setting != "auto":
        return setting
    return "layer" if device.type == "cuda" or model.config.num_layers > STEP_GRAPH_MAX_LAYERS else "step"


def dense_experts_pay(model: MoEModel) -> bool:
    """Whether every expert on every token costs fewer FLOPs per token than ``DENSE_MAX_FLOPS_PER_TOKEN``."""
    cfg = model.config
    return 2 * 3 * cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size <= DENSE_MAX_FLOPS_PER_TOKEN


class GraphMoE(MoE):
    """``MoE`` whose routed experts, inside the compiled decode step's graph, take their dense path where that pays
    (``dense``: every expert on every token, no sort, gather or scatter: ``Experts._dense``); outside it (the prefill,
    an eager step) the experts' own. Swapped in by ``CompiledDecode``; a mode's later swap of the experts keeps it."""

    stands_for = MoE
    dense = False

    def _get_name(self) -> str:
        return "MoE"  # as the model prints: its decode graph's identity (``decode_graph_key``) the same swapped or not

    def _experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.dense and torch.compiler.is_compiling():
            return self.experts._dense(x, idx, weights)
        return super()._experts(x, idx, weights)


class CompiledDecode:
    """Runs decode steps of ``model`` over ``cache`` through one compiled graph (see the module docstring)."""

    def __init__(self, model: MoEModel, cache: KVCache, capture: bool, setting: bool | str = True, scope: str = "auto"):
        if cache.scratch_block is None:
            raise ValueError("CompiledDecode needs a KVCache built with scratch=True")
        device, dtype = model.embed_tokens.weight.device, model.dtype
        self.scope = decode_scope(model, device, scope)
        # on CUDA the grouped GEMM goes into the graph only where it has its kernel (no host read): bf16 on sm90 /
        # sm100; elsewhere the dense path, which reads every expert as the grouped GEMMs of a decode batch nearly do
        dense = dense_experts_pay(model) or (device.type == "cuda" and not device_kernel(dtype, device))
        for i in model.moe_layer_ids:
            moe = model.layers[i].mlp
            if not isinstance(moe, GraphMoE):
                moe = swapped(moe, GraphMoE)
                replace_module(model, f"layers.{i}.mlp", moe)
            moe.dense = dense
        self.model, self.cache, self.capture = model, cache, capture
        # the pools the graph writes keep their shapes and addresses (release_cache is refused with compile_decode):
        # marked static, CUDA graphs write them in place (an unmarked mutated input makes cudagraph trees skip the
        # graph), and no pool's size becomes a symbol of its own
        self.cuda = cuda = device.type == "cuda"
        for pool in cache.pools():
            torch._dynamo.mark_static(pool)
            if self.scope == "step":
                torch._dynamo.mark_static_address(pool)
        self._static: dict[tuple[int, int, bool], StaticInputs] = {}  # the inputs of each padded shape
        # an fp32 CPU graph not from inductor's on-disk cache: the one it hands back runs slower than the one it
        # compiles, which costs the first call a few seconds more
        options = {"fx_graph_cache": False} if not cuda and dtype == torch.float32 else None
        if self.scope == "step":
            mode = "reduce-overhead" if cuda else None
            self._graph = unducked(torch.compile(self._forward, dynamic=True, mode=mode, options=options))
        else:  # one graph for every layer; on CUDA the whole step (its eager glue too) captured as one CUDA graph
            self._layer_graph = torch.compile(self._layer, dynamic=True, options=options)
            self._graph = StepGraphs(unducked(self._layered)) if cuda else unducked(self._layered)
        self.first, self.setting = True, setting  # the first step compiles the graph (said on the console)
        # what the first step takes is remembered under it
        self.key = decode_graph_key(model, cache, capture, self.scope)

    def weights_changed(self) -> None:
        """Weights or adapters were written: CUDA graphs captured over the step are captured again at their next
        step (the writes are in place, but a tensor made anew would leave a captured graph reading the old one)."""
        if isinstance(self._graph, StepGraphs):
            self._graph.reset()

    def _forward(self, ids, positions, tables, adapters) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The graph: the step's view of the cache (every row writes one key, so its write rows are known: no
        search for them, no host read) and the model's forward over it."""
        rows = torch.arange(ids.shape[0], device=ids.device)
        view = self._view(tables, positions, rows)
        out = self.model(ids, positions=positions, capture=self.capture, cache=view, adapters=adapters)
        return out.logits[:, 0], out.routed

    def _layered(self, ids, positions, tables, adapters) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step with every decoder layer run by the layer graph (``compile_scope="layer"``): the embedding, the
        head and the routes' stacking eager around them."""
        rows = torch.arange(ids.shape[0], device=ids.device)
        layers = LayerSteps(self._layer_graph, self.cache, tables, positions, rows)
        out = self.model(ids, positions=positions, capture=self.capture, cache=layers, adapters=adapters)
        return out.logits[:, 0], out.routed

    def _layer(self, layer, x, cos, sin, replay, passed, tables, positions, rows, k, v, index):
        """The layer graph: ``layer``'s block over its own pools ``k`` / ``v`` / ``index`` (inputs, so every layer
        of one structure runs the same graph) and its own view of the step, made inside (as ``_forward`` makes it)."""
        return layer.block(x, cos, sin, None, replay, self._view(tables, positions, rows, (k, v, index)), passed)

    def _view(self, tables, positions, rows, layer_pools=None) -> StepView:
        """The step's view of the cache as a graph makes it: every row writes one key, at its row (no search for
        the write rows, no host read)."""
        ones = torch.ones_like(rows)
        return StepView(self.cache, tables, positions, ones, write_rows=rows, graph=True, layer_pools=layer_pools)

    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, adapters: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step for rows ``ids`` / ``positions`` [B, 1] with block tables [B, nb] (and LoRA slots
        ``adapters`` [B], -1 = none): logits [B, V] and the chosen experts [B, 1, L_moe, k] (None without
        capture)."""
        b = ids.shape[0]
        inputs = self._inputs(ids, positions, tables, adapters)
        if self.first:  # the modules as the graph is compiled for them (a later swap recompiles it: see below)
            modules = list(self.model.modules())
            self._mx = [m for m in modules if isinstance(m, MXLinear | MXExperts | MXAttentionExperts)]
            self._dense = frozenset(id(m.experts) for m in modules if isinstance(m, GraphMoE) and m.dense)
            self._packed = [m for m in modules if hasattr(m, "refresh_panels")]
        # MXFP8 (applied to the engine's model after it is built): the quantized weights the graph reads, made before
        # it first compiles and quantized again (in place) after a sync, outside the graph; the packed experts' and
        # projections' panels (CPU engines) likewise. A module swapped in after the first step has none made: the
        # graph it recompiles for takes torch's ops there
        refresh_kept(self._mx, self._dense)
        for m in self._packed:
            m.refresh_panels()
        compiling, self.first = self.first, False
        ctx = self.model.adapter_ctx
        if ctx is not None:  # the slots reach the graph as a tensor, whatever their mix this step
            ctx.slots_as_tensor = True
        try:
            with first_compile(STEP, "rollout.compile_decode", self.setting, compiling, self.key):
                logits, routed = self._graph(*inputs)
        finally:
            if ctx is not None:
                ctx.slots_as_tensor = False
        return logits[:b], routed[:b] if routed is not None else None

    def _inputs(self, ids, positions, tables, adapters) -> list[torch.Tensor | None]:
        """The step's inputs copied into the padded buffers of its shape (``StaticInputs``)."""
        b, nb = tables.shape
        # at least 2 columns: a size-1 dimension would be specialised into a graph of its own
        width = max(2, (1 << (nb - 1).bit_length()) if self.cuda else nb)
        key = (bucket(b), width, adapters is not None)
        if key not in self._static:
            self._static[key] = StaticInputs(key[0], width, adapters is not None, self.cache.scratch_block, ids.device)
        return self._static[key].fill(ids, positions, tables, adapters)


class LayerSteps:
    """A decode step's cache as the model's layers see it under ``compile_scope="layer"``: each layer is run by the
    layer graph (``KVCacheView.run_layer``), given the step's tables, positions and write rows and its own pools."""

    runs_layers = True

    def __init__(self, graph, cache: KVCache, tables: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
        self.graph, self.cache, self.tables, self.positions, self.rows = graph, cache, tables, positions, rows

    def run_layer(self, layer, x, cos, sin, replay, passed) -> tuple[torch.Tensor, torch.Tensor | None]:
        pools = self.cache.layer_pools(layer.layer)
        return self.graph(layer, x, cos, sin, replay, passed, self.tables, self.positions, self.rows, *pools)


class StaticInputs:
    """The inputs of the compiled step for one padded shape (rows, table width), each a tensor of its own kept
    across steps. The graph sees the same kind of tensors every step: on CUDA a step's inputs arrive as views of one
    buffer (``moerl.device.to_device``), and a graph traced for inputs that alias (or not) would be traced again
    for the other pattern, each a compilation of its own. Padding rows decode token 0 at position 0 into the cache's
    scratch block, with no adapter; extra columns repeat each row's first block (masked, as the eager step pads short
    tables). Padding rows are written only where a step has fewer real rows than the one before."""

    def __init__(self, rows: int, width: int, adapters: bool, scratch: int, device: torch.device):
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.tables = torch.full((rows, width), scratch, dtype=torch.long, device=device)
        self.adapters = torch.full((rows,), -1, dtype=torch.long, device=device) if adapters else None
        self.scratch, self.real = scratch, 0  # rows the last step filled

    def fill(self, ids, positions, tables, adapters) -> list[torch.Tensor | None]:
        b, nb = tables.shape
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.tables[:b, :nb].copy_(tables)
        if nb < self.tables.shape[1]:
            self.tables[:b, nb:].copy_(tables[:, :1].expand(b, self.tables.shape[1] - nb))
        if self.adapters is not None:
            self.adapters[:b].copy_(adapters)
        if b < self.real:  # rows the last step used that pad this one
            self.ids[b : self.real].zero_()
            self.positions[b : self.real].zero_()
            self.tables[b : self.real].fill_(self.scratch)
            if self.adapters is not None:
                self.adapters[b : self.real].fill_(-1)
        self.real = b
        return [self.ids, self.positions, self.tables, self.adapters]
