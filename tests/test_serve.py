"""The OpenAI-compatible server over the engine, driven by the official ``openai`` client (the oracle of the
protocol): chat and text completions whose token ids and logprobs are the model's own (transformers' forward is the
oracle, fp32, 1e-4), conversations rendered as ``apply_chat_template`` renders them, 64 concurrent requests each
answered with its own prompt, bad requests answered with OpenAI errors while the server keeps serving, and a weight
sync that no request sees half of."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import torch
from chat_tokenizer import build_chat_tokenizer, chat_model
from run_helpers import random_adapter
from transformers import AutoModelForCausalLM

from moerl.engine import EngineConfig, LLMEngine
from moerl.serve import Batcher, Listening, OpenAIServer

NAME = "tiny-chat"
WINDOW = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("serve") / "ckpt")


@pytest.fixture(scope="module")
def served(ckpt):
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=64, max_model_len=WINDOW), dtype=torch.float32)
    seen = []
    server = OpenAIServer(engine, NAME, batcher=Batcher(engine, on_output=lambda r, o: seen.append((r, o))))
    listening = Listening(server.app)
    yield server, listening, seen
    listening.close()
    server.batcher.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def model_logprobs(hf, prompt: list[int], completion: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice and the log-probability of each completion token, given what precedes it."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].float(), -1)[len(prompt) - 1 : -1]
    return logp.argmax(-1).tolist(), logp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the sum of twelve and seven?"},
]


def test_a_chat_completion_is_the_models_greedy_answer_to_the_rendered_conversation(client, hf):
    tok = build_chat_tokenizer()
    r = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    body = r.model_dump()
    prompt, (choice,) = body["prompt_token_ids"], body["choices"]
    assert prompt == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    ids = choice["token_ids"]
    greedy, logprobs = model_logprobs(hf, prompt, ids)
    assert ids == greedy and 0 < len(ids) <= 12
    got = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4
    assert [c["token"] for c in choice["logprobs"]["content"]] == [tok.decode([t]) for t in ids]
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    assert r.choices[0].message.role == "assistant" and r.model == NAME
    end = tok.convert_tokens_to_ids("<|im_end|>")  # the template's end of turn stops it; otherwise the length does
    assert (choice["finish_reason"], ids[-1] == end) in {("stop", True), ("length", False)}
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)


def test_chat_template_kwargs_reach_the_template_and_a_wrong_one_is_refused(client):
    tok = build_chat_tokenizer()
    r = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES[1:],
        max_tokens=2,
        temperature=0,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    want = tok.apply_chat_template(MESSAGES[1:], add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert r.model_dump()["prompt_token_ids"] == want
    assert want != tok.apply_chat_template(MESSAGES[1:], add_generation_prompt=True, return_dict=False)  # control
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.enable_thinkng: the chat template"):
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinkng": False}}
        )


def test_text_completions_of_text_and_of_token_ids_with_their_logprobs(client, hf):
    tok = build_chat_tokenizer()
    text = "12 + 7 ="
    r = client.completions.create(
        model=NAME, prompt=text, max_tokens=6, temperature=0, logprobs=0, extra_body={"return_token_ids": True}
    )
    choice = r.model_dump()["choices"][0]
    prompt, ids = choice["prompt_token_ids"], choice["token_ids"]
    assert prompt == tok(text)["input_ids"]
    greedy, logprobs = model_logprobs(hf, prompt, ids)
    assert ids == greedy and len(ids) == 6 and choice["finish_reason"] == "length"
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], logprobs, strict=True)) < 1e-4
    assert r.choices[0].text == tok.decode(ids, skip_special_tokens=True)
    # token in: the same ids as the prompt give the same tokens; two prompts and n=2 give four choices in order
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
    assert again.choices[0].text == r.choices[0].text
    many = client.completions.create(
        model=NAME, prompt=[text, "40 - 18 ="], max_tokens=3, n=2, temperature=1.0, seed=5,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompts = [c["prompt_token_ids"] for c in many.model_dump()["choices"]]
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert prompts == [prompt, prompt, tok("40 - 18 =")["input_ids"], tok("40 - 18 =")["input_ids"]]


def test_a_stream_is_the_same_text_in_pieces_with_the_finish_reason_and_usage(client):
    """``stream: true`` (as agent harnesses ask): the pieces add up to the whole response's text for the same seeded
    request, chat (role first) and text, a stop string cut off as the whole response cuts it; a refused request is
    an error status, not a stream."""
    ask = dict(model=NAME, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=3)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len([c for c in chunks if c.choices]) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = dict(model=NAME, prompt="12 + 7 = 19\n40 - 18 =", max_tokens=16, temperature=1.0, seed=4)
    full = client.completions.create(**plain).choices[0].text
    stop = full[3:6]  # a stop string inside what it would write: the text ends before it
    cut = client.completions.create(**plain, stop=[stop]).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**plain, stop=[stop], stream=True))
    assert streamed == cut == full[: full.index(stop)] and len(cut) < len(full)
    with pytest.raises(openai.BadRequestError, match="does not fit the context window"):
        client.chat.completions.create(**ask | {"messages": [{"role": "user", "content": "x " * 200}]}, stream=True)


def test_models_lists_the_served_model(client, served):
    (card,) = client.models.list().data
    assert card.id == NAME and card.owned_by == "moerl"
    assert httpx.get(served[1].url.removesuffix("/v1") + "/health").status_code == 200


def test_64_concurrent_requests_are_all_answered_each_with_its_own_prompt(client, served):
    tok = build_chat_tokenizer()
    server = served[0]
    calls = server.batcher.calls

    def ask(i: int):
        messages = [{"role": "user", "content": f"Calculate {i} + {i % 7}."}]
        r = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, temperature=1.0, seed=i, extra_body={"return_token_ids": True}
        )
        return messages, r.model_dump()

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(ask, range(64)))
    for messages, body in answers:
        assert body["prompt_token_ids"] == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                    return_dict=False)  # fmt: skip
        assert 1 <= len(body["choices"][0]["token_ids"]) <= 8
    assert server.batcher.calls - calls < 64  # the engine took them in shared batches


@pytest.mark.parametrize(
    "call,error,match",
    [
        (dict(model="gpt-4o"), openai.NotFoundError, r"model 'gpt-4o' does not exist: this server serves 'tiny-chat"),
        (dict(stream=True, logprobs=True), openai.BadRequestError, r"logprobs: logprobs come with whole responses"),
        (dict(stream_options={"include_usage": True}), openai.BadRequestError, r"stream_options: only with stream: t"),
        (dict(logprobs=True, top_logprobs=3), openai.BadRequestError, r"top_logprobs: this server returns the sampled"),
        (dict(temperature=-1), openai.BadRequestError, r"temperature: must be >= 0"),
        (dict(max_tokens=4, extra_body={"stop_token_ids": [10**6]}), openai.BadRequestError,
         r"stop token id 1000000 outside the vocabulary \[0, 512\)"),
        (dict(messages=[{"role": "user", "content": "x " * 200}]), openai.BadRequestError,
         r"prompt of \d+ tokens does not fit the context window \(EngineConfig.max_model_len=96\)"),
        (dict(messages=[]), openai.BadRequestError, r"messages: List should have at least 1 item"),
        (dict(extra_body={"frobnicate": 1}), openai.BadRequestError, r"frobnicate: Extra inputs are not permitted"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), openai.BadRequestError,
         r"tools: tool calls are not parsed by this server"),
    ],
)  # fmt: skip
def test_a_bad_chat_request_gets_an_openai_error_naming_it_and_the_server_keeps_serving(client, call, error, match):
    args = dict(model=NAME, messages=MESSAGES, max_tokens=4) | call
    with pytest.raises(error, match=match) as caught:
        client.chat.completions.create(**args)
    assert caught.value.body is not None  # OpenAI's {"error": {...}} shape, read by the client
    assert client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2).choices[0].message is not None


def test_bad_text_completion_requests_and_bad_json_are_named(client, served):
    with pytest.raises(openai.BadRequestError, match=r"request cmpl-\w+-0: prompt token 9999 outside the vocabulary"):
        client.completions.create(model=NAME, prompt=[1, 9999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"logprobs: this server returns the sampled token's logprob only"):
        client.completions.create(model=NAME, prompt="1 + 1 =", max_tokens=2, logprobs=2)
    r = httpx.post(served[1].url + "/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=NAME, prompt="1 + 1 =", max_tokens=2).choices[0].text is not None


def test_no_request_sees_half_of_a_weight_sync(client, served):
    """A sync made under ``Batcher.paused`` is seen whole: a request sent during it waits, then runs on the new
    version."""
    server, _, seen = served
    engine = server.engine
    version = engine.weight_version
    done = threading.Event()

    def ask():
        client.completions.create(model=NAME, prompt="12 + 7 =", max_tokens=2, temperature=0)
        done.set()

    with server.batcher.paused():
        head = {"lm_head.weight": engine.read_weights(["lm_head.weight"])["lm_head.weight"] * 1.01}
        engine.stage_weights(head)
        thread = threading.Thread(target=ask)
        thread.start()
        assert not done.wait(1.0)  # held while the weights change
        engine.commit_weights(version + 1)
    thread.join(60)
    assert done.is_set() and seen[-1][1].weight_version == version + 1


def _serve(argv: list) -> tuple[subprocess.Popen, str]:
    """``moerl serve`` in a process of its own, and the base URL its first line names."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.cli", "serve", *map(str, argv), "--port", "0", "--dtype", "float32"],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    line = proc.stderr.readline()
    if "moerl serve:" not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, line.split(" at ", 1)[1].split()[0]


def test_moerl_serve_answers_with_the_adapter_on_loopback_and_stops_on_sigterm(ckpt, tmp_path):
    """``moerl serve CKPT --adapter DIR``: listens on 127.0.0.1, serves the directory's name, answers as the engine
    with that adapter does (greedy; negative control: the base model answers otherwise), exits 0 on SIGTERM."""
    from moerl.engine import Request, SamplingParams

    random_adapter(ckpt, tmp_path / "adapter")
    engine = LLMEngine(ckpt, EngineConfig(max_loras=1, max_lora_rank=4), dtype=torch.float32)
    engine.add_adapter("a", tmp_path / "adapter")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want, base = (engine.generate([Request("12 + 7 =", greedy, adapter=a)])[0].outputs[0].text for a in ("a", None))
    assert want != base

    proc, url = _serve([ckpt, "--adapter", tmp_path / "adapter"])
    try:
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["ckpt"]
        got = client.completions.create(model="ckpt", prompt="12 + 7 =", max_tokens=8, temperature=0)
        assert got.choices[0].text == want
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "moerl serve: stopped" in err, err


def test_moerl_serve_without_its_libraries_names_the_extra(ckpt, monkeypatch, capsys):
    from moerl.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as a python without it: its import fails
    assert main(["serve", str(ckpt)]) == 2
    assert "moerl serve needs uvicorn, not installed here: pip install 'moerl[serve]'" in capsys.readouterr().err


def test_moerl_serve_names_what_it_cannot_start_with(ckpt):
    taken = Listening(lambda scope, receive, send: None)  # a port in use
    try:
        r = subprocess.run(
            [sys.executable, "-m", "moerl.cli", "serve", ckpt, "--port", str(taken.port)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        taken.close()
    assert r.returncode == 2 and f"--host 127.0.0.1 --port {taken.port}: cannot listen there" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "moerl.cli", "serve", ckpt, "--adapter", "/nowhere"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "/nowhere/adapter_config.json does not exist" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "moerl.cli", "serve", ckpt, "--max-num-seqs", "0"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "--max-num-seqs 0: must be >= 1" in r.stderr, r.stderr
