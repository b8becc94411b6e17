"""Chat templates: prompts and multi-turn episodes token for token as transformers' ``apply_chat_template`` renders
them (the oracle), the engine stopping on the template's end of turn, rewards that do not see the reasoning."""

import pytest
import torch
from chat_tokenizer import build_chat_tokenizer, chat_model

from moerl.chat import ChatTemplate
from moerl.engine import EngineConfig, LLMEngine
from moerl.envs import ArithmeticEnv, Problem, make_env
from moerl.envs.rewards import RewardFn, Scorer, answer_text
from moerl.errors import ConfigError
from moerl.rollout.generator import Generator
from moerl.rollout.prompts import Prompts
from moerl.run_config import AlgoSection, RolloutSection

SYSTEM = "You are a careful assistant."
DATED = {"date_string": "6 December 2026"}
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def oracle(tok, messages, **kwargs) -> list[int]:
    """transformers' tokens of a conversation and the generation prompt."""
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs)


def sys_user(text: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prompts_are_apply_chat_templates_tokens_with_the_system_prompt_and_kwargs(tok):
    for kwargs in (NO_THINKING, DATED, NO_THINKING | DATED):
        chat = ChatTemplate(tok, SYSTEM, kwargs)
        assert chat.prompt_ids("What is 12 + 7?") == oracle(tok, sys_user("What is 12 + 7?"), **kwargs)
        own = sys_user("What is 12 + 7?", system="Answer in words.")  # a prompt with its own system message keeps it
        assert chat.prompt_ids(own) == oracle(tok, own, **kwargs)
        assert chat.prompt_ids(own[1:]) == oracle(tok, sys_user("What is 12 + 7?"), **kwargs)
    # negative controls: the comparison sees a kwarg dropped and the system prompt dropped
    want = oracle(tok, sys_user("What is 12 + 7?"), **NO_THINKING)
    assert ChatTemplate(tok, SYSTEM).prompt_ids("What is 12 + 7?") != want
    assert ChatTemplate(tok, None, NO_THINKING).prompt_ids("What is 12 + 7?") != want
    assert ChatTemplate(tok, SYSTEM, NO_THINKING).end_of_turn == [tok.convert_tokens_to_ids("<|im_end|>")]


def _episode(chat, tok, prompt: str, turns: list[tuple[str, bool, str]]) -> list[int]:
    """An episode as the generator builds it: the prompt, then per turn the model's tokens (with its end-of-turn
    token where it ``ended`` the turn) and the environment's message."""
    out = chat.prompt_ids(prompt)
    for answer, ended, message in turns:
        model = ids(tok, answer) + (chat.end_of_turn if ended else [])
        out += model + chat.next_turn(message, ended)
    return out


def test_a_multi_turn_episode_is_apply_chat_templates_tokens_of_its_conversation(tok):
    """Turns the model ended itself and a turn cut at max_tokens (the template's end of turn is added for it)."""
    turns = [("It is 19.", True, "Check it once more."), ("Yes, 19", False, "Thanks. And 19 + 1?")]
    conversation = sys_user("What is 12 + 7?")
    for answer, _, message in turns:
        conversation += [{"role": "assistant", "content": answer}, {"role": "user", "content": message}]
    want = oracle(tok, conversation, **DATED)
    assert _episode(ChatTemplate(tok, SYSTEM, DATED), tok, "What is 12 + 7?", turns) == want
    # negative control: the same episode with the template's kwarg dropped
    assert _episode(ChatTemplate(tok, SYSTEM), tok, "What is 12 + 7?", turns) != want


def test_a_template_that_drops_earlier_reasoning_renders_each_new_turn_as_its_own_tokens(tok):
    """The template drops the reasoning of answers before the last user turn, and enable_thinking=False opens each
    model turn with an empty reasoning block: the episode keeps the model's own tokens, and every turn the
    environment adds is the template's tokens for that turn (the tail of apply_chat_template's conversation)."""
    chat = ChatTemplate(tok, SYSTEM, NO_THINKING)
    prompt = chat.prompt_ids("What is 12 + 7?")
    assert prompt == oracle(tok, sys_user("What is 12 + 7?"), **NO_THINKING)
    answer = ids(tok, "19") + chat.end_of_turn
    turn = chat.next_turn("Sure?", ended=True)
    conversation = sys_user("What is 12 + 7?") + [
        {"role": "assistant", "content": "<think>\n\n</think>\n\n19"},
        {"role": "user", "content": "Sure?"},
    ]
    full = oracle(tok, conversation, **NO_THINKING)
    assert full[-len(turn) :] == turn and tok.decode(turn).startswith("\n<|im_start|>user\nSure?")
    assert tok.decode(turn).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the kwarg, every turn
    assert full != prompt + answer + turn  # the template rewrote the earlier answer; the episode keeps it as it was


def test_template_less_tokenizers_and_kwargs_the_template_does_not_read_are_refused(tok, tmp_path):
    from transformers import AutoTokenizer

    from moerl.config import load_config
    from moerl.run_config import RunConfig
    from moerl.tokenizer import save_tokenizer

    save_tokenizer(tmp_path / "char")
    with pytest.raises(ConfigError, match="'env.chat.template'=true: the tokenizer of ckpt has no chat template"):
        ChatTemplate(AutoTokenizer.from_pretrained(tmp_path / "char"), where="ckpt")
    with pytest.raises(ConfigError, match=r"'env.chat.kwargs.enable_thinkin': the chat template of the model does not"):
        ChatTemplate(tok, kwargs={"enable_thinkin": False})
    with pytest.raises(ConfigError, match=r"'env.chat.kwargs.add_generation_prompt': moerl sets it"):
        ChatTemplate(tok, kwargs={"add_generation_prompt": False})
    with pytest.raises(ConfigError, match=r"the random model \(model.path unset\) has moerl's character tokenizer"):
        load_config(RunConfig, None, ["env.chat.template=true"])


def test_moerl_train_asked_for_chat_prompts_with_a_template_less_tokenizer_says_so(warm_model, tmp_path, capsys):
    from moerl.cli import main

    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", f"model.path={warm_model}", "env.chat.template=true"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"moerl: error: config key 'env.chat.template'=true: the tokenizer of {warm_model} has no chat template (its "
        "tokenizer_config.json or chat_template.jinja); use text prompts (env.chat.template: false)\n"
    )
    assert not run.exists() or not any(run.iterdir())


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    path = chat_model(tmp_path_factory.mktemp("chat") / "model", seed=0)
    return LLMEngine(path, EngineConfig(max_num_seqs=64, max_model_len=160), dtype=torch.float32)


def _generator(env, engine, chat, max_tokens=64):
    rollout = RolloutSection(max_tokens=max_tokens, max_model_len=160, temperature=1.0)
    algo = AlgoSection(reward_timeout_s=30)
    prompts = Prompts(engine.tokenizer, chat)
    return Generator(env, engine, rollout, algo, seed=0, eval_problems=0, lora=False, prompts=prompts)


def test_the_engine_gets_the_templates_tokens_and_stops_on_its_end_of_turn(chat_engine):
    """A random model samples ``<|im_end|>`` now and then: with the template the turn ends there (the tokenizer's own
    end of sequence is another token); with text prompts (negative control) the engine runs past it."""
    tok = chat_engine.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    problems = [Problem([{"role": "user", "content": "What is 12 + 7?"}], 19), Problem("Calculate 6 * 9.", 54)]
    chat = ChatTemplate(tok, SYSTEM, NO_THINKING)
    gen = _generator(ArithmeticEnv(), chat_engine, chat)
    episodes = gen.generate(problems, gen.sampling(2, 1.0, 48, seed=1))
    want = [
        oracle(tok, sys_user("What is 12 + 7?"), **NO_THINKING),
        oracle(tok, sys_user("Calculate 6 * 9."), **NO_THINKING),
    ]
    assert [e.tokens[: e.num_prompt] for e in episodes] == [want[0]] * 48 + [want[1]] * 48
    done = [e.tokens[e.num_prompt :] for e in episodes]
    assert all(end not in t[:-1] for t in done)
    ended = [e for t, e in zip(done, episodes, strict=True) if t[-1] == end]
    assert ended and all(e.finish_reason == "stop" for e in ended)
    plain = _generator(ArithmeticEnv(), chat_engine, None)
    texts = [Problem(tok.decode(w), 0) for w in want]  # the same tokens, as text the engine tokenizes
    runs_past = [
        e for e in plain.generate(texts, plain.sampling(2, 1.0, 48, seed=1)) if end in e.tokens[e.num_prompt : -1]
    ]
    assert runs_past


ECHO = '''
class Echo:
    """Multi-turn: the environment asks again twice, then scores 1."""

    name = "echo"
    max_turns = 3

    def problems(self, n, seed, split="train"):
        from moerl.envs import Problem

        return [Problem("Say a number.", 0)] * n

    def start(self, problem):
        return [0]

    def step(self, state, completion):
        state[0] += 1
        return ("Once more, please.", None) if state[0] < 3 else (None, 1.0)
'''


def test_a_multi_turn_environment_from_a_file_gets_every_turn_rendered_by_the_template(chat_engine, tmp_path):
    tok = chat_engine.tokenizer
    (tmp_path / "echo.py").write_text(ECHO)
    env = make_env(f"{tmp_path / 'echo.py'}:Echo")
    chat = ChatTemplate(tok, SYSTEM, NO_THINKING)
    gen = _generator(env, chat_engine, chat, max_tokens=12)
    episodes = gen.generate(env.problems(1, seed=0), gen.sampling(1, 1.0, 8, seed=3))
    assert len(episodes) == 8 and all(e.reward == 1.0 for e in episodes)
    for e in episodes:
        # the segments: prompt, then alternately the model's tokens (trained on) and the environment's (not)
        spans, start = [], 0
        for i in range(1, len(e.tokens) + 1):
            if i == len(e.tokens) or e.loss_mask[i] != e.loss_mask[start]:
                spans.append((e.loss_mask[start], e.tokens[start:i]))
                start = i
        assert [m for m, _ in spans] == [0, 1, 0, 1, 0, 1]
        assert spans[0][1] == oracle(tok, sys_user("Say a number."), **NO_THINKING)
        conversation = sys_user("Say a number.")
        for (_, model), (_, env_turn) in zip(spans[1::2], spans[2::2], strict=False):
            assert not set(model[:-1]) & set(chat.end_of_turn)  # each turn stops on the template's end of turn
            content = tok.decode(model[:-1] if model[-1] in chat.end_of_turn else model)
            conversation += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": "Once more, please."},
            ]
            full = oracle(tok, conversation, **NO_THINKING)
            assert full[-len(env_turn) :] == env_turn  # the template's own tokens for the turn the environment added
            closing = "\n" if model[-1] in chat.end_of_turn else "<|im_end|>\n"
            assert tok.decode(env_turn).startswith(closing + "<|im_start|>user\nOnce more, please.<|im_end|>\n")


def _exactly_19(completion: str, **fields) -> float:
    return 1.0 if completion.strip() == "19" else 0.0


@pytest.mark.parametrize(
    "completion,answer",
    [
        ("<think>\n12 + 7 is 19\n</think>\n\n19", "\n\n19"),  # reasoned, then answered
        ("<think>\n12 + 7 is", ""),  # cut while it reasoned: no answer
        ("19", "19"),  # did not reason
        ("<think>a</think>x<think>b</think>19", "19"),  # the answer after the last block
    ],
)
def test_rewards_see_the_answer_without_the_reasoning_block(completion, answer):
    assert answer_text(completion, ("<think>", "</think>")) == answer
    assert answer_text(completion, None) == completion
    problem = Problem("What is 12 + 7?", 19)
    fns = [RewardFn("_exactly_19", _exactly_19, 1.0)]
    scored = Scorer(ArithmeticEnv(), fns, timeout_s=30, reasoning=("<think>", "</think>")).score(
        [(problem, completion)]
    )
    assert scored == [(1.0 if answer.strip() == "19" else 0.0, None)]
    if "<think>" in completion:  # negative control: without the tags the reward sees the reasoning and refuses it
        assert Scorer(ArithmeticEnv(), fns, timeout_s=30).score([(problem, completion)]) == [(0.0, None)]
