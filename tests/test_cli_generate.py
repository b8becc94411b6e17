"""``moerl generate`` is the engine: its tokens, its named errors, streaming; and the checkpoint's tokenizer."""

import re
import shutil

import pytest
import torch
from run_helpers import random_adapter

from moerl.bridges.checkpoint import load_tokenizer
from moerl.cli import main
from moerl.engine import EngineConfig, LLMEngine, Request, SamplingParams
from moerl.errors import CheckpointError
from moerl.presets import init_model

PROMPTS = ["12+7=", "3*4=5"]


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    init_model("qwen3_moe", "tiny", path, seed=0)
    return path


def run(args: list, capsys) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def expected(outs, prompts: list[str], n: int) -> str:
    """What ``moerl generate`` prints for these engine outputs: one block per completion, prompt order."""
    blocks = []
    for prompt, out in zip(prompts, outs, strict=True):
        for c in out.outputs:
            label = repr(prompt) + (f" #{c.index}" if n > 1 else "")
            blocks.append(f"{label} -> {c.text}  ({len(c.token_ids)} tokens, {c.finish_reason})\n")
    return "".join(blocks)


def test_greedy_output_is_the_engines(ckpt, capsys):
    args = [ckpt, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", 10, "--temperature", 0]
    code, out, err = run([*args, "--dtype", "float32"], capsys)
    assert code == 0, err
    engine = LLMEngine(ckpt, dtype=torch.float32)
    assert out == expected(engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10)), PROMPTS, 1)


def test_seeded_samples_are_the_engines(ckpt, capsys):
    args = [ckpt, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", 8, "--temperature", 0.8]
    code, out, err = run([*args, "--n", 2, "--seed", 5, "--top-p", 0.9, "--top-k", 20, "--dtype", "float32"], capsys)
    assert code == 0, err
    engine = LLMEngine(ckpt, dtype=torch.float32)
    # prompt i is seeded with seed + i, so equal prompts do not repeat each other
    reqs = [Request(p, SamplingParams(0.8, 0.9, 20, max_tokens=8, n=2, seed=5 + i)) for i, p in enumerate(PROMPTS)]
    assert out == expected(engine.generate(reqs), PROMPTS, 2)


def test_stream_prints_the_same_text_while_it_generates(ckpt, capsys, monkeypatch):
    args = [ckpt, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--n", 2, "--max-tokens", 12, "--seed", 3]
    args += ["--temperature", 1.0]
    step, printed = LLMEngine._step, []

    def step_and_look(self, *args):  # what stdout holds after each engine step
        n = step(self, *args)
        printed.append(capsys.readouterr().out)
        return n

    monkeypatch.setattr(LLMEngine, "_step", step_and_look)
    outputs = {}
    for mode in ([], ["--stream"]):
        printed.clear()
        code, rest, err = run(args + mode, capsys)
        assert code == 0, err
        outputs[tuple(mode)] = (list(printed), rest)
    plain_steps, plain_rest = outputs[()]
    stream_steps, stream_rest = outputs[("--stream",)]
    assert not any(plain_steps)  # without --stream nothing shows until the end
    assert "".join(stream_steps) + stream_rest == plain_rest
    assert sum(bool(s) for s in stream_steps) >= 3  # written step by step (special tokens print nothing)
    assert stream_steps[0].startswith(f"{PROMPTS[0]!r} #0 -> ")


def test_on_token_reports_every_token_and_the_finish(ckpt):
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=4, max_model_len=64), dtype=torch.float32)
    events = []
    outs = engine.generate(
        [Request(PROMPTS[0], SamplingParams(max_tokens=6, n=2, seed=0)), PROMPTS[1]],
        SamplingParams(max_tokens=5, seed=1),
        on_token=lambda *e: events.append(e),
    )
    for i, out in enumerate(outs):
        for c in out.outputs:
            mine = [e for e in events if e[:2] == (i, c.index)]
            assert [e[2] for e in mine] == c.token_ids
            assert [e[3] for e in mine] == [None] * (len(c.token_ids) - 1) + [c.finish_reason]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], r"SamplingParams\.temperature=-1\.0: must be >= 0"),
        (["--max-tokens", "0"], r"SamplingParams\.max_tokens=0: must be >= 1"),
        (["--top-p", "0"], r"SamplingParams\.top_p=0\.0: must lie in \(0, 1\]"),
        (["--top-k", "-2"], r"SamplingParams\.top_k=-2: must be >= 0"),
        (["--n", "0"], r"SamplingParams\.n=0: must be >= 1"),
        (["--max-model-len", "9999"], r"EngineConfig\.max_model_len=9999: exceeds the model's max_position_embeddings"),
        (["--max-model-len", "0"], r"EngineConfig\.max_model_len=0: must be >= 1"),
        (["--n", "2"], r"--n 2 with greedy decoding \(--temperature 0, the default\) gives 2 equal completions"),
        (["--adapter", "/nowhere"], r"/nowhere/adapter_config.json does not exist: not a PEFT adapter directory"),
    ],
)
def test_bad_options_are_the_engines_named_errors(ckpt, capsys, extra, message):
    code, out, err = run([ckpt, "--prompt", "1+1=", *extra], capsys)
    assert code == 2 and out == ""
    assert re.fullmatch(rf"moerl: error: [^\n]*{message}[^\n]*\n", err), err


def test_a_prompt_longer_than_the_context_fails_alone(ckpt, capsys):
    long = "1+" * 20
    args = [ckpt, "--prompt", "1+1=", "--prompt", long, "--prompt", "2+2=", "--max-model-len", 16]
    code, out, err = run([*args, "--max-tokens", 4, "--temperature", 0], capsys)
    assert code == 2
    assert out.startswith("'1+1=' -> ") and "\n'2+2=' -> " in out and long not in out
    assert re.fullmatch(  # after the timing line, the error names the prompt
        rf"moerl: error: prompt 1 {re.escape(repr(long))}: request 1: prompt of 40 tokens does not fit the context "
        r"window \(EngineConfig\.max_model_len=16\)",
        err.splitlines()[-1],
    ), err


def test_an_empty_prompt_fails_alone_and_is_named(ckpt, capsys):
    """An empty prompt among good ones: the others generate (the engine's greedy tokens), and the error names the
    empty one by its place and text, as for a prompt too long for the context."""
    args = [ckpt, "--prompt", "1+1=", "--prompt", "", "--prompt", "2+2=", "--max-tokens", 4, "--dtype", "float32"]
    code, out, err = run(args, capsys)
    assert code == 2
    engine = LLMEngine(ckpt, dtype=torch.float32)
    assert out == expected(
        engine.generate(["1+1=", "2+2="], SamplingParams(temperature=0, max_tokens=4)), ["1+1=", "2+2="], 1
    )
    assert err.splitlines()[-1] == "moerl: error: prompt 1 '': request 1: empty prompt", err


def test_the_context_defaults_to_the_models(ckpt, capsys):
    # the tiny preset's max_position_embeddings is 2048: the context window is capped there, not at the prompt
    code, out, err = run([ckpt, "--prompt", "7" * 2100, "--prompt", "1+1=", "--max-tokens", 2], capsys)
    assert code == 2 and out.startswith("'1+1=' -> ")
    assert "request 0: prompt of 2100 tokens does not fit the context window (EngineConfig.max_model_len=2048)" in err


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        ('{"version": "1.0", "trunc', r"is not valid JSON"),
        ("{}", r"cannot load the tokenizer: KeyError: 'added_tokens'"),
    ],
)
def test_a_malformed_tokenizer_is_a_named_checkpoint_error(ckpt, tmp_path, capsys, content, cause):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    (bad / "tokenizer.json").write_text(content)
    pattern = rf"{re.escape(str(bad / 'tokenizer.json'))}:? {cause}"
    with pytest.raises(CheckpointError, match=pattern):
        load_tokenizer(bad)
    with pytest.raises(CheckpointError, match=pattern):
        LLMEngine(bad)
    code, out, err = run([bad, "--prompt", "1+1="], capsys)
    assert code == 2 and out == "" and re.fullmatch(rf"moerl: error: {pattern}.*\n", err, re.S), err


def test_a_checkpoint_without_a_tokenizer_is_a_named_error(ckpt, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bare))} has no tokenizer \(tokenizer_config\.json"):
        load_tokenizer(bare)
    code, _, err = run([bare, "--prompt", "1+1="], capsys)
    assert code == 2 and "has no tokenizer" in err


def test_generate_applies_a_trained_adapter_greedily_by_default(ckpt, tmp_path, capsys):
    """``moerl generate CKPT --adapter DIR`` (a PEFT directory as moerl exports it): greedy by default, the engine's
    tokens with that adapter; negative control: the base model's greedy tokens differ."""

    random_adapter(ckpt, tmp_path / "adapter")
    args = [ckpt, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", 10, "--dtype", "float32"]
    code, out, err = run([*args, "--adapter", tmp_path / "adapter"], capsys)
    assert code == 0, err
    engine = LLMEngine(ckpt, EngineConfig(max_loras=1, max_lora_rank=4), dtype=torch.float32)
    engine.add_adapter("a", tmp_path / "adapter")
    greedy = SamplingParams(temperature=0, max_tokens=10)
    assert out == expected(engine.generate([Request(p, greedy, adapter="a") for p in PROMPTS]), PROMPTS, 1)
    code, base, err = run(args, capsys)
    assert code == 0 and base != out
    assert base == expected(LLMEngine(ckpt, dtype=torch.float32).generate(PROMPTS, greedy), PROMPTS, 1)


def test_the_demo_ends_with_next_steps_that_work(tmp_path, capsys):
    """A short demo (4 supervised, 2 GRPO steps) ends by saying what to do next; its generate line runs as printed
    with the exported adapter (which names its base checkpoint), and so does its plot line."""
    import json
    import shlex

    from moerl.demo import run_demo

    lines = []
    run_demo(str(tmp_path / "demo"), sft_steps=4, rl_steps=2, log=lines.append)
    nxt = lines[lines.index("[demo] next:") + 1 :]
    assert [line.split()[1] for line in nxt] == ["generate", "eval", "serve", "plot", "demo"]
    adapter = tmp_path / "demo" / "rl" / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((tmp_path / "demo" / "sft_model").resolve())
    printed = {}
    for line in [nxt[0], nxt[1], nxt[3]]:  # generate, eval, plot (serve runs until stopped: below)
        capsys.readouterr()
        argv = shlex.split(line.split("#")[0])[1:]
        assert main(argv) == 0, capsys.readouterr().err
        printed[argv[0]] = capsys.readouterr().out
    # the eval line measures what the run's final evaluation did: the same problems, accuracy and interval
    shown = [x for x in lines if x.startswith("[demo]") and " after 2 GRPO steps" in x]
    assert (
        len(shown) == 1
        and f"-> {printed['eval'].split(' on ')[0].removeprefix('held-out accuracy ')} after" in shown[0]
    )
    assert (tmp_path / "demo" / "rl" / "curves.png").exists()
    _serves_as_printed(nxt[2])


def _serves_as_printed(line: str) -> None:
    """The demo's serve line, on a free port (``--port 0`` added): it serves the trained adapter's base under the
    directory's name and stops on SIGTERM."""
    import os
    import shlex
    import signal
    import subprocess
    import sys

    import openai

    argv = [*shlex.split(line.split("#")[0])[1:], "--port", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "moerl.cli", *argv], stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        first = proc.stderr.readline()
        assert first.startswith("moerl serve: sft_model at http://127.0.0.1:"), first + proc.stderr.read()
        client = openai.OpenAI(base_url=first.split(" at ")[1].split()[0], api_key="unused", max_retries=0)
        assert client.completions.create(model="sft_model", prompt="1+2=", max_tokens=2).choices[0].text is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
