"""LLMEngine: the native rollout engine (continuous batching over a paged KV cache, on the moerl model)."""

from __future__ import annotations

import os
import sys
from math import ceil
from pathlib import Path

import torch
from tqdm import tqdm

from moerl.engine.adapters import AdapterSlots
from moerl.engine.config import EngineConfig, SamplingParams
from moerl.engine.kv_cache import KVCache, StepView, bytes_per_block
from moerl.engine.sampler import sample, sequence_generator
from moerl.engine.scheduler import Scheduler
from moerl.engine.sequence import Completion, Group, Request, RequestOutput, Sequence
from moerl.errors import CheckpointError, ConfigError, RequestError
from moerl.model.transformer import MoEModel


class LLMEngine:
    """Generates from a MoEModel (or a HF checkpoint directory) with routing capture and multi-adapter LoRA.

    ``generate`` takes requests and returns, per request, its n completions with the sampled-token logprobs, the
    experts each token was routed to and the weight version they were produced under.
    """

    def __init__(
        self,
        model: MoEModel | str | os.PathLike,
        config: EngineConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
        tokenizer=None,
    ):
        self.config = cfg = config or EngineConfig()
        if not isinstance(model, MoEModel):
            from moerl.bridges import load_model

            path = Path(model)
            if tokenizer is None and (path / "tokenizer.json").exists():
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(path)
            model = load_model(path, dtype=dtype)
        self.model, self.tokenizer = model.eval(), tokenizer
        mcfg = model.config
        if cfg.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"EngineConfig.max_model_len={cfg.max_model_len}: exceeds the model's max_position_embeddings="
                f"{mcfg.max_position_embeddings}"
            )
        per_block = bytes_per_block(mcfg, cfg.block_size, model.dtype)
        per_seq = ceil(cfg.max_model_len / cfg.block_size)
        num_blocks = cfg.max_num_seqs * per_seq
        if cfg.kv_cache_bytes is not None:
            num_blocks = min(num_blocks, cfg.kv_cache_bytes // per_block)
            if num_blocks < per_seq:
                raise ConfigError(
                    f"EngineConfig.kv_cache_bytes={cfg.kv_cache_bytes}: one sequence of max_model_len="
                    f"{cfg.max_model_len} tokens needs {per_seq * per_block} bytes of KV cache "
                    f"({per_block} bytes per {cfg.block_size}-token block); raise the budget or lower max_model_len"
                )
        device = model.embed_tokens.weight.device
        self.cache = KVCache(mcfg, num_blocks, cfg.block_size, model.dtype, device)
        self.kv_cache_bytes = self.cache.nbytes
        self.scheduler = Scheduler(cfg, self.cache)
        self.adapters = AdapterSlots(model, cfg) if cfg.max_loras else None
        model.set_expert_path(grouped=cfg.fused_lora)
        self.weight_version = 0
        self._staged: dict[str, torch.Tensor] = {}
        self.generator = torch.Generator().manual_seed(cfg.seed)
        eos = (tokenizer.eos_token_id if tokenizer is not None else None) or (model.hf_config or {}).get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._order = 0

    # -- adapters and weights ------------------------------------------------------------------------------
    def add_adapter(self, name: str, source: str | os.PathLike | dict[str, torch.Tensor]) -> None:
        """Load an adapter from a PEFT directory or from moerl-named tensors into a free slot."""
        if self.adapters is None:
            raise ConfigError("EngineConfig.max_loras=0: this engine has no adapter slots")
        self.adapters.add(name, source)

    def remove_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Check and hold one bucket of named tensors (moerl names) until ``commit_weights``.

        MXFP8 buckets carry ``name`` (E4M3 data) with ``name + MX_SCALE`` (E8M0 scales); they are dequantized here.
        """
        from moerl.model.mx import MX_SCALE, mx_dequantize

        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for name, t in tensors.items():
            if name.endswith(MX_SCALE):
                continue
            if name not in params:
                raise CheckpointError(f"update_weights: unexpected tensor {name!r}: the model has no such parameter")
            if name + MX_SCALE in tensors:
                t = mx_dequantize(tensors[name + MX_SCALE], t, torch.float32)
            if tuple(t.shape) != tuple(params[name].shape):
                raise CheckpointError(
                    f"update_weights: tensor {name!r} has shape {tuple(t.shape)}, the model expects "
                    f"{tuple(params[name].shape)}"
                )
            self._staged[name] = t

    @torch.no_grad()
    def commit_weights(self, version: int) -> None:
        """Apply every staged tensor at once (between generation steps) and tag later outputs with ``version``.

        Tensors are copied into the existing parameters, so the router stays fp32 whatever dtype arrives.
        """
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for name, t in self._staged.items():
            params[name].copy_(t)
        self._staged = {}
        self.weight_version = version

    def discard_staged(self) -> None:
        """Drop what was staged but not committed (start of a new update, or an aborted one)."""
        self._staged = {}

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Replace model tensors by name, all or nothing, and tag later outputs with ``version``."""
        self.discard_staged()
        self.stage_weights(tensors)
        self.commit_weights(version)

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load (or replace) adapter ``name`` and tag later outputs with ``version`` (LoRA weight sync)."""
        self.add_adapter(name, tensors)
        self.weight_version = version

    # -- generation ----------------------------------------------------------------------------------------
    def _group(self, i: int, req: Request) -> Group | RequestOutput:
        prompt = req.prompt
        rid = req.request_id or str(self._order + i)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"request {rid}: a text prompt needs a tokenizer (pass token ids or a tokenizer)")
            prompt = self.tokenizer(prompt)["input_ids"]
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError(f"request {rid}: empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {rid}: prompt token {bad[0]} outside the vocabulary [0, {vocab})")
        slot = -1
        if req.adapter is not None:
            if self.adapters is None:
                raise RequestError(f"request {rid}: adapter {req.adapter!r} asked for, but EngineConfig.max_loras=0")
            slot = self.adapters.slot(req.adapter, rid)
        p = req.params
        room = self.config.max_model_len - len(prompt)
        if room < 1:
            error = (
                f"prompt of {len(prompt)} tokens does not fit the context window "
                f"(EngineConfig.max_model_len={self.config.max_model_len})"
            )
            return RequestOutput(rid, prompt, [], self.weight_version, error=error)
        group = Group(
            self._order + i, rid, prompt, p, slot, min(p.max_tokens, room), weight_version=self.weight_version
        )
        group.seqs = [Sequence(group, j, list(prompt), generator=sequence_generator(p.seed, j)) for j in range(p.n)]
        why = self.scheduler.fits(group)
        if why is not None:
            return RequestOutput(rid, prompt, [], self.weight_version, error=f"request {rid}: {why}")
        return group

    @torch.inference_mode()
    def generate(
        self, requests: list[Request | str | list[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run every request to completion; outputs come back in request order.

        Bad requests (empty prompt, unknown adapter, token outside the vocabulary) raise before anything runs; a
        prompt that does not fit the context window fails alone, with ``error`` set on its output.
        """
        reqs = [r if isinstance(r, Request) else Request(r, params or SamplingParams()) for r in requests]
        items = [self._group(i, r) for i, r in enumerate(reqs)]  # validates all before any runs
        self._order += len(reqs)
        groups = [g for g in items if isinstance(g, Group)]
        for g in groups:
            self.scheduler.add(g)
        total = sum(g.params.n * g.max_tokens for g in groups)
        show = self.config.progress
        if show is None:
            show = total >= 4096 and sys.stderr.isatty()
        with tqdm(total=total, unit="tok", disable=not show, desc="generate") as bar:
            while self.scheduler.has_work():
                bar.update(self._step())
        return [item if isinstance(item, RequestOutput) else self._output(item) for item in items]

    def _step(self) -> int:
        kind, batch = self.scheduler.next_batch()
        bs = self.cache.block_size
        c = max(n for _, n in batch)
        nb = max(ceil((s.num_cached + n) / bs) for s, n in batch)
        device = self.model.embed_tokens.weight.device
        ids = torch.tensor([s.tokens[s.num_cached : s.num_cached + n] + [0] * (c - n) for s, n in batch])
        starts = torch.tensor([s.num_cached for s, _ in batch])
        positions = starts[:, None] + torch.arange(c)[None, :]
        tables = torch.tensor([s.block_table[:nb] + [0] * (nb - len(s.block_table[:nb])) for s, _ in batch])
        lengths = torch.tensor([n for _, n in batch])
        ids, positions, tables, lengths = (t.to(device) for t in (ids, positions, tables, lengths))
        view = StepView(self.cache, tables, positions, lengths)
        adapters = None
        if self.adapters is not None:
            adapters = torch.tensor([s.group.adapter_slot for s, _ in batch], device=device)
        out = self.model(
            ids,
            positions=positions,
            capture=self.config.capture_routing,
            adapters=adapters,
            cache=view,
            logits_index=lengths - 1,
        )
        routed = (
            out.routed.to(torch.uint8 if self.model.config.num_experts <= 256 else torch.int16).cpu()
            if out.routed is not None
            else None
        )
        to_sample: list[tuple[Sequence, int]] = []
        for r, (s, n) in enumerate(batch):
            s.num_cached += n
            if kind == "prefill":
                if routed is not None:
                    s.group.prompt_routed.append(routed[r, :n])
                if s.num_cached == len(s.group.prompt):
                    self.scheduler.prompt_done(s.group)
                    to_sample += [(seq, r) for seq in s.group.seqs]
            else:
                if routed is not None:
                    s.routed.append(routed[r, 0])
                to_sample.append((s, r))
        if not to_sample:
            return 0
        seqs = [s for s, _ in to_sample]
        tokens, logprobs = sample(
            out.logits[[r for _, r in to_sample]].cpu(),
            [s.group.params for s in seqs],
            [s.generator for s in seqs],
            [s.num_generated for s in seqs],
            min(self.eos_ids) if self.eos_ids else None,
            self.generator,
        )
        for s, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            reason = self._stop_reason(s, tok)
            if reason is not None:
                self.scheduler.finish(s, reason)
        return len(seqs)

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
        if s.num_generated >= s.group.max_tokens:
            return "length"
        return None

    def _output(self, g: Group) -> RequestOutput:
        prompt_routed = torch.cat(g.prompt_routed) if g.prompt_routed else None
        outs = []
        for s in g.seqs:
            generated = s.tokens[len(g.prompt) :]
            routed = None
            if prompt_routed is not None:
                routed = torch.cat([prompt_routed, torch.stack(s.routed)]) if s.routed else prompt_routed
            text = s.text
            if text is None:
                text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer else ""
            logprobs = torch.tensor(s.logprobs, dtype=torch.float32) if g.params.logprobs else None
            outs.append(Completion(s.index, generated, text, logprobs, s.finish_reason, routed))
        return RequestOutput(g.request_id, g.prompt, outs, g.weight_version)
