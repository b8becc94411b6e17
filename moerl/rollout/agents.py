"""Rollouts of agent environments (``moerl.envs.verifiers``): the agents talk to the engine through moerl's OpenAI
server, and each sample's episode is joined from what the engine made for its requests, never from text.

The server (loopback, a free port) is started on first use over the generator's engine and records every answered
request under its ``X-Session-ID`` (an agent run's id). A run's requests in order become one episode where each
request's prompt starts with all the tokens before it (a chat that only appends: the environment's turns are not
trained on, the model's are, with the engine's logprobs and, under R3, the last request's experts, which cover every
token before its last); where a prompt rewrites what came before (a template that drops earlier reasoning), the
request starts another episode of the same group and reward.
"""

from __future__ import annotations

import threading

from moerl.engine import RequestOutput
from moerl.rollout.episode import Episode

SERVED = "moerl"  # the model's name on the run's own server


class SessionRecords:
    """What the server made for each session, in the order the requests were answered (thread-safe: the server's
    event loop adds, the generator takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[str, list[RequestOutput]] = {}

    def add(self, session: str | None, out: RequestOutput) -> None:
        if session is not None:
            with self._lock:
                self._by.setdefault(session, []).append(out)

    def take(self, session: str) -> list[RequestOutput]:
        with self._lock:
            return self._by.pop(session, [])


def join(outs: list[RequestOutput], group: int, reward: float, error: str | None) -> list[Episode]:
    """The episodes of one agent run's answered requests ``outs`` (one sample each), scored ``reward``."""
    episodes: list[Episode] = []
    for out in outs:
        prompt, c = list(out.prompt_token_ids), out.outputs[0]
        logprobs = c.logprobs.tolist()
        e = episodes[-1] if episodes else None
        if e is not None and prompt[: len(e.tokens)] == e.tokens:
            extra = prompt[len(e.tokens) :]
            e.tokens = e.tokens + extra + list(c.token_ids)
            e.loss_mask += [0] * len(extra) + [1] * len(c.token_ids)
            e.rollout_logprobs += [0.0] * len(extra) + logprobs
            e.routed, e.finish_reason = c.routed_experts, c.finish_reason
            e.version = min(e.version, out.weight_version)
            continue
        n = len(prompt)
        episodes.append(
            Episode(group, prompt + list(c.token_ids), n, [0] * n + [1] * len(c.token_ids), [0.0] * n + logprobs,
                    c.routed_experts, reward, c.finish_reason, error, out.weight_version)
        )  # fmt: skip
    return episodes


class AgentRollouts:
    """The generator's agent rollouts over ``engine`` (requests use LoRA adapter ``adapter`` where given), with
    ``chat_kwargs`` passed to the chat template of every request."""

    def __init__(self, engine, adapter: str | None, chat_kwargs: dict | None = None) -> None:
        self.engine, self.adapter, self.chat_kwargs = engine, adapter, dict(chat_kwargs or {})
        self.records = SessionRecords()
        self._server = self._listening = None

    @property
    def url(self) -> str:
        """The server's ``/v1`` base, started on first use."""
        if self._listening is None:
            from moerl.serve import Listening, OpenAIServer

            self._server = OpenAIServer(self.engine, SERVED, adapter=self.adapter, record=self.records.add)
            self._listening = Listening(self._server.app)
        return self._listening.url

    def generate(self, env, problems, params, first_group: int, failures) -> list[Episode]:
        """One episode group per problem: ``params[i].n`` agent episodes of problem ``i`` sampled as ``params[i]``
        says (sample ``j`` seeded ``seed * 31 + j``); a run that failed is said once (``failures``) and scores 0;
        one that made no request is a failed sample (its group is dropped)."""
        sp = params[0]
        sampling = {"temperature": sp.temperature, "top_p": sp.top_p, "max_tokens": sp.max_tokens}
        if self.chat_kwargs:
            sampling["chat_template_kwargs"] = self.chat_kwargs
        jobs = [(p, [q.seed * 31 + j for j in range(q.n)]) for p, q in zip(problems, params, strict=True)]
        episodes: list[Episode] = []
        for g, (problem, samples) in enumerate(zip(problems, env.run_episodes(jobs, self.url, SERVED, sampling),
                                                   strict=True)):  # fmt: skip
            for runs in samples:
                for run in runs:
                    outs = self.records.take(run.session)
                    if run.error is not None:
                        outcome = "the sample scores 0" if outs else "its group is dropped (no model call to train on)"
                        failures.add("verifiers rollout", problem, "error", run.error, outcome)
                    if not outs:
                        episodes.append(Episode.failed(first_group + g, run.error or "the agent made no request"))
                        continue
                    episodes += join(outs, first_group + g, run.reward, "error" if run.error else None)
        return episodes

    def close(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._server.batcher.close()
            self._listening = None
