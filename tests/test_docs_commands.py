"""Every command the README and the docs show is one moerl takes today: each `moerl ...` line parsed by moerl's own
command-line parser, its config file and key=value overrides loaded and checked as `moerl train` / `moerl plan`
load them (keys, types, choices), each `make` target in the Makefile, each name the Python examples import
importable. A renamed flag, key or target, or a moved example, fails here naming the page and the line; what the
commands then do is run by the tests of each command (test_examples, test_cli_*, test_loop, test_plan, ...)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("reference.md", "benchmarks.md")  # written by `make docs` from the code and BENCHMARKS.md
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
# what the pages write for "a path of yours": any string parses; a config file stands for one of the examples
PLACEHOLDER_CONFIG = {"CONFIG": "examples/lora_arithmetic.yaml", "examples/NAME.yaml": "examples/lora_arithmetic.yaml"}
NOTATION = {"key.sub=value"}  # the form of an override, not one


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line number, fence language, line) of every line in the page's fenced code blocks, continuations joined."""
    out, lang, pending = [], None, None
    for no, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
            continue
        if lang is None:
            continue
        if pending is not None:
            line = pending[1] + " " + line.strip()
            no = pending[0]
        if line.rstrip().endswith("\\"):
            pending = (no, line.rstrip()[:-1])
            continue
        pending = None
        out.append((no, lang, line))
    return out


def _commands() -> list[tuple[str, list[str]]]:
    """("page:line", argv) of every shell command the pages show (``$ `` prompts, ``torchrun -m moerl.cli``, ``ray
    start && moerl`` included; ``[optional]`` brackets taken as written without them)."""
    found = []
    for page in PAGES:
        lines = [(no, line) for no, lang, line in _blocks(page) if lang in ("", "bash", "sh", "console", "shell")]
        prompted = {no for no, line in lines if line.startswith("$ ")}
        for no, line in lines:
            if prompted and no not in prompted and any(abs(no - p) < 40 for p in prompted):
                continue  # a console block: its other lines are the command's output
            text = line.strip().removeprefix("$ ")
            for part in text.split("&&"):
                part = re.sub(r"(?<!\S)\.\.\.(?!\S)", "", part.replace("[", "").replace("]", ""))  # "[x ...]": notation
                words = shlex.split(part, comments=True)
                if words[:1] == ["torchrun"]:
                    words = ["moerl", *words[words.index("moerl.cli") + 1 :]]
                if words[:1] in (["moerl"], ["make"]):
                    found.append((f"{page.relative_to(ROOT)}:{no}", words))
    return found


COMMANDS = _commands()


def test_the_pages_show_commands():
    # the parser of the pages finds what they show (a control on the collection, not just on its checks)
    names = {words[1] for _, words in COMMANDS}
    assert {"demo", "test", "train", "generate", "eval", "plan", "check-arch", "init-model", "sft"} <= names, names
    assert len(COMMANDS) >= 30


def _check(words: list[str]) -> None:
    """Raise if ``words`` is not a command moerl or the Makefile takes."""
    from moerl.cli import cmd_plan, cmd_train, parse_args, run_config

    if words[0] == "make":
        targets = re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M)
        assert words[1] in targets, f"no make target {words[1]!r}"
        return
    argv = [PLACEHOLDER_CONFIG.get(w, w) for w in words[1:] if w not in NOTATION]
    try:
        args = parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"moerl's parser refused {argv}") from e
    if args.func in (cmd_train, cmd_plan):  # the config as the command loads it (from the project's root)
        if args.config is not None and args.config.endswith((".yaml", ".yml")):
            args.config = str(ROOT / args.config)
        run_config(args)


@pytest.mark.parametrize("where, words", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_command_the_pages_show_is_taken(where, words):
    _check(words)


@pytest.mark.parametrize(
    "words, why",
    [
        (["moerl", "train", "examples/lora_arithmetic.yaml", "--restart"], "parser refused"),
        (["moerl", "train", "examples/lora_arithmetic.yaml", "train.stepz=5"], "stepz"),
        (["moerl", "train", "examples/lora_arithmetic.yaml", "policy.mode=fast"], "fast"),
        (["moerl", "train", "examples/no_such.yaml"], "no_such"),
        (["moerl", "generate", "CKPT", "--promt", "1+1="], "parser refused"),
        (["moerl", "serve"], "parser refused"),
        (["make", "benchmarks"], "no make target"),
    ],
    ids=["flag", "key", "value", "config", "generate-flag", "command", "make-target"],
)
def test_a_command_moerl_no_longer_takes_fails_the_check(words, why):
    # negative controls: a renamed flag, key, value, config, command or target is caught
    with pytest.raises(Exception, match=why):
        _check(words)


def test_the_python_the_pages_show_imports_what_moerl_has():
    import importlib

    snippets = 0
    for page in PAGES:
        for _, lang, line in _blocks(page):
            m = re.match(r"\s*from (moerl[\w.]*) import (.+)$", line) if lang == "python" else None
            if m:
                module = importlib.import_module(m.group(1))
                for name in (n.strip() for n in m.group(2).split(",")):
                    assert hasattr(module, name), f"{page.name}: {m.group(1)} has no {name}"
                snippets += 1
    assert snippets >= 3
