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
from moerl.envs.base import Problem, draw, env_step, held_out, safe_call, wilson_interval
from moerl.envs.rewards import Scorer, answer_text
from moerl.errors import ConfigError
from moerl.rollout.agents import AgentRollouts
from moerl.rollout.episode import Episode, drop_failed_groups, groups, keep_informative
from moerl.rollout.prompts import Prompts
from moerl.run_config import AlgoSection, RolloutSection
from moerl.sync.weights import ADAPTER
from moerl.trainer.advantages import CUT


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
class Score:
    """An evaluation: ``correct`` of ``total`` answers (``problems`` distinct problems; 4 samples each when sampled)."""

    correct: int
    total: int
    problems: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else math.nan

    def metrics(self, prefix: str = "eval_accuracy") -> dict:
        """The metrics-file keys: the accuracy and, for one greedy answer per problem, its 95% interval and count."""
        if self.total != self.problems:  # several samples per problem are not independent trials: no interval
            return {prefix: self.accuracy}
        low, high = wilson_interval(self.correct, self.total)
        return {prefix: self.accuracy, f"{prefix}_low": low, f"{prefix}_high": high, "eval_problems": self.problems}


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
    reward_generated: float  # the mean reward of every sample generated (dropped groups included)
    informative_groups: int  # generated groups whose rewards differ: the only ones a group baseline learns from
    cut: int = 0  # samples the engine cut (finish "length": at max_tokens, or "context": at the context window)
    context_cut: int = 0  # of those, the ones the context window cut (rollout.max_model_len)


class Generator:
    """Turns problems into scored episodes on ``engine`` for the environment ``env``: sampling and the step's size
    from ``rollout``, reward timeout and dynamic sampling from ``algo``. Problems and sampling seeds are a function
    of the run's ``seed``; ``evaluate`` scores ``eval_problems`` held-out problems; ``lora``: requests use the
    trained adapter. ``scorer`` scores single-turn completions (default: the environment's own reward) and says
    what failed (``scorer.failures``); ``prompts`` makes the engine's prompts (default: the text as it is)."""

    def __init__(
        self,
        env,
        engine,
        rollout: RolloutSection,
        algo: AlgoSection,
        *,
        seed: int,
        eval_problems: int,
        lora: bool,
        scorer: Scorer | None = None,
        prompts: Prompts | None = None,
    ):
        self.env, self.engine = env, engine
        self.rollout, self.algo, self.seed, self.eval_problems = rollout, algo, seed, eval_problems
        self.adapter = ADAPTER if lora else None
        self.turns = EngineTurns()
        self.scorer = scorer or Scorer(env, [], algo.reward_timeout_s)
        self.prompts = prompts or Prompts(engine.tokenizer)
        self.agents = None  # an agent environment's rollouts: through the OpenAI server over the engine
        if hasattr(env, "run_episodes"):
            kwargs = self.prompts.chat.kwargs if self.prompts.chat is not None else None
            self.agents = AgentRollouts(engine, self.adapter, kwargs)

    def close(self) -> None:
        """Stop what the generator started (an agent environment's server); the engine is its owner's."""
        if self.agents is not None:
            self.agents.close()

    def sampling(self, count: int, temperature: float, n: int, seed: int) -> list[SamplingParams]:
        """One SamplingParams per problem (seeds ``seed``, ``seed + 1``, ...), the rest from ``rollout``."""
        r, stops = self.rollout, self.prompts.stop_token_ids
        return [
            SamplingParams(
                temperature=temperature,
                top_p=r.top_p,
                max_tokens=r.max_tokens,
                n=n,
                seed=seed + i,
                stop_token_ids=stops,
            )
            for i in range(count)
        ]

    def generate(
        self, problems: list[Problem], params: list[SamplingParams], first_group: int = 0, priority: bool = False
    ) -> list[Episode]:
        """``params[i].n`` samples of ``problems[i]``, scored, in groups ``first_group``, ``first_group + 1``, ...;
        ``priority``: before any generation waiting for the engine (evaluation while rollouts run ahead)."""
        if hasattr(self.env, "start"):
            return self._multi_turn(problems, params, first_group, priority)
        if self.agents is not None:  # the engine is the agents' alone (through the server) until they are done
            with self.turns.turn(priority):
                return self.agents.generate(self.env, problems, params, first_group, self.scorer.failures)
        pairs = zip(problems, params, strict=True)
        requests = [Request(self.prompts.request(p), sp, adapter=self.adapter) for p, sp in pairs]
        with self.turns.turn(priority):
            outs = self.engine.generate(requests)
            scored = [(problem, out) for problem, out in zip(problems, outs, strict=True) if out.error is None]
            # one round trip to the reward worker per reward function for the whole call
            rewards = iter(self.scorer.score([(problem, c.text) for problem, out in scored for c in out.outputs]))
            episodes = []
            for g, (problem, out) in enumerate(zip(problems, outs, strict=True)):
                if out.error_kind == "rejected":
                    hint = " (raise rollout.max_model_len?)" if out.prompt_token_ids else ""  # not an empty one
                    raise ConfigError(f"rollout of {problem.prompt!r} failed: {out.error}{hint}")
                if out.error is not None:  # failed while running (non-finite logits): training drops the group
                    episodes += [Episode.failed(first_group + g, out.error)] * params[g].n
                    continue
                episodes += self._episodes(out, first_group + g, rewards)
        return episodes

    @staticmethod
    def _episodes(out, group: int, rewards) -> list[Episode]:
        """The episodes of one problem's completions (single-turn), each with the next of ``rewards``."""
        p = len(out.prompt_token_ids)
        episodes = []
        for c in out.outputs:
            reward, err = next(rewards)
            episodes.append(
                Episode(
                    group,
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
        live = self._start_episodes(problems, params, first_group)
        episodes = [e for e, *_ in live]
        for turn in range(self.env.max_turns):
            if not live:
                break
            reqs = [self._turn_request(e, sp, s + turn) for e, _, sp, s, _ in live]
            still = []
            with self.turns.turn(priority):
                outs = self.engine.generate(reqs)
                for (e, state, sp, s, problem), out in zip(live, outs, strict=True):
                    goes_on, state = self._take_turn(e, state, out, problem, last=turn == self.env.max_turns - 1)
                    if goes_on:
                        still.append((e, state, sp, s, problem))
            live = still
        for e in episodes:
            e.version = max(e.version, 0)
            if e.routed is not None and e.routed.shape[0] != len(e.tokens) - 1:
                e.routed = None  # the last turn did not cover the whole sequence: no replay rows for it
        return episodes

    def _start_episodes(self, problems: list[Problem], params: list[SamplingParams], first_group: int) -> list:
        """One live episode per sample: (episode holding the prompt, environment state, sampling params, the
        episode's seed, its problem); versions -1 until a turn sets them."""
        live = []
        for g, (problem, sp) in enumerate(zip(problems, params, strict=True)):
            for j in range(sp.n):
                ids = self.prompts.ids(problem)
                ep = Episode(first_group + g, ids, len(ids), [0] * len(ids), [0.0] * len(ids), None, 0.0, "stop", None)
                ep.version = -1
                live.append((ep, self.env.start(problem), sp, sp.seed * 31 + j, problem))
        return live

    def _turn_request(self, e: Episode, sp: SamplingParams, seed: int) -> Request:
        """The next turn of episode ``e``: one completion of its tokens so far."""
        return Request(
            e.tokens,
            SamplingParams(
                temperature=sp.temperature,
                top_p=sp.top_p,
                max_tokens=sp.max_tokens,
                seed=seed,
                stop_token_ids=sp.stop_token_ids,
            ),
            adapter=self.adapter,
        )

    def _take_turn(self, e: Episode, state, out, problem: Problem, last: bool) -> tuple[bool, object]:
        """Episode ``e`` after one turn's engine output ``out``: the model's tokens appended (trained on), then the
        environment's answer (not trained on). Returns whether the episode goes on, and the environment's state."""
        if out.error_kind == "rejected" and out.prompt_token_ids:  # the context filled up: the episode ends unfinished
            e.reward, e.finish_reason = 0.0, "context"
            return False, state
        if out.error is not None:  # failed while running: its group is dropped and counted
            e.reward, e.finish_reason, e.reward_error = 0.0, "error", out.error
            return False, state
        c = out.outputs[0]
        e.tokens = e.tokens + c.token_ids
        e.loss_mask += [1] * len(c.token_ids)
        e.rollout_logprobs += c.logprobs.tolist()
        e.routed, e.finish_reason = c.routed_experts, c.finish_reason
        e.version = out.weight_version if e.version < 0 else min(e.version, out.weight_version)
        message, reward, state = self._env_step(e, state, c.text, problem)
        if message is None or last:
            e.reward = float(reward or 0.0)
            return False, state
        extra = self.prompts.turn(message, c.token_ids)
        e.tokens = e.tokens + extra
        e.loss_mask += [0] * len(extra)
        e.rollout_logprobs += [0.0] * len(extra)
        e.routed = None  # covered again by the next turn's request
        return True, state

    def _env_step(self, e: Episode, state, text: str, problem: Problem) -> tuple[str | None, float | None, object]:
        """The environment's answer to ``text``: (message, reward, new state). The step runs in the reward worker,
        bounded by the reward timeout: one that raises or hangs ends the episode with reward 0, counted in
        ``e.reward_error``, and the run goes on."""
        text = answer_text(text, self.scorer.reasoning)
        kind, value = safe_call(env_step, self.env, state, text, timeout_s=self.algo.reward_timeout_s)
        if kind == "ok":
            return value
        e.reward_error = kind
        name = f"environment {getattr(self.env, 'name', type(self.env).__name__)}'s step"
        self.scorer.failures.add(name, problem, kind, value, "the episode ends with reward 0")
        return None, 0.0, state

    def room(self) -> str | None:
        """Whether the environment's prompts leave ``rollout.max_tokens`` of room in the context window, read from
        the first step's prompts and the held-out ones, tokenized as the engine does: a ConfigError where the
        longest leaves none, a warning (returned, to be said once) naming the numbers where completions will be cut
        at the context window, None where every one fits."""
        r = self.rollout
        problems = draw(self.env, r.prompts_per_step, self.seed * 1_000_003 * 101, "train")
        if self.eval_problems > 0:
            problems += held_out(self.env, self.eval_problems, seed=self.seed)
        if not hasattr(self.env, "start") and self.agents is None:
            self.scorer.check(problems[0])  # reward functions that cannot take the records' fields: refused now
        if self.engine.tokenizer is None:
            return None
        longest = max(len(self.prompts.ids(p)) for p in problems)
        need = longest + r.max_tokens
        if longest >= r.max_model_len:
            raise ConfigError(
                f"config key 'rollout.max_model_len'={r.max_model_len}: the environment's prompts run to {longest} "
                f"tokens (the longest of {len(problems)} sampled), which leaves no room for a completion; raise it "
                f"to at least {need} (prompt + rollout.max_tokens={r.max_tokens})"
            )
        if need <= r.max_model_len:
            return None
        return (
            f"moerl: rollout.max_model_len={r.max_model_len} leaves the longest of {len(problems)} prompts sampled "
            f"({longest} tokens) room for {r.max_model_len - longest} of rollout.max_tokens={r.max_tokens}: "
            "completions that reach it are cut at the context window (finish reason 'context'; metrics cut_frac, "
            f"context_cut_frac); {need} gives every completion its max_tokens"
        )

    def collect(self, step: int) -> StepRollouts:
        """The rollouts of training step ``step`` (0-based): ``prompts_per_step`` groups of ``group_size`` samples;
        problems and sampling seeds are a function of the run's seed and ``step`` alone."""
        r, algo = self.rollout, self.algo
        t0 = time.perf_counter()
        episodes, samples, gen_tokens, dropped, refills, failed = [], 0, 0, 0, 0, 0
        rewards, informative, cut, context_cut = [], 0, 0, 0
        seed = self.seed * 1_000_003 + step
        while len({e.group for e in episodes}) < r.prompts_per_step:
            want = r.prompts_per_step - len({e.group for e in episodes})
            problems = draw(self.env, want, seed * 101 + refills, "train")
            params = self.sampling(len(problems), r.temperature, r.group_size, seed=(seed * 101 + refills) * 7919)
            new = self.generate(problems, params, first_group=len(episodes) and max(e.group for e in episodes) + 1)
            samples += len(new)
            new, n_failed = drop_failed_groups(new, step)
            failed += n_failed
            gen_tokens += sum(sum(e.loss_mask) for e in new)
            cut += sum(e.finish_reason in CUT for e in new)
            context_cut += sum(e.finish_reason == "context" for e in new)
            rewards += [e.reward for e in new]
            informative += sum(len({e.reward for e in g}) > 1 for g in groups(new).values())
            if algo.dynamic_sampling:
                new, n_dropped = keep_informative(new)
                dropped += n_dropped
            episodes += new
            refills += 1
            if not algo.dynamic_sampling or refills > algo.max_refills:
                break
        seconds, reward = time.perf_counter() - t0, sum(rewards) / len(rewards) if rewards else math.nan
        return StepRollouts(
            step, episodes, samples, gen_tokens, dropped, failed, seconds, reward, informative, cut, context_cut
        )

    def evaluate(self, sampled: bool = False) -> Score:
        """Held-out accuracy on up to ``eval_problems`` distinct test-split problems: greedy answers, or
        (``sampled``) 4 samples each at the rollout temperature."""
        if self.eval_problems <= 0:
            return Score(0, 0, 0)
        problems = held_out(self.env, self.eval_problems, seed=self.seed)
        temperature, n = (self.rollout.temperature, 4) if sampled else (0.0, 1)
        params = self.sampling(len(problems), temperature, n, seed=10_007)
        episodes = self.generate(problems, params, priority=True)
        return Score(sum(e.reward >= 1.0 for e in episodes), len(episodes), len(problems))
