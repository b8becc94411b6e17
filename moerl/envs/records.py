"""Records of a local ``.jsonl`` or ``.parquet`` file, each with where it is (file and line, or file and row), so a
bad one is named by its place."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from moerl.envs.base import check_split, split_of
from moerl.errors import ConfigError


def _jsonl_record(raw: bytes, where: str, shape: str) -> object:
    """The JSON value of one ``.jsonl`` line (``raw`` bytes) at ``where`` (file:line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise ConfigError(f"{where}: JSON nested too deep to read (a record is {shape})") from None


def read_records(
    path: str | os.PathLike, env: str, shape: str, columns: tuple[str, ...] | None = None
) -> list[tuple[str, object]]:
    """``(where, record)`` for each record of the ``.jsonl`` (blank lines skipped; ``where`` is ``file:line``) or
    ``.parquet`` file (``where`` is ``file: row N``, 1-based) at ``path``, for environment ``env`` whose records are
    ``shape`` (said where one is nested too deep to read). ``columns``: the parquet columns read, all required.
    ConfigError for a missing file, another format, a line that is not UTF-8 JSON, an unreadable parquet file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{env}: no such file {path}")
    if path.suffix == ".jsonl":
        with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named with its number, as bad JSON is
            return [
                (f"{path}:{lineno}", _jsonl_record(raw, f"{path}:{lineno}", shape))
                for lineno, raw in enumerate(f, 1)
                if raw.strip()
            ]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:
            raise ConfigError(f"{path}: cannot read parquet ({e})") from e
        if columns is not None:
            missing = [k for k in columns if k not in table.column_names]
            if missing:
                raise ConfigError(f"{path}: missing column(s) {missing}; has {table.column_names}")
            table = table.select(columns)
        return [(f"{path}: row {i}", rec) for i, rec in enumerate(table.to_pylist(), 1)]
    raise ConfigError(f"{env}: {path} must be a .jsonl or .parquet file")


def split_pools(records: list, key, test_records: list | None, test_fraction: float) -> dict[str, list]:
    """The records by split: without ``test_records``, by a hash of ``key(record)`` (a ``test_fraction`` of them go
    to test); with them, those are the test split and the train split is ``records`` less any whose key is among
    them (no train problem is ever a test problem)."""
    if test_records is None:
        return {s: [r for r in records if split_of(key(r), test_fraction) == s] for s in ("train", "test")}
    seen = {key(r) for r in test_records}
    return {"train": [r for r in records if key(r) not in seen], "test": list(test_records)}


def shuffled_indices(pool: list, n: int, env: str, source: str, split: str, seed: int) -> list[int]:
    """``n`` indices into ``pool`` in an order shuffled by ``(env, split, seed)``: the pool repeats (reshuffled)
    where ``n`` is larger than it. ConfigError where ``n`` > 0 and the ``split`` of ``source`` is empty."""
    check_split(split)
    if n > 0 and not pool:
        raise ConfigError(f"{env}: the {split} split of {source} is empty")
    rng, order = random.Random(f"{env}:{split}:{seed}"), []
    while len(order) < n:
        order += rng.sample(range(len(pool)), len(pool))
    return order[:n]
