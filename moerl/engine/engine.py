"""LLMEngine: the native rollout engine (continuous batching over a paged KV cache, on the moerl model)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from math import ceil
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moerl.allocator import reuse_freed_memory
from moerl.device import from_device, host_tensor, to_device
from moerl.dynamo import remembered_seconds
from moerl.engine.adapters import AdapterSlots
from moerl.engine.compiled import CompiledDecode, decode_graph_key, decode_scope
from moerl.engine.config import EngineConfig, SamplingParams, check_context, int_or_none
from moerl.engine.kv_cache import KVCache, LinearStates, StepView, bytes_per_block
from moerl.engine.sampler import sample, sequence_generator
from moerl.engine.scheduler import Scheduler
from moerl.engine.sequence import Completion, Group, Request, RequestOutput, Sequence
from moerl.errors import CheckpointError, ConfigError, RequestError
from moerl.model.mixers import recurrent_layers
from moerl.model.transformer import MoEModel
from moerl.sync.parts import StagedParts, part_name, split_part


class LLMEngine:
    """Generates from a MoEModel (or a HF checkpoint directory) with routing capture and multi-adapter LoRA.

    ``generate`` takes requests and returns, per request, its n completions with the sampled-token logprobs, the
    experts each token was routed to and the weight version they were produced under.
    """

    dense_weights = None  # it takes adapters and MX weights as they are (``InferenceEngine``)

    def __init__(
        self,
        model: MoEModel | str | os.PathLike,
        config: EngineConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
        tokenizer=None,
        device: str | torch.device = "cpu",
    ):
        """``device``: where a model loaded from a checkpoint directory goes (a MoEModel stays on its own)."""
        self.config = cfg = config or EngineConfig()
        reuse_freed_memory()  # CPU: decode steps allocate the same buffers again and again (moerl.allocator)
        if not isinstance(model, MoEModel):
            from moerl.bridges import load_model

            path = Path(model)
            if tokenizer is None and (path / "tokenizer.json").exists():
                from moerl.bridges.checkpoint import load_tokenizer

                tokenizer = load_tokenizer(path)
            model = load_model(path, dtype=dtype, device=device)
            if model.embed_tokens.weight.device.type == "cpu":  # a model of its own: the CPU backend's kernels
                from moerl.cpu import install

                install(model)
        self.model, self.tokenizer = model.eval(), tokenizer
        mcfg = model.config
        recurrent = bool(recurrent_layers(mcfg))
        if recurrent and cfg.compile_decode is True:
            raise ConfigError(
                "EngineConfig.compile_decode with recurrent layers (Gated DeltaNet, Mamba): not built (their decode "
                "steps run eager)"
            )
        check_context(cfg.max_model_len, mcfg)
        device = model.embed_tokens.weight.device
        num_blocks = cache_blocks(cfg, mcfg, model.dtype, device)
        # "auto" may compile later (``compile_decode()``): the padding rows' scratch block is there from the start
        can = cfg.compile_decode is True or (cfg.compile_decode == "auto" and not recurrent and not cfg.release_cache)
        self.cache = KVCache(mcfg, num_blocks, cfg.block_size, model.dtype, device, scratch=can)
        if recurrent:  # a state slot per sequence beside the pages
            self.cache.states = LinearStates(mcfg, cfg.max_num_seqs, model.dtype, device)
        self.kv_cache_bytes = self.cache.nbytes + (self.cache.states.nbytes if self.cache.states else 0)
        if cfg.release_cache:
            self.cache.release()
        self.scheduler = Scheduler(cfg, self.cache)
        self.adapters = AdapterSlots(model, cfg) if cfg.max_loras else None
        model.set_expert_path(grouped=cfg.fused_lora)
        self.compiled: CompiledDecode | None = None
        # an engine's own CPU model: the eager decode step as bound kernel calls where the model is one they run
        # (moerl.cpu.direct); None: the modules always
        self.direct = None
        if model.backend == "cpu":
            from moerl.cpu.direct import DirectDecode

            self.direct = DirectDecode(model, self.cache, cfg.capture_routing)
        if cfg.compile_decode is True:
            self.compile_decode()
        self.weight_version, self.steps = 0, 0
        self.decode_seconds = 0.0  # in decode steps' forwards so far: what compiling them would shorten
        self.decode_tokens = 0  # the rows those steps decoded (compile_decode: auto compares tokens per second)
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_parts = StagedParts()  # row ranges of tensors a sharded trainer sends in parts
        self.generator = torch.Generator().manual_seed(cfg.seed)
        eos = (tokenizer.eos_token_id if tokenizer is not None else None) or (model.hf_config or {}).get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._order = 0

    @property
    def device(self) -> torch.device:
        """Where the model, its KV cache and every step's tensors live."""
        return self.model.embed_tokens.weight.device

    def compile_decode(self, on: bool = True) -> bool:
        """Decode through the compiled step from the next decode on (``EngineConfig.compile_decode="auto"``; the
        run loop calls it once it has measured that compiling pays). Returns whether the compiled step is on: an
        engine whose config is False, or that cannot compile (linear-attention layers, ``release_cache``), stays
        eager. ``on=False``: the eager step again (the loop's trial found the compiled one no faster). Under "auto" an
        engine whose decode steps run as bound kernel calls (``moerl.cpu.direct``) stays eager: its graph would
        run the modules' ops, slower than those calls."""
        if not on or (self.config.compile_decode == "auto" and self.direct is not None and self.direct.runs()):
            self.compiled = None
            return False
        if self.compiled is None and self.cache.scratch_block is not None:
            cfg = self.config
            self.compiled = CompiledDecode(
                self.model, self.cache, cfg.capture_routing, cfg.compile_decode, cfg.compile_scope
            )
        return self.compiled is not None

    @property
    def compile_seconds(self) -> float | None:
        """What the compiled decode step's first call took when this graph last compiled here (None: not known):
        ``compile_decode: auto`` prices compiling it at that (``moerl.dynamo.price``)."""
        if self.cache.scratch_block is None:  # an engine that cannot compile its decode step
            return None
        scope = decode_scope(self.model, self.device, self.config.compile_scope)
        return remembered_seconds(decode_graph_key(self.model, self.cache, self.config.capture_routing, scope))

    # -- adapters and weights ------------------------------------------------------------------------------

    def add_adapter(self, name: str, source: str | os.PathLike | dict[str, torch.Tensor]) -> None:
        """Load an adapter from a PEFT directory or from moerl-named tensors into a free slot."""
        if self.adapters is None:
            raise ConfigError("EngineConfig.max_loras=0: this engine has no adapter slots")
        self.adapters.add(name, source)
        self._weights_changed()

    def remove_adapter(self, name: str) -> None:
        """Free adapter ``name``'s slot; an unknown name is a RequestError listing the loaded ones."""
        if self.adapters is None:
            raise ConfigError(f"remove_adapter({name!r}): EngineConfig.max_loras=0: this engine has no adapter slots")
        self.adapters.remove(name)
        self._weights_changed()

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Check and hold one bucket of named tensors (moerl names) until ``commit_weights``.

        MXFP8 buckets carry ``name`` (E4M3 data) with ``name + MX_SCALE`` (E8M0 scales); they are dequantized here.
        A key ``name@row`` is a part of tensor ``name``: its rows from ``row`` on (``moerl.sync.parts``).
        """
        from moerl.model.mx import MX_SCALE, mx_dequantize

        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for key, t in tensors.items():
            name, start = split_part(key)
            if name.endswith(MX_SCALE):
                continue
            if name not in params:
                raise CheckpointError(f"update_weights: unexpected tensor {key!r}: the model has no such parameter")
            scale = name + MX_SCALE if start is None else part_name(name + MX_SCALE, start)
            if scale in tensors:
                t = mx_dequantize(tensors[scale], t, torch.float32)
            if start is not None:
                self._staged_parts.add(name, start, t, params[name].shape)
            elif tuple(t.shape) != tuple(params[name].shape):
                raise CheckpointError(
                    f"update_weights: tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                    f"{tuple(params[name].shape)}"
                )
            else:
                self._staged[name] = t

    @torch.no_grad()
    def commit_weights(self, version: int) -> None:
        """Apply every staged tensor at once (between generation steps) and tag later outputs with ``version``.

        Tensors are copied into the existing parameters, so the router stays fp32 whatever dtype arrives. Parts must
        cover their tensors' rows once each: else nothing is applied (a CheckpointError names the rows).
        """
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        try:
            self._staged_parts.check({n: params[n].shape for n in self._staged_parts.parts})
        except CheckpointError:
            self.discard_staged()
            raise
        for name, t in self._staged.items():
            params[name].copy_(t)
        self._staged_parts.apply(params)
        self.discard_staged()
        self.weight_version = version
        self._weights_changed()

    def _weights_changed(self) -> None:
        if self.compiled is not None:
            self.compiled.weights_changed()

    def discard_staged(self) -> None:
        """Drop what was staged but not committed (start of a new update, or an aborted one)."""
        self._staged = {}
        self._staged_parts.clear()

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Replace model tensors by name, all or nothing, and tag later outputs with ``version``."""
        self.discard_staged()
        self.stage_weights(tensors)
        self.commit_weights(version)

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load (or replace) adapter ``name`` and tag later outputs with ``version`` (LoRA weight sync)."""
        self.add_adapter(name, tensors)
        self.weight_version = version

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The model's own tensors (parameters or buffers) by moerl name, detached: views, not copies."""
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        return {n: params[n].detach() for n in names}

    def close(self) -> None:
        """Nothing to stop: an engine in this process holds only memory (a vLLM engine stops its processes)."""

    # -- generation ----------------------------------------------------------------------------------------
    def _token_ids(self, prompt, rid: str) -> list[int]:
        """The prompt as a list of ints: text through the tokenizer; a list, tuple, 1-D tensor or array of ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"request {rid}: a text prompt needs a tokenizer (pass token ids or a tokenizer)")
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, torch.Tensor | np.ndarray):
            kind = "tensor" if isinstance(prompt, torch.Tensor) else "array"
            if prompt.ndim != 1:
                raise RequestError(
                    f"request {rid}: prompt {kind} has shape {tuple(prompt.shape)}; token ids must be 1-D"
                )
            if "int" not in str(prompt.dtype):  # float, bool, complex: int() would truncate or coerce silently
                raise RequestError(f"request {rid}: prompt is a {prompt.dtype} {kind}; token ids must be integers")
            return prompt.tolist()
        if not isinstance(prompt, list | tuple):
            raise RequestError(
                f"request {rid}: prompt must be text or a list of token ids, not {type(prompt).__name__}"
            )
        ids = [int_or_none(t) for t in prompt]
        if None in ids:
            j = ids.index(None)
            raise RequestError(f"request {rid}: prompt token {prompt[j]!r} at position {j} is not an integer token id")
        return ids

    def _group(self, i: int, req: Request) -> Group | RequestOutput:
        """Check one request (raising RequestError) and build its group, or a rejected output if it cannot run."""
        rid = req.request_id or str(self._order + i)
        p = req.params
        if not isinstance(p, SamplingParams):
            raise RequestError(f"request {rid}: params must be a SamplingParams, not {type(p).__name__}")
        prompt = self._token_ids(req.prompt, rid)
        if not prompt:  # nothing to start from: it fails alone, as a prompt too long for the context does
            error = f"request {rid}: empty prompt"
            return RequestOutput(rid, prompt, [], self.weight_version, error=error, error_kind="rejected")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {rid}: prompt token {bad[0]} outside the vocabulary [0, {vocab})")
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {rid}: stop token id {bad[0]} outside the vocabulary [0, {vocab})")
        slot = -1
        if req.adapter is not None:
            if not isinstance(req.adapter, str):
                raise RequestError(f"request {rid}: adapter must be a name (str), not {type(req.adapter).__name__}")
            if self.adapters is None:
                raise RequestError(f"request {rid}: adapter {req.adapter!r} asked for, but EngineConfig.max_loras=0")
            slot = self.adapters.slot(req.adapter, f"request {rid}")
        room = self.config.max_model_len - len(prompt)
        if room < 1:
            error = (
                f"request {rid}: prompt of {len(prompt)} tokens does not fit the context window "
                f"(EngineConfig.max_model_len={self.config.max_model_len})"
            )
            return RequestOutput(rid, prompt, [], self.weight_version, error=error, error_kind="rejected")
        group = Group(
            self._order + i,
            rid,
            prompt,
            p,
            slot,
            min(p.max_tokens, room),
            weight_version=self.weight_version,
            adapter=req.adapter,
        )
        group.seqs = [Sequence(group, j, list(prompt), generator=sequence_generator(p.seed, j)) for j in range(p.n)]
        why = self.scheduler.fits(group)
        if why is not None:
            error = f"request {rid}: {why}"
            return RequestOutput(rid, prompt, [], self.weight_version, error=error, error_kind="rejected")
        return group

    @torch.inference_mode()
    def generate(
        self,
        requests: list[Request | str | list[int]],
        params: SamplingParams | None = None,
        on_token: Callable[[int, int, int, str | None], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every request to completion; outputs come back in request order.

        Bad requests (non-integer or out-of-vocabulary token, unknown adapter) raise RequestError before anything
        runs. A request that cannot run here (empty prompt, prompt longer than the context window, more than the
        cache) fails alone, and so does one whose logits turn non-finite: see ``RequestOutput.error``.

        ``on_token(request_index, sample_index, token_id, finish_reason)`` (streaming) is called after every
        sampled token, in the order they are sampled; ``finish_reason`` is None until the sample's last token
        (a sample whose request fails while running gets no last call: its output says "error").

        If anything raises while generating (KeyboardInterrupt, or from ``on_token``, included), this call's
        requests are dropped and their cache blocks freed and zeroed before the exception propagates, so the next
        call runs as on a fresh engine (seeded samples repeat bit for bit).
        """
        reqs = [r if isinstance(r, Request) else Request(r, params or SamplingParams()) for r in requests]
        first = self._order
        items = [self._group(i, r) for i, r in enumerate(reqs)]  # validates all before any runs
        self._order += len(reqs)
        groups = [g for g in items if isinstance(g, Group)]
        total = sum(g.params.n * g.max_tokens for g in groups)
        show = self.config.progress
        if show is None:
            show = total >= 4096 and sys.stderr.isatty()
        hook = None
        if on_token is not None:

            def hook(s: Sequence, token: int, reason: str | None) -> None:
                on_token(s.group.order - first, s.index, token, reason)

        if self.config.release_cache:
            self.cache.restore()
        try:
            for g in groups:
                self.scheduler.add(g)
            with tqdm(total=total, unit="tok", disable=not show, desc="generate") as bar:
                while self.scheduler.has_work():
                    bar.update(self._step(hook))
                    self.steps += 1  # progress an engine process reports while it generates
        except BaseException:
            self.scheduler.abort(groups)
            raise
        finally:
            if self.config.release_cache:
                self._release_cache()
        return [item if isinstance(item, RequestOutput) else self._output(item) for item in items]

    def _release_cache(self) -> None:
        self.cache.release()
        # back to the device, not only to torch's cache: the trainer allocates next
        if torch.device(self.cache.device).type == "cuda":
            torch.cuda.empty_cache()

    def _step(self, hook: Callable[[Sequence, int, str | None], None] | None = None) -> int:
        """One scheduled batch through the model: its inputs, the forward, the next tokens sampled on the device for
        the sequences that have one due, then one copy to the host (tokens, logprobs, each row's logit sum for the
        finite check, the routed experts) that the cache positions, routes and tokens are recorded from; returns how
        many were sampled."""
        kind, batch = self.scheduler.next_batch()
        inputs, adapters = self._prepare(batch)
        t0 = time.perf_counter()
        logits, routed = self._run(kind, inputs, adapters)
        to_sample = self._advance(kind, batch)
        drawn = self._draw(to_sample, logits) if to_sample else (None, None, None, None)
        routed, tokens, logprobs, sums = from_device([routed, *drawn[1:]])  # the step's one wait for the device
        if kind == "decode":  # from the inputs on the device to the results on the host
            self.decode_seconds += time.perf_counter() - t0
            self.decode_tokens += len(batch)
        self._keep_routes(kind, batch, routed)
        return self._take(to_sample, drawn[0], tokens, logprobs, sums, hook) if to_sample else 0

    def _prepare(self, batch: list[tuple[Sequence, int]]) -> tuple[list[torch.Tensor], torch.Tensor | int | None]:
        """The step's inputs on the device (token ids, positions, block tables, lengths, cache rows to write, state
        slots) in one copy (from pinned memory on CUDA, not waiting for the stream), and its adapter slots. The host
        values go through one numpy array (``moerl.device.host_tensor``: ``torch.tensor`` reads a list slower)."""
        seqs = [s for s, _ in batch]
        starts = [s.num_cached for s in seqs]
        b, c, bs = len(seqs), max(n for _, n in batch), self.cache.block_size
        if c == 1:  # a decode step: each row's next token (no chunks to cut or pad)
            nb = max(starts) // bs + 1
            values = [s.tokens[n] for s, n in zip(seqs, starts, strict=True)]
        else:
            nb = max(ceil((n0 + n) / bs) for n0, (_, n) in zip(starts, batch, strict=True))
            values = [t for s, n in batch for t in s.tokens[s.num_cached : s.num_cached + n] + [0] * (c - n)]
        values += starts
        values += [s.state_slot for s in seqs]
        # short tables are padded with their own first block: its unused slots are masked (weight 0), and only a
        # sequence's own blocks are sure to hold finite values (0 * NaN from another's block would be NaN)
        for s in seqs:
            table = s.block_table
            values += table[:nb] if len(table) >= nb else table + table[:1] * (nb - len(table))
        # each input a storage of its own (the compiled step's graph would be traced again for inputs that alias)
        host = np.split(np.array(values, dtype=np.int64), np.cumsum([b * c, b, b]))
        ids, starts_t, state_slots, tables = (torch.from_numpy(a) for a in host)
        ids, tables = ids.view(b, c), tables.view(b, nb)
        if c == 1:
            positions, lengths, write_rows = starts_t[:, None], torch.ones_like(starts_t), torch.arange(b)
        else:
            positions = starts_t[:, None] + torch.arange(c)[None, :]
            lengths = host_tensor([n for _, n in batch])
            write_rows = host_tensor([r * c + i for r, (_, n) in enumerate(batch) for i in range(n)])
        inputs = [ids, positions, tables, lengths, write_rows, state_slots]
        adapters = None
        if self.adapters is not None:
            slots = [s.group.adapter_slot for s in seqs]
            # one slot for the whole batch goes as a number (the single-slot GEMMs), a mix as a tensor; the compiled
            # step takes a tensor always (one graph for every mix)
            if len(set(slots)) == 1 and self.compiled is None:
                adapters = slots[0] if slots[0] >= 0 else None
            else:
                inputs.append(host_tensor(slots))
        inputs = to_device(inputs, self.device)
        return inputs[:6], (inputs[6] if len(inputs) > 6 else adapters)

    def _run(self, kind: str, inputs: list[torch.Tensor], adapters) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of a ``prefill`` or ``decode`` step (a decode through the compiled step where it is on): the
        logits of each row's last place, and the experts its tokens were routed to when captured (on the device)."""
        ids, positions, tables, lengths, write_rows, state_slots = inputs
        if kind == "decode" and self.compiled is not None:
            logits, routed = self.compiled.step(ids, positions, tables, adapters)
        elif (
            kind == "decode"
            and self.direct is not None
            and (bound := self.direct.step(ids, positions, tables, adapters))
        ):
            logits, routed = bound
        else:
            out = self.model(
                ids,
                positions=positions,
                capture=self.config.capture_routing,
                adapters=adapters,
                cache=StepView(self.cache, tables, positions, lengths, write_rows, state_slots),
                logits_index=lengths - 1,
            )
            logits, routed = out.logits, out.routed
        if routed is not None:  # on the device: it reaches the host with the step's tokens
            routed = routed.to(torch.uint8 if self.model.config.num_experts <= 256 else torch.int16)
        return logits, routed

    def _advance(self, kind: str, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Advance each sequence past the tokens the step cached; returns the sequences to sample a token for, with
        their row: every decoding one, and the samples of a prompt now fully cached."""
        if kind == "decode":
            for s, _ in batch:
                s.num_cached += 1
            return [(s, r) for r, (s, _) in enumerate(batch)]
        to_sample: list[tuple[Sequence, int]] = []
        done = []
        for r, (s, n) in enumerate(batch):
            s.num_cached += n
            if s.num_cached == len(s.group.prompt):
                done.append(s.group)
                to_sample += [(seq, r) for seq in s.group.seqs]
        self.scheduler.prompts_done(done)
        return to_sample

    def _keep_routes(self, kind: str, batch: list[tuple[Sequence, int]], routed: torch.Tensor | None) -> None:
        """Keep the experts the step's tokens were routed to (host ``routed`` [B, C, L_moe, k]) with their sequences:
        a decode row's as a numpy view (torch's unbind takes 30 us for 64 rows), a prompt chunk's as a tensor."""
        if routed is None:
            return
        if kind == "decode":
            for (s, _), row in zip(batch, routed[:, 0].numpy(), strict=True):
                s.routed.append(row)
            return
        for r, (s, n) in enumerate(batch):
            s.group.prompt_routed.append(routed[r, :n])

    def _draw(self, to_sample: list[tuple[Sequence, int]], logits: torch.Tensor) -> tuple:
        """A token and its logprob for each of ``to_sample`` from its row of ``logits``, sampled on the device, and
        each row's logit sum (not finite: a non-finite row, or finite ones overflowing it; ``_take`` looks closer):
        (the rows' logits, tokens, logprobs, sums). A non-finite row samples some token that ``_take`` drops."""
        seqs = [s for s, _ in to_sample]
        rows = [r for _, r in to_sample]
        if rows != list(range(len(logits))):
            logits = logits[to_device([torch.tensor(rows)], self.device)[0]]
        tokens, logprobs = sample(
            logits,
            [s.group.params for s in seqs],
            [s.generator for s in seqs],
            [s.num_generated for s in seqs],
            min(self.eos_ids) if self.eos_ids else None,
            self.generator,
        )
        return logits, tokens, logprobs, logits.sum(-1, dtype=torch.float32)

    def _take(
        self,
        to_sample: list[tuple[Sequence, int]],
        logits: torch.Tensor,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        sums: torch.Tensor,
        hook,
    ) -> int:
        """Append the sampled tokens (host) to their sequences; a row with non-finite logits fails its request
        instead. Finished sequences leave the scheduler. Returns how many tokens were taken."""
        seqs = [s for s, _ in to_sample]
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        if not np.isfinite(sums.numpy()).all():  # rare: which rows are not finite, read from the device once more
            finite = logits.isfinite().all(-1).cpu()
            if not bool(finite.all()):
                keep = self._fail_non_finite(seqs, logits, finite)
                seqs, tokens, logprobs = ([x[i] for i in keep] for x in (seqs, tokens, logprobs))
        for s, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            reason = self._stop_reason(s, tok)
            if reason is not None:
                self.scheduler.finish(s, reason)
            if hook is not None:
                hook(s, tok, reason)
        return len(seqs)

    def _fail_non_finite(self, seqs: list[Sequence], logits: torch.Tensor, finite: torch.Tensor) -> list[int]:
        """Fail every request with a non-finite row (all its samples end, their blocks are freed and zeroed);
        return the rows of the other sequences."""
        failed: set[Group] = set()
        for i in (~finite).nonzero().flatten().tolist():
            s, g = seqs[i], seqs[i].group
            if g in failed:
                continue
            failed.add(g)
            what = "nan" if bool(logits[i].isnan().any()) else "inf"
            adapter = f"adapter {g.adapter!r}" if g.adapter is not None else "base model"
            g.error = (
                f"request {g.request_id}: non-finite logits ({what}) at generated token {s.num_generated} of sample "
                f"{s.index} ({adapter}, weight version {g.weight_version})"
            )
            g.error_kind = "non_finite"
            for seq in g.seqs:
                if seq.finish_reason is None:
                    self.scheduler.finish(seq, "error", zero=True)
        return [i for i, s in enumerate(seqs) if s.group not in failed]

    def _stop_reason(self, s: Sequence, token: int) -> str | None:
        p = s.group.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(s.tokens[len(s.group.prompt) :], skip_special_tokens=True)
            hits = [i for i in (text.find(stop) for stop in p.stop) if i >= 0]
            if hits:
                s.text = text[: min(hits)]
                return "stop"
        if s.num_generated >= s.group.max_tokens:  # max_tokens, or less where the context window left less room
            return "length" if s.num_generated >= p.max_tokens else "context"
        return None

    def _output(self, g: Group) -> RequestOutput:
        prompt_routed = torch.cat(g.prompt_routed) if g.prompt_routed else None
        outs = []
        for s in g.seqs:
            generated = s.tokens[len(g.prompt) :]
            routed = None
            if prompt_routed is not None:
                routed = torch.cat([prompt_routed, torch.from_numpy(np.stack(s.routed))]) if s.routed else prompt_routed
                routed = routed[: len(s.tokens) - 1]  # a failed sample ran a token it got no successor for
            text = s.text
            if text is None:
                text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer else ""
            logprobs = torch.tensor(s.logprobs, dtype=torch.float32) if g.params.logprobs else None
            outs.append(Completion(s.index, generated, text, logprobs, s.finish_reason, routed))
        return RequestOutput(g.request_id, g.prompt, outs, g.weight_version, error=g.error, error_kind=g.error_kind)


def cache_blocks(cfg: EngineConfig, mcfg, dtype: torch.dtype, device: torch.device) -> int:
    """How many KV-cache blocks an engine of ``cfg`` allocates for model config ``mcfg``: enough for
    ``max_num_seqs`` sequences of ``max_model_len`` tokens, within ``kv_cache_bytes`` (or, on CUDA, the
    ``kv_cache_memory`` share of what the device has free once the model is on it); a budget that cannot hold one
    sequence is refused by name."""
    per_block = max(1, bytes_per_block(mcfg, cfg.block_size, dtype))
    per_seq = ceil(cfg.max_model_len / cfg.block_size)
    num_blocks = cfg.max_num_seqs * per_seq
    budget, source = cfg.kv_cache_bytes, f"EngineConfig.kv_cache_bytes={cfg.kv_cache_bytes}"
    if budget is None and device.type == "cuda":  # what the device has left once the model is on it
        free = torch.cuda.mem_get_info(device)[0]
        budget = int(free * cfg.kv_cache_memory)
        source = f"EngineConfig.kv_cache_memory={cfg.kv_cache_memory} of {free / 2**30:.2f} GiB free on {device}"
    if budget is not None:
        num_blocks = min(num_blocks, budget // per_block)
        if num_blocks < per_seq:
            raise ConfigError(
                f"{source}: one sequence of max_model_len={cfg.max_model_len} tokens needs "
                f"{per_seq * per_block} bytes of KV cache ({per_block} bytes per {cfg.block_size}-token block); "
                "raise the budget or lower max_model_len"
            )
    return num_blocks
