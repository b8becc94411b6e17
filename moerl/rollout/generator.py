"""The generator: problems -> engine -> scored episodes (single-turn, or multi-turn turn by turn), a step's rollouts
(DAPO dynamic sampling refills groups that carry no signal) and held-out evaluation.

The synchronous and the asynchronous loop share it. The engine is taken turn by turn (``EngineTurns``): a call
holds it for one batch of requests and their rewards; the trainer's weight sync asks first and is served at the
next boundary, so weights change between requests, never inside one.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from moerl.engine import Request, SamplingParams
from moerl.envs.base import Problem, env_step, safe_call, safe_reward
from moerl.errors import ConfigError
from moerl.rollout.episode import Episode, drop_failed_groups, keep_informative
from moerl.run_config import RunConfig
from moerl.sync.weights import ADAPTER


class EngineTurns:
    """Who uses the engine now: generation takes it per call; ``priority`` (weight sync, evaluation) goes before any
    generation still waiting, and counts how long it waited."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy, self._asking = False, 0

    @contextmanager
    def turn(self, priority: bool = False):
        with self._cond:
            self._asking += priority
            self._cond.wait_for(lambda: not self._busy and (priority or not self._asking))
            self._asking -= priority
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


@dataclass(slots=True)
class StepRollouts:
    """What generation produced for one training step."""

    step: int
    episodes: list[Episode]  # the groups to train on
    samples: int  # samples generated in all (dropped groups included)
    gen_tokens: int  # completion tokens generated
    dropped_groups: int  # uninformative groups (dynamic sampling)
    failed_groups: int  # groups the engine failed
    seconds: float  # generation wall time


class Generator:
    """Turns problems into scored episodes on ``engine`` for the run ``cfg`` and environment ``env``."""

    def __init__(self, cfg: RunConfig, env, engine):
        self.cfg, self.env, self.engine = cfg, env, engine
        self.adapter = ADAPTER if cfg.policy.mode == "lora" else None
        self.turns = EngineTurns()

    def sampling(self, count: int, temperature: float, n: int, seed: int) -> list[SamplingParams]:
        """One SamplingParams per problem (seeds ``seed``, ``seed + 1``, ...), the rest from ``rollout``."""
        r = self.cfg.rollout
        return [
            SamplingParams(temperature=temperature, top_p=r.top_p, max_tokens=r.max_tokens, n=n, seed=seed + i)
            for i in range(count)
        ]

    def generate(
        self, problems: list[Problem], params: list[SamplingParams], first_group: int = 0, priority: bool = False
    ) -> list[Episode]:
        """``params[i].n`` samples of ``problems[i]``, scored, in groups ``first_group``, ``first_group + 1``, ...;
        ``priority``: before any generation waiting for the engine (evaluation while rollouts run ahead)."""
        if hasattr(self.env, "start"):
            return self._multi_turn(problems, params, first_group, priority)
        with self.turns.turn(priority):
            outs = self.engine.generate(
                [Request(p.prompt, sp, adapter=self.adapter) for p, sp in zip(problems, params, strict=True)]
            )
            episodes = []
            for g, (problem, out) in enumerate(zip(problems, outs, strict=True)):
                if out.error_kind == "rejected":
                    raise ConfigError(
                        f"rollout of {problem.prompt!r} failed: {out.error} (raise rollout.max_model_len?)"
                    )
                if out.error is not None:  # failed while running (non-finite logits): training drops the group
                    episodes += [Episode.failed(first_group + g, out.error)] * params[g].n
                    continue
                p = len(out.prompt_token_ids)
                for c in out.outputs:
                    reward, err = safe_reward(
                        self.env.reward, problem, c.text, timeout_s=self.cfg.algo.reward_timeout_s
                    )
                    episodes.append(
                        Episode(
                            first_group + g,
                            out.prompt_token_ids + c.token_ids,
                            p,
                            [0] * p + [1] * len(c.token_ids),
                            [0.0] * p + c.logprobs.tolist(),
                            c.routed_experts,
                            reward,
                            c.finish_reason,
                            err,
                            out.weight_version,
                        )
                    )
        return episodes

    def _multi_turn(
        self, problems: list[Problem], params: list[SamplingParams], first_group: int, priority: bool
    ) -> list[Episode]:
        """Episodes: the model speaks, the environment answers (its tokens are not trained on), until done. Each
        turn is one engine call; an episode keeps the oldest weight version of its turns."""
        env, tok = self.env, self.engine.tokenizer
        live = []  # (episode, environment state, sampling params, per-episode seed)
        for g, (problem, sp) in enumerate(zip(problems, params, strict=True)):
            for j in range(sp.n):
                ids = tok(problem.prompt)["input_ids"]
                ep = Episode(first_group + g, ids, len(ids), [0] * len(ids), [0.0] * len(ids), None, 0.0, "stop", None)
                ep.version = -1
                live.append((ep, env.start(problem), sp, sp.seed * 31 + j))
        episodes = [e for e, *_ in live]
        for turn in range(env.max_turns):
            if not live:
                break
            reqs = [
                Request(
                    e.tokens,
                    SamplingParams(temperature=sp.temperature, top_p=sp.top_p, max_tokens=sp.max_tokens, seed=s + turn),
                    adapter=self.adapter,
                )
                for e, _, sp, s in live
            ]
            still = []
            with self.turns.turn(priority):
                outs = self.engine.generate(reqs)
                for (e, state, sp, s), out in zip(live, outs, strict=True):
                    if out.error_kind == "rejected":  # the context filled up: the episode ends unfinished
                        e.reward, e.finish_reason = 0.0, "length"
                        continue
                    if out.error is not None:  # failed while running: its group is dropped and counted
                        e.reward, e.finish_reason, e.reward_error = 0.0, "error", out.error
                        continue
                    c = out.outputs[0]
                    e.tokens = e.tokens + c.token_ids
                    e.loss_mask += [1] * len(c.token_ids)
                    e.rollout_logprobs += c.logprobs.tolist()
                    e.routed, e.finish_reason = c.routed_experts, c.finish_reason
                    e.version = out.weight_version if e.version < 0 else min(e.version, out.weight_version)
                    # the environment's step runs in the reward worker, bounded by the reward timeout: one that raises
                    # or hangs ends the episode with reward 0, counted, and the run goes on
                    timeout = self.cfg.algo.reward_timeout_s
                    kind, value = safe_call(env_step, env, state, c.text, timeout_s=timeout)
                    if kind == "ok":
                        message, reward, state = value
                    else:
                        message, reward, e.reward_error = None, 0.0, kind
                    if message is None or turn == env.max_turns - 1:
                        e.reward = float(reward or 0.0)
                        continue
                    extra = tok(message, add_special_tokens=False)["input_ids"]
                    e.tokens = e.tokens + extra
                    e.loss_mask += [0] * len(extra)
                    e.rollout_logprobs += [0.0] * len(extra)
                    e.routed = None  # covered again by the next turn's request
                    still.append((e, state, sp, s))
            live = still
        for e in episodes:
            e.version = max(e.version, 0)
            if e.routed is not None and e.routed.shape[0] != len(e.tokens) - 1:
                e.routed = None  # the last turn did not cover the whole sequence: no replay rows for it
        return episodes

    def collect(self, step: int) -> StepRollouts:
        """The rollouts of training step ``step`` (0-based): ``prompts_per_step`` groups of ``group_size`` samples;
        problems and sampling seeds are a function of the run's seed and ``step`` alone."""
        cfg = self.cfg
        t0 = time.perf_counter()
        episodes, samples, gen_tokens, dropped, refills, failed = [], 0, 0, 0, 0, 0
        seed = cfg.train.seed * 1_000_003 + step
        while len({e.group for e in episodes}) < cfg.rollout.prompts_per_step:
            want = cfg.rollout.prompts_per_step - len({e.group for e in episodes})
            problems = self.env.problems(want, seed=seed * 101 + refills, split="train")
            params = self.sampling(len(problems), cfg.rollout.temperature, cfg.rollout.group_size,
                                   seed=(seed * 101 + refills) * 7919)  # fmt: skip
            new = self.generate(problems, params, first_group=len(episodes) and max(e.group for e in episodes) + 1)
            samples += len(new)
            new, n_failed = drop_failed_groups(new, step)
            failed += n_failed
            gen_tokens += sum(sum(e.loss_mask) for e in new)
            if cfg.algo.dynamic_sampling:
                new, n_dropped = keep_informative(new)
                dropped += n_dropped
            episodes += new
            refills += 1
            if not cfg.algo.dynamic_sampling or refills > cfg.algo.max_refills:
                break
        return StepRollouts(step, episodes, samples, gen_tokens, dropped, failed, time.perf_counter() - t0)

    def evaluate(self, sampled: bool = False) -> float:
        """Held-out accuracy on ``env.eval_problems`` test-split problems: greedy answers, or (``sampled``) the mean
        over 4 samples each at the rollout temperature."""
        cfg = self.cfg
        if cfg.env.eval_problems <= 0:
            return math.nan
        problems = self.env.problems(cfg.env.eval_problems, seed=cfg.train.seed, split="test")
        temperature, n = (cfg.rollout.temperature, 4) if sampled else (0.0, 1)
        params = self.sampling(len(problems), temperature, n, seed=10_007)
        episodes = self.generate(problems, params, priority=True)
        return sum(e.reward >= 1.0 for e in episodes) / len(episodes)
