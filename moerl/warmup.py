"""Supervised warm-up: a random preset model taught an environment's worked examples, so RL starts from a model that
solves some problems (a model that solves none gives every group equal rewards and GRPO nothing to learn from).

``moerl sft`` writes one; ``model.sft_steps`` in a run config builds one on first use in a shared cache
(``model.base_cache``) that later runs with the same recipe reuse; ``moerl demo`` warms its model the same way.

A build in the cache happens in a ``.building-*`` directory that its process holds a lock on (``flock``, dropped by
the kernel however the process ends) and renames into place when complete. A build stopped by a signal removes its
directory; one whose process was killed outright is removed by the next build in that cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moerl.cores import CoreShare
from moerl.envs.user import code_fingerprint
from moerl.errors import ConfigError, Preempted

EXAMPLES = 4000  # (prompt, target) pairs drawn from the train split; batches are sampled from them
BATCH = 128
LR = 3e-3


def warm_up(
    base: str | os.PathLike,
    out: str | os.PathLike,
    env,
    steps: int,
    log=print,
    seed: int = 1,
    stopped: Callable[[], str | None] | None = None,
) -> None:
    """``steps`` full-model supervised steps of checkpoint ``base`` on ``env.sft_examples`` (train split only: the
    held-out problems stay unseen), fp32, cosine schedule; the result is written to ``out`` with ``base``'s
    tokenizer. An environment without worked examples is refused by name. ``stopped()``, asked before every step,
    names a scheduler's signal that came (else None): the warm-up stops there (Preempted), writing nothing."""
    from transformers import AutoTokenizer

    from moerl.bridges import export_model
    from moerl.trainer import OptimConfig, Policy, PolicyConfig
    from moerl.trainer.sft import run_sft

    if not hasattr(env, "sft_examples"):
        raise ConfigError(f"environment {env.name!r} has no worked examples (sft_examples) to warm a model up with")
    optim = OptimConfig(lr=LR, schedule="cosine", warmup_steps=min(10, steps // 4), total_steps=steps)
    policy = Policy(base, PolicyConfig(mode="full", dtype="float32", micro_batch_size=256, optim=optim))
    cores = CoreShare()  # torch threads follow the cores other processes leave (moerl.cores)
    done = 0

    def check() -> None:
        nonlocal done
        if stopped is not None and (name := stopped()):
            raise Preempted(f"{name} during the warm-up, after {done} of {steps} supervised steps")
        done += 1
        if line := cores.check():
            log(line.removeprefix("moerl: "))

    try:
        tok = AutoTokenizer.from_pretrained(base)
        examples = env.sft_examples(EXAMPLES, seed=seed)
        run_sft(policy, tok, examples, steps=steps, batch_size=BATCH, log=log, each_step=check)
        export_model(policy.model, out, tokenizer_dir=base)
    finally:
        cores.restore()
        policy.close()


def recipe(arch: str, preset: str, seed: int, env_name: str, env_kwargs: dict, steps: int) -> str:
    """The cache directory name of a warmed base: readable parts and a hash of everything that makes it (for an
    environment of the user's file, the file's content too: an edited task is another recipe)."""
    key = json.dumps([arch, preset, seed, env_name, env_kwargs, steps, EXAMPLES, BATCH, LR], sort_keys=True)
    key += code_fingerprint(env_name)
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", env_name.rsplit("/", 1)[-1])  # a path's file name and class
    return f"{arch}-{preset}-seed{seed}-{readable}-sft{steps}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def warmed_base(cfg, env, log=None, stopped: Callable[[], str | None] | None = None) -> Path:
    """The warmed checkpoint run config ``cfg`` starts from (``model.sft_steps`` > 0, no ``model.path``): taken
    from ``model.base_cache`` when a run with the same recipe built it, else built there now (written to a
    temporary directory and renamed, so a run that stops half-way leaves nothing a later one would take).
    ``stopped``: see ``warm_up``; a stop, or Ctrl-C, removes the partial build and says so."""
    from moerl.presets import init_model

    m = cfg.model
    cache = Path(m.base_cache)
    out = cache / recipe(m.arch, m.preset, m.seed, cfg.env.name, cfg.env.kwargs, m.sft_steps)
    if (out / "config.json").exists():
        return out
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"moerl: warming up a random {m.arch} {m.preset} model on {cfg.env.name} ({m.sft_steps} supervised steps, "
        f"once: later runs with this recipe reuse {out})")  # fmt: skip
    cache.mkdir(parents=True, exist_ok=True)
    gone, steps_log = "its partial build is removed (a later run builds it again)", lambda line: say(f"moerl: {line}")
    with _building(cache, say) as work:
        try:
            init_model(m.arch, m.preset, work / "random", seed=m.seed)
            warm_up(work / "random", work / "warm", env, m.sft_steps, steps_log, stopped=stopped)
        except Preempted as e:
            raise Preempted(f"{e} of the base model {out.name}, before the run's first step: {gone}") from None
        except KeyboardInterrupt:
            say(f"moerl: Ctrl-C during the warm-up of the base model {out.name}, before the run's first step: {gone}")
            raise
        try:
            os.rename(work / "warm", out)
        except OSError:  # another run built it meanwhile: theirs is the same recipe
            if not (out / "config.json").exists():
                raise
    return out


@contextmanager
def _building(cache: Path, say) -> Iterator[Path]:
    """A new build directory in ``cache``, locked while this process builds in it and removed after. Builds whose
    process is gone (their lock free) are removed first; that and the new directory's claim happen under a lock on
    ``cache`` itself, so no live build is taken for an abandoned one."""
    guard = os.open(cache, os.O_RDONLY)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for old in sorted(cache.glob(".building-*")):
            if _abandoned(old):
                shutil.rmtree(old, ignore_errors=True)
                say(f"moerl: removed {old}, a warm-up left half-built by a process that was killed")
        work = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
        held = os.open(work, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
    finally:
        os.close(guard)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(held)


def _abandoned(build: Path) -> bool:
    """Whether no process holds ``build``'s lock (its builder ended without removing it)."""
    try:
        fd = os.open(build, os.O_RDONLY)
    except OSError:  # removed meanwhile, or not a directory of ours
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
