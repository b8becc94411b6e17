"""What a run is built from: the model it starts from, its rollout engines (set up for the policy's mode), the
generator that drives them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moerl.chat import ChatTemplate
from moerl.device import resolve_device
from moerl.engine import EngineConfig
from moerl.envs import make_env
from moerl.envs.rewards import Scorer, reward_fns
from moerl.envs.user import load_code
from moerl.hub import checkpoint_dir
from moerl.modes import mode_of
from moerl.rollout import make_engine
from moerl.rollout.generator import Generator
from moerl.rollout.prompts import Prompts
from moerl.run_config import RunConfig


def ensure_model(cfg: RunConfig, run_dir: Path, fresh: bool, stopped: Callable[[], str | None] | None = None) -> Path:
    """The checkpoint to start from: ``model.path``; a random model of ``model.arch`` / ``preset`` / ``seed``
    warmed up for ``model.sft_steps`` (from ``model.base_cache``, built there on first use; ``stopped``: a
    scheduler's signal, which stops the warm-up: ``moerl.warmup.warm_up``); or that random model itself in the run
    directory, written by a ``fresh`` run (a resume reuses it, or writes the same one again)."""
    if cfg.model.path is not None:
        return checkpoint_dir(cfg.model.path, cfg.model.revision)
    if cfg.model.sft_steps:  # a warmed-up random model, shared by the runs of this recipe
        from moerl.warmup import warmed_base

        return warmed_base(cfg, make_env(cfg.env.name, **cfg.env.kwargs), stopped=stopped)
    path = run_dir / "base_model"
    if fresh or not (path / "config.json").exists():
        from moerl.presets import init_model

        init_model(cfg.model.arch, cfg.model.preset, path, seed=cfg.model.seed)
    return path


def build_generator(cfg: RunConfig, env, engine) -> Generator:
    """The run's Generator: ``env``'s problems on ``engine``, given the run's config sections it reads: the reward
    functions of ``env.rewards`` (else the environment's own reward) and the chat template of ``env.chat``."""
    seed, held_out, lora = cfg.train.seed, cfg.env.eval_problems, mode_of(cfg.policy.mode).adapter_slot is not None
    e = cfg.env
    fns = reward_fns(e.rewards, load_code)
    scorer = Scorer(env, fns, cfg.algo.reward_timeout_s, tuple(e.reasoning_tags) or None)
    chat = None
    if e.chat.template or hasattr(env, "run_episodes"):  # an agent environment's chats: the server renders them
        where = cfg.model.path or "the model"
        chat = ChatTemplate(engine.tokenizer, e.chat.system, e.chat.kwargs, where=where)
    prompts = Prompts(engine.tokenizer, chat)
    return Generator(
        env, engine, cfg.rollout, cfg.algo, seed=seed, eval_problems=held_out, lora=lora, scorer=scorer, prompts=prompts
    )


def shares_the_trainers_gpu(cfg: RunConfig) -> bool:
    """Whether the rollout engine runs in the trainer's process on the trainer's GPU: then its KV cache holds memory
    only while it generates, and the trainer has it back while it trains (engine and trainer take turns)."""
    r = cfg.rollout
    if r.engine != "native" or r.placement != "inprocess" or r.compile_decode is True or cfg.cluster.backend != "local":
        return False
    trainer = resolve_device(cfg.policy.device, key="policy.device")
    return trainer.type == "cuda" and resolve_device(r.device, key="rollout.device") == trainer


def build_engine(cfg: RunConfig, model_path: Path, engines=None):
    """The rollout engines (``rollout.num_engines``, placed per ``rollout.placement``, or as Ray actors where
    ``engines`` says) on their own copy of the base weights, set up for the policy's mode."""
    mode, lcfg, r = mode_of(cfg.policy.mode), cfg.policy.lora, cfg.rollout
    ecfg = EngineConfig(
        max_num_seqs=r.max_num_seqs,
        max_model_len=r.max_model_len,
        max_loras=0 if mode.adapter_slot is None else 1,
        max_lora_rank=lcfg.rank,
        lora_layout=lcfg.layout,
        lora_targets=lcfg.targets,
        compile_decode=r.compile_decode,
        seed=cfg.train.seed,
        release_cache=shares_the_trainers_gpu(cfg),
    )
    mx = mode.engine_mx(cfg.policy)
    if engines is not None:
        from moerl.rollout.pool import EnginePool
        from moerl.rollout.ray_engine import start_engines
        from moerl.rollout.spec import EngineSpec

        c = cfg.cluster
        spec = EngineSpec(str(model_path), ecfg, r.dtype, r.device, mx_scale_mode=mx, threads=engines.engine_threads)
        spec.kind, spec.vllm_args = r.engine, r.vllm_args
        remote = start_engines(spec, r.num_engines, engines, r.weight_transport, c.engine_restarts, r.engine_timeout_s)
        return EnginePool(spec, "ray", r.num_engines, handles=remote, transport=r.weight_transport)
    threads = r.engine_threads or max(1, torch.get_num_threads() // r.num_engines)
    return make_engine(
        r.engine,
        model_path,
        ecfg,
        placement=r.placement,
        num_engines=r.num_engines,
        dtype=r.dtype,
        device=r.device,
        mx_scale_mode=mx,
        threads=threads if r.placement == "process" else 0,
        vllm_args=r.vllm_args,
        weight_transport=r.weight_transport,
        timeout_s=r.engine_timeout_s,
    )
