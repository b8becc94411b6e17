"""verifiers environments (0.4, ``verifiers.v1``) trained through moerl's OpenAI server: a single-turn taskset and a
two-turn env of verifiers' own kind, built here from small in-memory data, their own rewards scoring the episodes.
What a sample trains on is the engine's tokens for the agent's requests, joined by the trace's session id: the
rendered prompts are the tokenizer's (the oracle: its chat template), the logprobs transformers' forward of those
tokens (fp32, 1e-4), the rewards the task's rule re-applied to the decoded replies; training with R3 keeps the
engine / trainer mismatch k3 <= 1e-6 (fp32); what is wrong in the config is named."""

import json
import shutil
import sys

import pytest
import torch
from run_helpers import metric_rows, run_cfg
from transformers import AutoModelForCausalLM, AutoTokenizer

from moerl.config import load_config
from moerl.engine import EngineConfig, LLMEngine, SamplingParams
from moerl.envs import make_env
from moerl.errors import ConfigError
from moerl.loop import train
from moerl.rollout.agents import AgentRollouts
from moerl.run_config import RunConfig

# a chat that is the text itself: the warmed model's prompts ("3+4=") are its conversations, an answer ends in <eos>
TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content + eos_token }}"
    "{%- else %}{{ m.content }}{%- endif %}{%- endfor %}"
)

# sums of two digits 0..4, the warmed model's task: four tasks, so a rise in reward is learning, not luck; the env
# plays each as two turns (the sum, then the same sum reversed), scored by the fraction answered right
TASKS = """
import verifiers.v1 as vf

PAIRS = [(0, 4), (1, 2), (3, 1), (2, 2)]


class SumData(vf.TaskData):
    answer: str
    second: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [(m.content or "").strip() for m in trace.assistant_messages]
        return sum(r == self.data.answer for r in replies) / (2 if self.data.second else 1)


class {name}(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"{{a}}+{{b}}=", answer=str(a + b), second=f"{{b}}+{{a}}=" if {two} else ""))
                for a, b in PAIRS]
"""
TWO_TURNS = """

class TwoTurnsConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurns(vf.Env[TwoTurnsConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as it:
            await it.turn()
            await it.turn(task.data.second)
"""


@pytest.fixture(scope="module")
def chat_warm(warm_model, tmp_path_factory):
    """The warmed model with a chat template on its tokenizer."""
    out = tmp_path_factory.mktemp("vf") / "warm"
    shutil.copytree(warm_model, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    """Two verifiers modules on sys.path: ``sums_one`` (a taskset) and ``sums_two`` (a taskset and its two-turn env)."""
    (tmp_path / "sums_one.py").write_text(TASKS.format(name="SumsOne", two=False) + '\n__all__ = ["SumsOne"]\n')
    two = TASKS.format(name="SumsTwo", two=True) + TWO_TURNS + '\n__all__ = ["SumsTwo", "TwoTurns"]\n'
    (tmp_path / "sums_two.py").write_text(two)
    bad = TASKS.format(name="SumsBad", two=False).replace(
        "        replies =", "        raise ValueError('the grader broke')\n        replies ="
    )
    (tmp_path / "sums_bad.py").write_text(bad + '\n__all__ = ["SumsBad"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("sums_one", "sums_two", "sums_bad"):
        sys.modules.pop(name, None)


class Said:
    def __init__(self):
        self.lines = []

    def add(self, *args):
        self.lines.append(args)


def _segments(e) -> list[list[int]]:
    """The runs of masked (the model's own) tokens of an episode."""
    out, cur = [], []
    for t, m in zip(e.tokens, e.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("taskset", ["sums_one", "sums_two"])
def test_episodes_are_the_engines_tokens_for_the_agents_requests_scored_by_the_tasks_rewards(
    chat_warm, tasksets, taskset
):
    tok = AutoTokenizer.from_pretrained(chat_warm)
    hf = AutoModelForCausalLM.from_pretrained(chat_warm, dtype=torch.float32).eval()
    engine = LLMEngine(chat_warm, EngineConfig(max_num_seqs=32, max_model_len=32), dtype=torch.float32)
    env = make_env("verifiers", taskset=taskset, test_fraction=0.0)
    problems = env.problems(4, seed=0)
    params = [SamplingParams(temperature=1.0, max_tokens=3, n=4, seed=10 * i) for i in range(4)]
    agents, said = AgentRollouts(engine, None), Said()
    try:
        episodes = agents.generate(env, problems, params, 0, said)
    finally:
        agents.close()
    assert not said.lines and sorted({e.group for e in episodes}) == [0, 1, 2, 3]
    eos = tok.eos_token_id
    for e in episodes:
        data = env.tasks[problems[e.group].meta["task"]].data
        assert e.tokens[: e.num_prompt] == tok(data.prompt)["input_ids"]  # the template renders the text as it is
        replies = [tok.decode([t for t in seg if t != eos]).strip() for seg in _segments(e)]
        turns = [data.prompt] + ([data.second] if data.second else [])
        if len(replies) == len(turns):  # one chain: the whole conversation, the env's turn not trained on
            text = "".join(p + tok.decode(seg) + ("" if seg[-1] == eos else tok.eos_token)
                           for p, seg in zip(turns, _segments(e), strict=True))  # fmt: skip
            assert tok.decode(e.tokens) == text.removesuffix(tok.eos_token if _segments(e)[-1][-1] != eos else "")
            assert e.reward == sum(r == data.answer for r in replies) / len(turns)  # the task's rule, re-applied
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([e.tokens])).logits[0, :-1].float(), -1)
        want = logp.gather(1, torch.tensor(e.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
        got = torch.tensor(e.rollout_logprobs[1:])
        assert torch.allclose(got[mask], want[mask], atol=1e-4)
        assert e.routed is not None and e.routed.shape[0] == len(e.tokens) - 1
    if taskset == "sums_two":  # the env's second turn joined the model's first: some episodes hold both
        assert any(len(_segments(e)) == 2 for e in episodes)


def test_a_reward_that_raises_is_said_with_its_task_and_the_sample_scores_0(chat_warm, tasksets):
    engine = LLMEngine(chat_warm, EngineConfig(max_num_seqs=8, max_model_len=32), dtype=torch.float32)
    env = make_env("verifiers", taskset="sums_bad", test_fraction=0.0)
    agents, said = AgentRollouts(engine, None), Said()
    try:
        problems = env.problems(2, seed=0)
        episodes = agents.generate(env, problems, [SamplingParams(max_tokens=3, n=2, seed=1)] * 2, 0, said)
    finally:
        agents.close()
    assert len(episodes) == 4 and all(e.reward == 0.0 and e.reward_error == "error" for e in episodes)
    what, problem, kind, detail, outcome = said.lines[0]
    assert what == "verifiers rollout" and problem.where in {p.where for p in problems}
    assert "the grader broke" in detail and outcome == "the sample scores 0", said.lines


@pytest.mark.parametrize("taskset,steps", [("sums_one", 8), ("sums_two", 3)])
def test_a_verifiers_environment_trains_through_the_server_with_r3_and_no_mismatch(
    chat_warm, tasksets, tmp_path, taskset, steps
):
    cfg = run_cfg(tmp_path / "run", chat_warm, "full", steps=steps, **{
        "env.name": "verifiers", "env.kwargs": json.dumps({"taskset": taskset, "test_fraction": 0}),
        "env.eval_problems": 0, "policy.optim.lr": 1e-3, "rollout.prompts_per_step": 4, "rollout.max_model_len": 32,
    })  # fmt: skip
    train(cfg)
    rows = [r for r in metric_rows(tmp_path / "run") if "reward_mean" in r]
    assert len(rows) == steps
    assert all(r["mismatch_k3_r3"] <= 1e-6 for r in rows), [r["mismatch_k3_r3"] for r in rows]
    if taskset == "sums_one":
        rewards = [r["reward_mean"] for r in rows]
        assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


@pytest.mark.parametrize(
    "kwargs,over,message",
    [
        ({"taskset": "no_such_taskset"}, {}, r"'env.kwargs.taskset': verifiers cannot load it: taskset 'no_such_tasks"),
        ({"taskset": "sums_one", "config": {"agent": {"harness": {"id": "no_such_harness"}}}}, {},
         r"verifiers cannot load it: harness 'no_such_harness' not found"),
        ({"taskset": "sums_one", "config": {"agent": {"max_turns": "many"}}}, {},
         r"'env.kwargs.config.agent.max_turns': verifiers refuses it: Input should be a valid integer"),
        ({"taskset": "sums_one", "test_fraction": 1.5}, {}, r"'env.kwargs.test_fraction'=1.5: must lie in \[0, 1\)"),
        ({"taskset": "sums_one"}, {"env.rewards": "[{fn: x.py:f, weight: 1}]"},
         r"'env.rewards': environment 'verifiers' scores its own episodes"),
        ({"taskset": "sums_one"}, {"env.reasoning_tags": '["<think>", "</think>"]'},
         r"'env.reasoning_tags'=\['<think>', '</think>'\]: environment 'verifiers' runs agents"),
        ({"taskset": "sums_one"}, {"env.chat.system": "Be brief."},
         r"'env.chat.system'='Be brief.': environment 'verifiers' runs agents"),
    ],
)  # fmt: skip
def test_what_is_wrong_in_a_verifiers_config_is_named(tasksets, kwargs, over, message):
    with pytest.raises(ConfigError, match=message):
        over = {"env.name": "verifiers", "env.kwargs": json.dumps(kwargs)} | over
        make_env("verifiers", **load_config(RunConfig, None, [f"{k}={v}" for k, v in over.items()]).env.kwargs)


def test_without_verifiers_installed_the_package_is_named(tasksets, monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"needs the verifiers package: pip install 'moerl\[verifiers\]'"):
        make_env("verifiers", taskset="sums_one")
