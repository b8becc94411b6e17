"""A dataset environment: problems from the records of a local ``.jsonl`` or ``.parquet`` file, scored by the reward
functions the config names (``env.rewards``).

Each record has a prompt (field ``prompt``, or the one ``prompt_field`` names): text, or a list of chat messages
``{"role": ..., "content": ...}`` that the tokenizer's chat template renders (``env.chat.template``). Its other fields
go to every reward function with the completion: ``fn(completion, answer=..., level=...)``.
"""

from __future__ import annotations

import os

from moerl.envs.base import Problem, prompt_key
from moerl.envs.records import read_records, shuffled_indices, split_pools
from moerl.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")


def check_prompt(prompt: object, where: str, field: str = "prompt") -> str | list[dict]:
    """``prompt`` if it is non-empty text or a non-empty list of messages (``role`` one of ROLES, ``content`` a
    string); ConfigError naming ``where`` and what is wrong otherwise."""
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(f"{where}: {field!r} is empty")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"{where}: {field!r} must be text or a non-empty list of chat messages, got {prompt!r:.80}")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ConfigError(
                f"{where}: {field}[{i}] must be a message {{role: {' | '.join(ROLES)}, content: text}}, got {m!r:.80}"
            )
    return prompt


def _problem(rec: object, where: str, field: str) -> Problem:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: expected an object with a {field!r} field, got {type(rec).__name__}")
    if rec.get(field) is None:
        raise ConfigError(f"{where}: missing field {field!r}")
    prompt = check_prompt(rec[field], where, field)
    rest = {k: v for k, v in rec.items() if k not in (field, "answer")}
    return Problem(prompt, rec.get("answer"), rest, where)


def load_problems(path: str | os.PathLike, field: str = "prompt") -> list[Problem]:
    """A problem per record of ``path``; ConfigError naming the file and line (or row) of a bad record."""
    shape = f"an object with a {field!r} field"
    return [_problem(rec, where, field) for where, rec in read_records(path, "dataset", shape)]


class DatasetEnv:
    """Problems from ``path``, scored by ``env.rewards`` (it has no reward of its own).

    Splits: with ``test_path`` the train split is ``path`` and the test split ``test_path`` (records of ``path``
    whose prompt is also in ``test_path`` are dropped from train); without it one file is split by prompt hash, a
    ``test_fraction`` of it going to test."""

    name = "dataset"

    def __init__(
        self,
        path: str | os.PathLike,
        test_path: str | os.PathLike | None = None,
        test_fraction: float = 0.1,
        prompt_field: str = "prompt",
    ) -> None:
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"dataset: test_fraction must lie in [0, 1), got {test_fraction}")
        self.path, self.test_path, self.test_fraction, self.prompt_field = path, test_path, test_fraction, prompt_field
        test = None if test_path is None else load_problems(test_path, prompt_field)
        self.pools = split_pools(load_problems(path, prompt_field), lambda p: prompt_key(p.prompt), test, test_fraction)

    def __reduce__(self) -> tuple:
        """Pickle as the config, not the records (the reward worker gets the environment)."""
        return DatasetEnv, (self.path, self.test_path, self.test_fraction, self.prompt_field)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems of ``split`` in an order shuffled by ``seed``; the pool repeats (reshuffled) if ``n`` is
        larger than it."""
        source = str(self.test_path if split == "test" and self.test_path is not None else self.path)
        pool = self.pools.get(split, [])
        return [pool[i] for i in shuffled_indices(pool, n, self.name, source, split, seed)]
