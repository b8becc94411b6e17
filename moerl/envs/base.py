"""The environment interfaces, deterministic train/test sampling, and ``safe_reward``.

An environment hands out :class:`Problem` s and scores completions (text) the inference engine generated for them.
Single-turn environments implement :class:`Environment`; episodic ones (tool use) implement
:class:`MultiTurnEnvironment`.

**Stop convention.** A completion is the text the model generated *before* its EOS token: targets given for
supervised warm-up (e.g. ``ArithmeticEnv.sft_examples``) carry no terminator (``"19"``, not ``"19\\n"``), the
trainer appends the tokenizer's EOS, and the engine stops on EOS. Rewards read a completion from its start and ignore
whatever follows the answer, so a model that does not stop is judged on what it said first.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import numbers
import pickle
import random
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol, runtime_checkable

from moerl.child import spawn
from moerl.errors import ConfigError

SPLITS = ("train", "test")
TEST_FRACTION = 0.1


@dataclass(slots=True)
class Problem:
    """One task: the prompt (text, or a list of chat messages ``{"role": ..., "content": ...}`` that the tokenizer's
    chat template renders), the gold answer the reward compares against, free-form metadata, and where the problem
    came from (``file:line`` of a dataset record; empty for a generated problem)."""

    prompt: str | list[dict]
    answer: object
    meta: dict = field(default_factory=dict)
    where: str = ""

    def name(self) -> str:
        """The problem in an error message: its record's place, or its prompt."""
        if self.where:
            return f"record {self.where}"
        text = prompt_key(self.prompt)
        return f"problem {text[:60]!r}" + ("..." if len(text) > 60 else "")


def prompt_key(prompt: str | list[dict]) -> str:
    """A prompt as one string (a list of messages as its JSON): what splits and de-duplication hash."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


@runtime_checkable
class Environment(Protocol):
    """A single-turn environment: one completion per problem, scored by ``reward``."""

    name: str

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems, the same for the same ``(seed, split)``; no train problem is ever a test problem."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for a correct completion, 0.0 otherwise (unless the environment documents another scale)."""
        ...


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An episodic environment: the model and the environment alternate for at most ``max_turns`` completions."""

    name: str
    max_turns: int

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """As :meth:`Environment.problems`."""
        ...

    def start(self, problem: Problem) -> Any:
        """A fresh episode state for ``problem``."""
        ...

    def step(self, state: Any, completion: str) -> tuple[str | None, float | None]:
        """Consume one completion: ``(message to append, None)`` while the episode goes on, ``(None, reward)`` at
        its end."""
        ...


def check_split(split: str) -> None:
    """Raise ConfigError unless ``split`` is ``"train"`` or ``"test"``."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def split_of(key: str, test_fraction: float = TEST_FRACTION) -> str:
    """The split a problem belongs to, from a hash of its key (its prompt): stable across runs and seeds."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h < test_fraction * 2**64 else "train"


def sample_problems(
    name: str,
    n: int,
    seed: int,
    split: str,
    make: Callable[[random.Random], Problem],
    max_tries: int = 1000,
    test_fraction: float = TEST_FRACTION,
) -> list[Problem]:
    """``n`` problems drawn by ``make`` from an RNG seeded by ``(name, split, seed)``, keeping those whose prompt
    hashes into ``split`` (a ``test_fraction`` of the space is test). Raises ConfigError when the problem space is
    too small to find them."""
    check_split(split)
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{name}:{split}:{seed}")  # str seeds hash with sha512: the same in every process
    out: list[Problem] = []
    for _ in range(max_tries * (n + 1)):
        if len(out) == n:
            return out
        p = make(rng)
        if split_of(prompt_key(p.prompt), test_fraction) == split:
            out.append(p)
    raise ConfigError(f"{name}: could not draw {n} {split} problems; widen the config (the problem space is too small)")


def draw(env, n: int, seed: int, split: str) -> list[Problem]:
    """``env.problems(n, seed, split)``, checked: ConfigError naming the environment where it returns anything but a
    list of ``n`` Problems (a user's environment)."""
    got = env.problems(n, seed=seed, split=split)
    bad = next((p for p in got if not isinstance(p, Problem)), None) if isinstance(got, list) else got
    if bad is not None or len(got) != n:
        what = f"{type(bad).__name__} {bad!r:.80}" if bad is not None else f"{len(got)} problems"
        raise ConfigError(
            f"environment {getattr(env, 'name', type(env).__name__)!r}: problems(n={n}, split={split!r}) returned "
            f"{what}; it must return a list of n moerl.envs.Problem"
        )
    return got


def held_out(env, n: int, seed: int) -> list[Problem]:
    """Up to ``n`` *distinct* test-split problems of ``env`` (by prompt), deterministic in ``seed``: an evaluation
    over repeats of a few problems would claim a precision it does not have. Fewer when the test split of the
    problem space is smaller (a 400-problem space holds ~40 test problems at the default fraction)."""
    found: dict[str, Problem] = {}
    for draws in (n, 4 * n, 16 * n):  # repeats thin out the draws: more of them find the rest of a small space
        for p in draw(env, draws, seed, "test"):
            found.setdefault(prompt_key(p.prompt), p)
        if len(found) >= n:
            break
    return list(found.values())[:n]


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% for ``z`` = 1.96) of a success rate of ``correct`` out of ``total``: unlike
    the normal approximation it stays inside [0, 1] and is not empty at 0% or 100%."""
    if total <= 0:
        return math.nan, math.nan
    p, zz = correct / total, z * z
    mid = (p + zz / (2 * total)) / (1 + zz / total)
    half = z * math.sqrt(p * (1 - p) / total + zz / (4 * total * total)) / (1 + zz / total)
    return max(0.0, mid - half), min(1.0, mid + half)


# ---- safe_reward: the reward function runs in a persistent worker process, killed on timeout ----


def serve(fd: int) -> None:
    """Worker loop on socket ``fd``: unpickle (fn, [args, ...], as_reward), acknowledge, then run the calls in order,
    sending ("ok", value) | ("error", reason) after each. ``as_reward``: the value must be a finite int / float
    (sent as a float)."""
    # Ctrl-C and a scheduler's SIGTERM / SIGUSR1 reach the whole process group: the parent decides (it saves after
    # the step in progress, which may still score rewards here) and stops this worker itself
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    cache: dict[bytes, Callable] = {}
    while True:
        try:
            fn_bytes, calls_bytes, as_reward = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = cache.get(fn_bytes) or pickle.loads(fn_bytes)
            calls = pickle.loads(calls_bytes)
        except BaseException as e:  # reported to the parent, which raises
            conn.send(("load", f"{type(e).__name__}: {e}"))
            continue
        if len(cache) >= 8:
            cache.clear()
        cache[fn_bytes] = fn
        conn.send(("ready", None))
        for args in calls:
            try:
                conn.send(_outcome(fn, args, as_reward))
            except Exception as e:  # the result does not pickle (pickled whole before anything is written)
                conn.send(("error", f"result of {fn!r} cannot be sent back: {e}"))


def _outcome(fn: Callable, args: tuple, as_reward: bool) -> tuple[str, Any]:
    """``fn(*args)`` as the message the worker sends back."""
    try:
        value = fn(*args)
    except BaseException as e:  # any failure of a reward function is a 0 reward
        return "error", f"raised {type(e).__name__}: {e}"
    if not as_reward:
        return "ok", value
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    return ("ok", float(value)) if ok else ("error", f"returned {_short(value)}, not a finite number")


def _short(value: object) -> str:
    """``repr(value)``, cut to 80 characters (a reward that returns the whole completion is named, not echoed)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Worker:
    """A child process (``moerl.child.spawn``) running :func:`serve`."""

    LOAD_TIMEOUT_S = 120.0  # importing a reward function's module (sympy, ...) in a fresh process

    def __init__(self) -> None:
        self.proc, self.conn = spawn("moerl.envs.base", "serve")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


_worker: _Worker | None = None
_lock = threading.Lock()


def _shutdown() -> None:
    global _worker
    if _worker is not None:
        _worker.kill()
        _worker = None


atexit.register(_shutdown)


def safe_call(fn: Callable[..., Any], *args: Any, timeout_s: float, as_reward: bool = False) -> tuple[str, Any]:
    """Run ``fn(*args)`` in the worker process with a time limit: ``("ok", value)``, ``("error", reason)`` when it
    raises or kills its process, or ``("timeout", None)`` when it runs longer than ``timeout_s`` seconds.

    The call runs in a persistent worker process (started on first use, one per parent process, calls serialised).
    A process rather than a thread because a thread cannot be stopped: a runaway call would keep a core busy for
    good, and one stuck in C code holding the GIL (a huge ``int`` power, say) would stall the caller too. On timeout
    the worker is killed and a new one starts on the next call. ``fn``, ``args`` and the result must therefore pickle
    (module-level functions, methods of picklable objects, not lambdas or ``__main__`` functions); the worker keeps
    the last few unpickled functions, and the clock starts once ``fn`` is loaded there (its module imported). Raises
    ConfigError when ``fn`` or ``args`` cannot be pickled or loaded in the worker (a programming error, not a bad
    completion). ``as_reward``: a value that is not a finite int / float is an error.
    """
    return safe_calls(fn, [args], timeout_s=timeout_s, as_reward=as_reward)[0]


def safe_calls(
    fn: Callable[..., Any], calls: list[tuple], *, timeout_s: float, as_reward: bool = False
) -> list[tuple[str, Any]]:
    """:func:`safe_call` of ``fn(*args)`` for each ``args`` of ``calls``, in order, sent to the worker at once (one
    round trip for a step's rewards instead of one per completion). Each call has its own limit of ``timeout_s``,
    counted from the previous call's result: one that times out or kills the worker is that call's outcome, and a
    fresh worker runs the calls after it."""
    global _worker
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    try:
        fn_bytes, rest = pickle.dumps(fn), pickle.dumps(list(calls))
    except Exception as e:
        raise ConfigError(f"safe_reward runs {fn!r} in a worker process: it and its arguments must pickle ({e})") from e
    outcomes: list[tuple[str, Any]] = []
    with _lock:
        while len(outcomes) < len(calls):
            if outcomes:  # a fresh worker takes the calls after the one that timed out or killed the last
                rest = pickle.dumps(list(calls[len(outcomes) :]))
            if _worker is None or _worker.proc.poll() is not None:
                _worker = _Worker()
            conn = _worker.conn
            try:
                conn.send((fn_bytes, rest, as_reward))
                kind, detail = conn.recv() if conn.poll(_Worker.LOAD_TIMEOUT_S) else ("load", "timed out")
            except (EOFError, OSError) as e:
                kind, detail = "load", f"the worker process died ({e!r}); see its stderr"
            if kind == "load":
                _shutdown()
                raise ConfigError(f"safe_reward: the worker process could not load {fn!r}: {detail}")
            while len(outcomes) < len(calls):
                if not conn.poll(timeout_s):
                    _shutdown()
                    outcomes.append(("timeout", None))
                    break
                try:
                    outcomes.append(conn.recv())
                except (EOFError, OSError):  # fn killed its process (crash, OOM kill, os._exit)
                    _shutdown()
                    outcomes.append(("error", "the worker process died"))
                    break
    return outcomes


def safe_reward(fn: Callable[..., float], *args: Any, timeout_s: float) -> tuple[float, str | None]:
    """``fn(*args)`` through :func:`safe_call`: ``(reward, None)``, or ``(0.0, "error")`` when it raises, kills its
    process or returns something other than a finite int/float (bool, NaN, inf and None included), or
    ``(0.0, "timeout")`` when it runs longer than ``timeout_s`` seconds."""
    return safe_rewards(fn, [args], timeout_s=timeout_s)[0]


def safe_rewards(fn: Callable[..., float], calls: list[tuple], *, timeout_s: float) -> list[tuple[float, str | None]]:
    """:func:`safe_reward` for each ``args`` of ``calls`` in one round trip (:func:`safe_calls`)."""
    outcomes = safe_calls(fn, calls, timeout_s=timeout_s, as_reward=True)
    return [(value, None) if kind == "ok" else (0.0, kind) for kind, value in outcomes]


def env_step(env: MultiTurnEnvironment, state: Any, completion: str) -> tuple[str | None, float | None, Any]:
    """``env.step(state, completion)`` checked, with the state it leaves (run in the worker, the state comes back)."""
    message, reward = env.step(state, completion)
    if message is not None and not isinstance(message, str):
        raise TypeError(f"{env.name}.step returned message {message!r}, not a str or None")
    if reward is not None and not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
        raise TypeError(f"{env.name}.step returned reward {reward!r}, not a finite number or None")
    return message, reward, state
