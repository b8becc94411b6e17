"""verifiers environments (``verifiers.v1``, 0.4): a taskset and its env by id, played by agents that talk to moerl's
engine through its OpenAI-compatible server, scored by the environment's own rewards and judges.

``taskset`` (and ``env``, where the taskset's own or the single-agent env is not the one) are verifiers ids: installed
modules exporting a ``Taskset`` (an ``Env``) via ``__all__``. ``config`` is verifiers' own env config (its ``taskset``,
``timeout``, each agent seat's ``harness``, ``runtime``, ``max_turns`` ...). A seat that names no harness plays as
``moerl_chat`` (a plain chat in the process, no tools) and one that names no runtime runs on this host
(``subprocess``): verifiers' defaults are a program installed by ``uv`` in a remote sandbox.

Each sample is one ``Env.run_episode`` whose agents call ``base_url`` with the run's sampling; every request an agent
makes carries its trace's id (``X-Session-ID``), by which the generator joins the exact tokens the engine produced,
their logprobs and experts to the trace's reward (``moerl.rollout.agents``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import cached_property

from moerl.envs.base import Problem
from moerl.envs.records import shuffled_indices, split_pools
from moerl.errors import ConfigError

DEFAULT_SEAT = {"harness": {"id": "moerl_chat"}, "runtime": {"type": "subprocess"}}
API_KEY_VAR = "MOERL_SERVE_API_KEY"  # unset: verifiers sends "EMPTY"; the server is on loopback and takes any


@dataclass(slots=True)
class AgentRun:
    """One agent run (a verifiers trace) of an episode: its id (the session of its requests), its reward, and why it
    failed (None: it did not)."""

    session: str
    reward: float
    error: str | None


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("env.name 'verifiers' needs the verifiers package: pip install 'moerl[verifiers]'") from None
    return vf


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class VerifiersEnv:
    """The verifiers environment of ``taskset`` (and ``env``) with verifiers config ``config``; a ``test_fraction``
    of its tasks (by task key) is held out for evaluation."""

    name = "verifiers"

    def __init__(self, taskset: str, env: str = "", config: dict | None = None, test_fraction: float = 0.1) -> None:
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"config key 'env.kwargs.test_fraction'={test_fraction}: must lie in [0, 1)")
        self.taskset, self.env_id, self.config, self.test_fraction = taskset, env, dict(config or {}), test_fraction
        _ = self.vf_env  # loaded now: a wrong id or config is named before a run starts

    def __reduce__(self) -> tuple:
        return VerifiersEnv, (self.taskset, self.env_id, self.config, self.test_fraction)

    @cached_property
    def vf_env(self):
        """verifiers' ``Env``, its seats defaulted to moerl's (``DEFAULT_SEAT``) where the config leaves them."""
        _vf()
        from pydantic import ValidationError
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        raw = _merged({"id": self.env_id, "taskset": {"id": self.taskset}}, self.config)
        try:
            seats = agent_config_fields(resolve_env_config(raw))
            for seat in seats:
                raw[seat] = _merged(DEFAULT_SEAT, raw.get(seat) or {})
            return load_environment(resolve_env_config(raw))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ConfigError(
                f"config key 'env.kwargs.config.{where}': verifiers refuses it: {first.get('msg')}"
                + (f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else "")
            ) from None
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            which = "env" if self.env_id and self.env_id in str(e) else "taskset"
            raise ConfigError(f"config key 'env.kwargs.{which}': verifiers cannot load it: {e}") from None

    @cached_property
    def tasks(self) -> list:
        """The taskset's tasks, loaded once."""
        tasks = list(self.vf_env.taskset)
        if not tasks:
            raise ConfigError(f"config key 'env.kwargs.taskset'={self.taskset!r}: the taskset has no tasks")
        return tasks

    @cached_property
    def pools(self) -> dict[str, list[int]]:
        return split_pools(list(range(len(self.tasks))), lambda i: self.tasks[i].key, None, self.test_fraction)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` tasks of ``split`` as problems (their prompt as the conversation the agent opens with, for the
        context-window check), shuffled by ``seed``; the pool repeats where ``n`` is larger."""
        pool = self.pools.get(split, [])
        return [self._problem(pool[i]) for i in shuffled_indices(pool, n, self.name, self.taskset, split, seed)]

    def _problem(self, i: int) -> Problem:
        data = self.tasks[i].data
        prompt = data.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt or []
        ]  # fmt: skip
        if data.system_prompt:
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        return Problem(messages, None, {"task": i}, where=f"{self.taskset} task {i}")

    def run_episodes(
        self, jobs: list[tuple[Problem, list[int]]], base_url: str, model: str, sampling: dict
    ) -> list[list[list[AgentRun]]]:
        """For each (problem, seeds) of ``jobs``, one episode per seed, all at once: the agents call ``base_url``
        (model ``model``) sampling with ``sampling`` and the seed. Returns each episode's agent runs."""
        logging.getLogger("verifiers").setLevel(logging.WARNING)  # a line per rollout otherwise
        return asyncio.run(self._episodes(jobs, base_url, model, sampling))

    async def _episodes(self, jobs, base_url: str, model: str, sampling: dict) -> list[list[list[AgentRun]]]:
        vf = _vf()
        from verifiers.v1.clients import ModelContext

        client = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
        env = self.vf_env

        async def one(problem: Problem, seed: int) -> list[AgentRun]:
            ctx = ModelContext(model=model, client=client, sampling=vf.SamplingConfig(**sampling, seed=seed))
            episode = await env.run_episode(self.tasks[problem.meta["task"]], ctx)
            runs = [AgentRun(t.id, float(t.reward or 0.0), _failure(t.errors) if not t.ok else None)
                    for t in episode.traces]  # fmt: skip
            if episode.errors and all(r.error is None for r in runs):
                runs = [AgentRun(r.session, 0.0, _failure(episode.errors)) for r in runs]
            return runs or [AgentRun("", 0.0, _failure(episode.errors) or "the episode ran no agent")]

        async with env.serving():
            flat = await asyncio.gather(*(one(p, s) for p, seeds in jobs for s in seeds))
        out, at = [], 0
        for _, seeds in jobs:
            out.append(flat[at : at + len(seeds)])
            at += len(seeds)
        return out


def _failure(errors: list) -> str | None:
    """The first of verifiers' errors, in words."""
    if not errors:
        return None
    e = errors[0]
    kind, message = getattr(e, "type", None), getattr(e, "message", None)
    return f"{kind}: {message}" if kind or message else str(e)
