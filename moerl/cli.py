"""``moerl`` command line: init-model, sft, generate, serve, eval, archs, check-arch, train, config, plot, demo."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from moerl.errors import ConfigError, MoerlError, Preempted
from moerl.precision import DTYPE_NAMES, compute_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cmd_init_model(args) -> None:
    from pathlib import Path

    from moerl.errors import RunDirError
    from moerl.presets import count_params, init_model

    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"init-model: {str(out)!r} exists and is not a directory")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not args.overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise RunDirError(
            f"init-model: {str(out)!r} is not empty ({shown}); pass --overwrite to write the checkpoint over it"
        )
    if present:
        print(f"moerl: --overwrite: writing the checkpoint over {out} (other files there are kept)", file=sys.stderr)
    model = init_model(args.arch, args.preset, args.out_dir, seed=args.seed, dtype=DTYPES[args.dtype])
    print(f"wrote {args.arch} preset {args.preset} ({count_params(model) / 1e6:.2f}M parameters) to {args.out_dir}")


class _Printer:
    """Prints completions in (prompt, sample) order as ``'prompt' -> text  (N tokens, reason)``.

    Fed token by token (``--stream``), the first unfinished completion is written as its tokens arrive and later
    ones wait until it ends; fed the final outputs, it writes the same text at once.
    """

    def __init__(self, prompts: list[str], n: int, tokenizer):
        self.prompts, self.n, self.tok = prompts, n, tokenizer
        self.order = [(i, j) for i in range(len(prompts)) for j in range(n)]
        self.tokens: dict[tuple[int, int], list[int]] = {key: [] for key in self.order}
        self.ends: dict[tuple[int, int], str | None] = {}  # finish reason; None: rejected, nothing to print
        self.pos, self.shown = 0, -1  # shown: characters of the current completion written (-1: not begun)

    def token(self, i: int, j: int, token: int, finish: str | None) -> None:
        """The engine's ``on_token`` hook."""
        self.tokens[i, j].append(token)
        if finish is not None:
            self.ends[i, j] = finish
        self._write()

    def outputs(self, outs) -> None:
        """Everything the engine returned (this also ends completions that failed or were never run)."""
        for i, out in enumerate(outs):
            for j in range(self.n):
                self.ends[i, j] = None
            for c in out.outputs:
                self.tokens[i, c.index], self.ends[i, c.index] = list(c.token_ids), c.finish_reason
        self._write()

    def _write(self) -> None:
        while self.pos < len(self.order):
            key = self.order[self.pos]
            done = key in self.ends
            if not done and not self.tokens[key]:
                break  # nothing to show yet (and it may turn out rejected)
            if done and self.ends[key] is None:
                self.pos += 1
                continue
            if self.shown < 0:
                label = repr(self.prompts[key[0]]) + (f" #{key[1]}" if self.n > 1 else "")
                sys.stdout.write(f"{label} -> ")
                self.shown = 0
            text = self.tok.decode(self.tokens[key], skip_special_tokens=True)
            if not done:
                text = text.rstrip("\ufffd")  # an unfinished multi-byte character waits for its next token
            sys.stdout.write(text[self.shown :])
            self.shown = len(text)
            if not done:
                break
            sys.stdout.write(f"  ({len(self.tokens[key])} tokens, {self.ends[key]})\n")
            self.pos, self.shown = self.pos + 1, -1
        sys.stdout.flush()


def cmd_generate(args) -> None:
    """Sample continuations of ``--prompt``s with the rollout engine (KV cache, the engine's checks)."""
    from moerl.engine import Request, RequestError, SamplingParams

    def params(i: int) -> SamplingParams:  # prompt i is seeded with seed + i: equal prompts differ
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.max_tokens, n=args.n, seed=args.seed + i)

    params(0)  # bad sampling options fail here, before the model is loaded
    if args.n > 1 and args.temperature == 0:
        raise ConfigError(f"--n {args.n} with greedy decoding (--temperature 0, the default) gives {args.n} equal "
                          "completions: pass --temperature > 0 to sample")  # fmt: skip
    n_seqs = max(args.n, min(len(args.prompt) * args.n, 64))
    engine, tok = _engine(args, args.prompt, args.max_tokens, n_seqs)
    printer = _Printer(args.prompt, args.n, tok)
    start = time.perf_counter()
    reqs = [Request(p, params(i), adapter="adapter" if args.adapter else None) for i, p in enumerate(args.prompt)]
    outs = engine.generate(reqs, on_token=printer.token if args.stream else None)
    secs = time.perf_counter() - start
    printer.outputs(outs)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"{tokens} tokens in {secs:.2f}s ({tokens / max(secs, 1e-9):.1f} tokens/s)", file=sys.stderr)
    failed = [f"prompt {i} {args.prompt[i]!r}: {o.error}" for i, o in enumerate(outs) if o.error is not None]
    if failed:
        raise RequestError("; ".join(failed))


def _engine(args, prompts: list[str] | None, max_tokens: int, max_num_seqs: int):
    """The native engine on ``args.model_dir`` in ``args.dtype`` with ``args.adapter`` (a PEFT directory) loaded as
    adapter ``"adapter"``; the KV cache sized for ``prompts`` plus ``max_tokens`` unless ``args.max_model_len``
    (no prompts: the model's window, at most SERVE_WINDOW)."""
    from moerl.bridges import load_model
    from moerl.bridges.checkpoint import load_tokenizer
    from moerl.engine import EngineConfig, LLMEngine

    lora = {}
    if args.adapter is not None:  # a trained adapter (PEFT directory) on top of the checkpoint
        from moerl.bridges.peft import adapter_rank

        lora = {"max_loras": 1, "max_lora_rank": adapter_rank(args.adapter)}
    tok = load_tokenizer(args.model_dir)
    model = load_model(args.model_dir, dtype=compute_dtype(args.dtype))
    max_len = args.max_model_len
    if max_len is None:  # the model's window, capped at what these prompts can use: the KV cache is sized by it
        need = SERVE_WINDOW if prompts is None else max(len(tok(p)["input_ids"]) for p in prompts) + max_tokens
        max_len = min(model.config.max_position_embeddings, need)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_len, **lora), tokenizer=tok)
    if args.adapter is not None:
        engine.add_adapter("adapter", args.adapter)
    return engine, tok


SERVE_WINDOW = 4096  # moerl serve's default context window: the KV cache holds max_num_seqs of them


def cmd_serve(args) -> None:
    """Serve a checkpoint (and ``--adapter``) over the OpenAI API on ``--host``:``--port`` until Ctrl-C or SIGTERM."""
    import importlib
    import signal
    import threading
    from pathlib import Path

    for lib in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(lib)
        except ImportError:
            raise ConfigError(f"moerl serve needs {lib}, not installed here: pip install 'moerl[serve]'") from None
    from moerl.serve import Listening, OpenAIServer

    if args.max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs {args.max_num_seqs}: must be >= 1")
    given = str(args.model_given).rstrip("/")
    name = args.served_model_name or (Path(given).name if Path(given).is_dir() else given)  # a hub id: all of it
    engine, _ = _engine(args, None, 0, args.max_num_seqs)
    server = OpenAIServer(engine, name, adapter="adapter" if args.adapter else None)
    listening = Listening(server.app, args.host, args.port)
    window = engine.config.max_model_len
    line = f"moerl serve: {name} at {listening.url} (context {window} tokens; Ctrl-C stops)"
    print(line, file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while listening.alive() and not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        listening.close()
        server.batcher.close()
    print("moerl serve: stopped", file=sys.stderr)


def _env_from_args(args):
    """The environment ``--env`` with ``--env-kwargs`` (a JSON object, as a run's ``env.kwargs``)."""
    import json

    from moerl.envs import make_env

    try:
        kwargs = json.loads(args.env_kwargs)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--env-kwargs {args.env_kwargs!r} is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--env-kwargs {args.env_kwargs!r}: must be a JSON object, e.g. '{{\"max_operand\": 19}}'")
    return make_env(args.env, **kwargs), kwargs


def cmd_sft(args) -> None:
    """Warm a checkpoint up on an environment's worked examples (a random preset model unless ``--model``)."""
    import tempfile
    from pathlib import Path

    from moerl.errors import RunDirError
    from moerl.presets import init_model
    from moerl.warmup import warm_up

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be >= 1")
    env, _ = _env_from_args(args)
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise RunDirError(f"sft: {str(out)!r} is not empty; pass --overwrite to write the checkpoint over it")
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.model is not None:
        warm_up(args.model, out, env, args.steps, log=log)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            init_model(args.arch, args.preset, tmp, seed=args.seed)
            warm_up(tmp, out, env, args.steps, log=log)
    print(f"wrote the warmed-up checkpoint to {out}: train from it with model.path={out}")


def cmd_eval(args) -> None:
    """Greedy accuracy of a checkpoint (with ``--adapter``) on an environment's held-out problems, with its 95%
    interval: the problems a run with ``train.seed`` = ``--seed`` evaluates on and never trains on."""
    import json

    from moerl.console import held_out_text
    from moerl.envs.base import held_out
    from moerl.rollout.generator import Generator
    from moerl.run_config import AlgoSection, RolloutSection

    if args.problems < 1:
        raise ConfigError(f"--problems {args.problems}: must be >= 1")
    env, kwargs = _env_from_args(args)
    problems = held_out(env, args.problems, seed=args.seed)
    chat = next((p for p in problems if not isinstance(p.prompt, str)), None)
    if chat is not None:
        raise ConfigError(f"moerl eval: {chat.name()}: its prompt is a list of chat messages; moerl eval takes text "
                          "prompts (a run evaluates chat prompts with env.chat.template: true)")  # fmt: skip
    turns = getattr(env, "max_turns", 1)  # a multi-turn episode's context holds every turn and the env's replies
    engine, _ = _engine(args, [p.prompt for p in problems], (args.max_tokens + 16) * turns, min(len(problems), 64))
    rollout = RolloutSection(max_tokens=args.max_tokens, max_model_len=engine.config.max_model_len)
    gen = Generator(env, engine, rollout, AlgoSection(), seed=args.seed, eval_problems=args.problems, lora=False)
    gen.adapter = "adapter" if args.adapter is not None else None
    row = gen.evaluate().metrics()
    what = f"{args.env} {json.dumps(kwargs)}" if kwargs else args.env
    print(f"held-out accuracy {held_out_text(row)} on {what}, greedy")


def cmd_check_arch(args) -> None:
    """Derive the bridge of checkpoint ``args.dir`` from its config, prove it against transformers, check that every
    tensor of the checkpoint has a place, and print the bridge as a Python file to commit."""
    from pathlib import Path

    from moerl.bridges.base import HFConfig
    from moerl.bridges.checkpoint import check_shapes, read_config
    from moerl.bridges.derive import derive
    from moerl.bridges.prove import bridge_source, prove
    from moerl.errors import ConfigError
    from moerl.model.size import check_buildable, check_fits
    from moerl.model.transformer import MoEModel

    hf = read_config(args.dir)
    _, variant, layout = prove(hf)
    bridge = derive(hf, layout, variant)
    cfg = bridge.config_from_hf(HFConfig(hf, str(args.dir)))
    check_buildable(cfg)
    with torch.device("meta"):
        model = MoEModel(cfg)
    check_shapes(Path(args.dir), bridge, cfg, dict(model.named_parameters()) | dict(model.named_buffers()), hf)
    try:
        check_fits(model, "cpu", str(args.dir))
    except ConfigError as e:  # the bridge holds; this machine is too small to load the model
        print(f"moerl: note: {e}: it loads only on a larger machine", file=sys.stderr)
    print(bridge_source(hf, variant, layout), end="")


def cmd_archs(args) -> None:
    """Each supported architecture, its model_type and what it runs on: every family trains and serves on the
    native engine; the vLLM engine needs moerl's fp32-router model for it. Families loaded by derivation from their
    config (any other MoE family transformers has) are listed where vLLM serves them too."""
    from moerl.bridges import bridge_for_arch, supported
    from moerl.rollout.vllm_plugin import GPU_ONLY, MODELS

    def engines(arch: str) -> str:
        if arch not in MODELS:
            return "native engine only"
        return "full (also vLLM on a GPU build)" if arch in GPU_ONLY else "full (also vLLM)"

    rows = [(a, bridge_for_arch(a).model_type, engines(a)) for a in supported()]
    rows += [(a, "(derived)", engines(a)) for a in MODELS if a not in supported()]
    width = max(len(a) for a, _, _ in rows)
    print(f"{'architecture':<{width}}  {'model_type':<16} rollout engines")
    for arch, model_type, kinds in rows:
        print(f"{arch:<{width}}  {model_type:<16} {kinds}")


def cmd_demo(args) -> None:
    from moerl.demo import run_demo

    run_demo(args.run_dir, sft_steps=args.sft_steps, rl_steps=args.rl_steps, overwrite=args.overwrite, arch=args.arch)


def run_config(args):
    """The RunConfig of ``moerl train`` / ``moerl plan``: the config file (optional) and the overrides; a first
    word holding ``=`` and not naming a YAML file is an override (``moerl train train.steps=20``)."""
    from moerl.config import load_config
    from moerl.run_config import RunConfig

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # no file given, only overrides
    return load_config(RunConfig, config, overrides)


def cmd_train(args) -> None:
    from moerl.loop import train
    from moerl.parallel.plan import check_layout, model_config
    from moerl.parallel.world import launch, under_launcher

    if args.config is None and not args.overrides:  # a bare `moerl train` would start a 50-step run in runs/run
        raise ConfigError(
            "moerl train needs a config file and/or key=value overrides, e.g. `moerl train "
            "examples/lora_arithmetic.yaml` or `moerl train train.steps=20 policy.mode=full`; nothing was started"
        )
    cfg = run_config(args)
    par, model = cfg.parallel, cfg.model
    if par.size > 1:  # a layout the model cannot take is refused before any rank starts
        mcfg = model_config(model.path, model.arch, model.preset)
        if mcfg is not None:
            check_layout(par.dp, par.ep, par.pp, mcfg, par.schedule, par.stages, par.cp)
    if cfg.cluster.backend == "ray":  # the ranks and engines as Ray actors
        from moerl.cluster import run_on_ray

        summary = run_on_ray(cfg, resume=args.resume, overwrite=args.overwrite)
    elif cfg.parallel.size > 1 and not under_launcher():  # start the ranks; each runs this same command
        launch(args.argv, cfg.parallel.size, cfg.run_dir)
        return
    else:
        summary = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if summary is None:  # a trainer rank other than 0
        return
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


def _bytes(text: str, key: str, unit: str = "") -> int:
    """``80GB``, ``141GB``, ``96GiB`` (or a plain number of bytes) as bytes, at least one: ``key`` (and ``unit``,
    the suffix its value had, e.g. ``/s``) name it in errors."""
    import math
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(|B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*", str(text))
    if m is None:
        raise ConfigError(f"{key} {text + unit!r}: a size such as 80GB{unit}, 141GB{unit} or 96GiB{unit}")
    scale = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    scale |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    value = float(m.group(1)) * scale[m.group(2)]
    if not (math.isfinite(value) and value >= 1):  # 0 fits nothing; a zero bandwidth would divide by it
        raise ConfigError(f"{key} {text + unit!r}: must be at least 1 byte{unit}")
    return int(value)


def cmd_plan(args) -> None:
    """Memory per trainer rank, weight-sync traffic and the smallest layout that fits (``moerl.plan``)."""
    from moerl.plan.plan import Machine, cores, plan, render

    cfg = run_config(args)
    link = _bytes(args.link.removesuffix("/s"), "--link", "/s" if args.link.endswith("/s") else "")
    machine = Machine(args.gpus, _bytes(args.gpu_memory, "--gpu-memory"), args.nodes, args.usable, link)
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers}: must be >= 0 (0: one per core)")
    workers = args.workers or cores()
    print(render(plan(cfg, machine, colocated=args.colocated, propose=not args.no_proposal, workers=workers)))


def cmd_config(args) -> None:
    """Every config key of ``moerl train`` with its default and what it does."""
    from moerl.config_doc import markdown_table, text_table
    from moerl.run_config import RunConfig

    print((markdown_table if args.markdown else text_table)(RunConfig()), end="")


def cmd_plot(args) -> None:
    from moerl.metrics import plot_run

    print(plot_run(args.run_dir, args.out))


def _env_arguments(s: argparse.ArgumentParser) -> None:
    """``--env`` and ``--env-kwargs`` (read by ``_env_from_args``)."""
    s.add_argument(
        "--env",
        default="arithmetic",
        help="the environment: arithmetic | countdown | math | calculator | dataset | reasoning_gym, or file.py:Class",
    )
    s.add_argument(
        "--env-kwargs",
        default="{}",
        help="its arguments as in a run's env.kwargs (JSON), e.g. '{\"max_operand\": 19}'",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moerl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (
        _init_model_parser,
        _generate_parser,
        _serve_parser,
        _eval_parser,
        _sft_parser,
        _archs_parser,
        _check_arch_parser,
        _demo_parser,
        _train_parser,
        _plan_parser,
        _config_parser,
        _plot_parser,
    ):
        add(sub)
    return p


def _init_model_parser(sub) -> None:
    s = sub.add_parser("init-model", help="write a random HF checkpoint of a supported architecture")
    s.add_argument("--arch", required=True, help="HF architecture or model_type, e.g. qwen3_moe")
    s.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dtype", default="float32", choices=list(DTYPES))
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    s.add_argument("out_dir")
    s.set_defaults(func=cmd_init_model)


def _generate_parser(sub) -> None:
    s = sub.add_parser("generate", help="sample continuations of prompts from a checkpoint with the rollout engine")
    _checkpoint_argument(s, "model_dir")
    s.add_argument("--prompt", action="append", required=True, help="a text prompt (repeat for several)")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); > 0 samples")
    s.add_argument("--adapter", default=None, help="a LoRA adapter directory (PEFT, as moerl exports) to apply")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0: off")
    s.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="auto: bf16 where native, else fp32")
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context window (default: the model's max_position_embeddings, capped at the longest prompt plus "
        "--max-tokens)",
    )
    s.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    s.set_defaults(func=cmd_generate)


def _serve_parser(sub) -> None:
    s = sub.add_parser(
        "serve", help="serve a checkpoint over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models)"
    )
    _checkpoint_argument(s, "model_dir")
    s.add_argument("--adapter", default=None, help="a LoRA adapter directory (PEFT, as moerl exports) to apply")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="0: a free port (the line it prints says which)")
    s.add_argument("--served-model-name", default=None, help="the model's name in requests (default: the directory's)")
    s.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="auto: bf16 where native, else fp32")
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"context window (default: the model's max_position_embeddings, at most {SERVE_WINDOW})",
    )
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together (the KV cache holds them)")
    s.set_defaults(func=cmd_serve)


def _eval_parser(sub) -> None:
    s = sub.add_parser(
        "eval", help="held-out accuracy of a checkpoint (and adapter) on an environment, with its 95%% CI"
    )
    _checkpoint_argument(s, "model_dir")
    s.add_argument("--adapter", default=None, help="a LoRA adapter directory (PEFT, as moerl exports) to apply")
    _env_arguments(s)
    s.add_argument(
        "--problems", type=int, default=200, help="distinct held-out problems (fewer if the split is smaller)"
    )
    s.add_argument("--seed", type=int, default=0, help="the run's train.seed: the same held-out problems")
    s.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (per turn)")
    s.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="auto: bf16 where native, else fp32")
    s.add_argument("--max-model-len", type=int, default=None, help="context window (default: what the problems need)")
    s.set_defaults(func=cmd_eval)


def _sft_parser(sub) -> None:
    s = sub.add_parser(
        "sft", help="warm a model up on an environment's worked examples (supervised), for RL to start from"
    )
    s.add_argument("out_dir")
    _checkpoint_argument(s, "--model", "a checkpoint to start from (default: a random --arch / --preset one)")
    s.add_argument("--arch", default="qwen3_moe", help="the random model's architecture")
    s.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    s.add_argument("--seed", type=int, default=0, help="the random model's seed")
    _env_arguments(s)
    s.add_argument("--steps", type=int, default=120, help="supervised steps of 128 examples")
    s.add_argument("--overwrite", action="store_true", help="write into a non-empty directory")
    s.set_defaults(func=cmd_sft)


def _archs_parser(sub) -> None:
    s = sub.add_parser("archs", help="list the supported HF architectures")
    s.set_defaults(func=cmd_archs)


def _check_arch_parser(sub) -> None:
    s = sub.add_parser(
        "check-arch", help="derive a bridge for a checkpoint without one, prove it against transformers, print it"
    )
    _checkpoint_argument(s, "dir")
    s.set_defaults(func=cmd_check_arch)


def _demo_parser(sub) -> None:
    s = sub.add_parser("demo", help="the main job: a tiny MoE learns arithmetic (warm-up, then GRPO + LoRA + R3)")
    s.add_argument("--run-dir", default="runs/demo")
    s.add_argument("--arch", default="qwen3_moe", help="the tiny preset's architecture (qwen3_5_moe: the hybrid)")
    s.add_argument("--sft-steps", type=int, default=120)
    s.add_argument("--rl-steps", type=int, default=300)
    s.add_argument("--overwrite", action="store_true", help="start over in a run directory holding a previous demo")
    s.set_defaults(func=cmd_demo)


def _train_parser(sub) -> None:
    s = sub.add_parser(
        "train",
        help="run the RL loop from a YAML config with key.sub=value overrides",
        description="Run the RL loop from a YAML config with key.sub=value overrides. Every key, its default and what "
        "it does: moerl config",
    )
    s.add_argument("config", nargs="?", help="YAML file (optional: defaults plus overrides also work)")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 policy.mode=full")
    s.add_argument("--resume", action="store_true", help="continue from run_dir/checkpoint")
    s.add_argument("--overwrite", action="store_true", help="start over in a run_dir that holds a run")
    s.set_defaults(func=cmd_train)


def _plan_parser(sub) -> None:
    s = sub.add_parser(
        "plan",
        help="memory per trainer rank, weight-sync traffic and the smallest layout that fits, before a run starts",
        description="Trace a run's trainer ranks at the model's real size on a fake world of the layout's size "
        "(nothing allocated): each rank's memory at its training step's and weight sync's peak, by what holds it, "
        "whether it fits, what a sync sends per mode, and the smallest layout of the given GPUs that fits. "
        "model.path: a checkpoint directory or a shipped config (" + ", ".join(_shipped()) + ").",
    )
    s.add_argument("config", nargs="?", help="YAML file (optional: defaults plus overrides also work)")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=qwen3-30b-a3b parallel.ep=8")
    s.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    s.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB (H100), 141GB (H200)")
    s.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are on")
    s.add_argument("--usable", type=float, default=0.9, help="share of a GPU's memory tensors may take")
    s.add_argument("--link", default="50GB/s", help="bandwidth a weight sync crosses, e.g. 50GB/s")
    s.add_argument("--colocated", action="store_true", help="the rollout engine shares each trainer's GPU")
    s.add_argument("--no-proposal", action="store_true", help="do not search for a layout that fits")
    s.add_argument("--workers", type=int, default=0, help="ranks traced at once, one process each (0: every core)")
    s.set_defaults(func=cmd_plan)


def _config_parser(sub) -> None:
    s = sub.add_parser("config", help="list every config key of moerl train with its default and what it does")
    s.add_argument("--markdown", action="store_true", help="as a markdown table (README's Reference)")
    s.set_defaults(func=cmd_config)


def _plot_parser(sub) -> None:
    s = sub.add_parser("plot", help="write a PNG of a run's reward and mismatch curves")
    s.add_argument("run_dir")
    s.add_argument("--out", default=None)
    s.set_defaults(func=cmd_plot)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``train``'s ``key=value`` overrides may stand before or after its flags
    (``moerl train CFG --resume train.steps=200``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    takes_overrides = getattr(args, "func", None) in (cmd_train, cmd_plan)
    if extra and takes_overrides and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _checkpoint_argument(s, name: str, about: str = "a checkpoint directory or a Hugging Face hub id (owner/name)"):
    """The command's checkpoint ``name`` (a directory or a hub id, from the HF cache offline first) and its
    ``--revision``; resolved to a directory before the command runs (``_resolve_checkpoint``)."""
    if name.startswith("--"):
        s.add_argument(name, default=None, help=about)
    else:
        s.add_argument(name, help=about)
    s.add_argument("--revision", default=None, help="with a hub id: its branch, tag or commit (default: main)")
    s.set_defaults(checkpoint=name)


def _resolve_checkpoint(args) -> None:
    """The command's checkpoint argument as a local directory (``moerl.hub.checkpoint_dir``)."""
    from moerl.hub import checkpoint_dir

    name = getattr(args, "checkpoint", None)
    field = name.lstrip("-").replace("-", "_") if name else None
    if field is not None and getattr(args, field) is not None:
        args.model_given = getattr(args, field)  # as the user named it (a hub id, a path)
        setattr(args, field, checkpoint_dir(getattr(args, field), args.revision, key=name))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _resolve_checkpoint(args)
        args.func(args)
    except MoerlError as e:
        if not isinstance(e, Preempted):
            print(f"moerl: error: {e}", file=sys.stderr)
        elif not (os.environ.get("MOERL_QUIET_CTRL_C") and "LOCAL_RANK" in os.environ):  # a rank of moerl's own
            # launch (QUIET_CTRL_C): the launcher says it, once
            print(f"moerl: stopped: {e}", file=sys.stderr)
        _tell_launcher(e)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print("moerl: interrupted", file=sys.stderr)
        return 130
    return 0


def _shipped() -> list[str]:
    from moerl.plan.plan import shipped

    return shipped()


def _tell_launcher(e: Exception) -> None:
    """One rank of a torchrun launch: leave the error where the launcher reads it, so it names this rank's fault."""
    import os

    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)


if __name__ == "__main__":
    sys.exit(main())
