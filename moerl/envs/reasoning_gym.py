"""reasoning-gym's procedural tasks by name, scored by reasoning-gym's own ``score_answer``.

``tasks`` is one task (``"basic_arithmetic"``) or a weighted mix, each with reasoning-gym's own config for it::

    tasks: [{name: basic_arithmetic, weight: 2, config: {max_terms: 2}}, {name: chain_sum, weight: 1}]

The mix is reasoning-gym's ``CompositeDataset``: item ``i`` of a dataset seeded ``s`` is drawn from ``Random(s + i)``
(for the mix and for each task in it). Train and test are kept apart by seed: the train split's items are those of
seeds ``seed`` .. ``seed + size``, the test split's those of seeds from ``seed + size + len(tasks) + 1`` on, and a
train item whose question is also one of the ``test_size`` test items is skipped (a small task repeats questions).
"""

from __future__ import annotations

import difflib
import random
from functools import cached_property

from moerl.envs.base import Problem, check_split
from moerl.errors import ConfigError

OURS = ("seed", "size")  # set by the environment: the splits are apart by them


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "env.name 'reasoning_gym' needs the reasoning-gym package: pip install 'moerl[reasoning-gym]'"
        ) from None
    return reasoning_gym


def _specs(tasks: str | list) -> list[tuple[str, float, dict]]:
    """``(name, weight, config)`` of each task; ConfigError naming the entry of ``env.kwargs.tasks`` that is wrong."""
    from reasoning_gym.factory import DATASETS, create_dataset

    items = [tasks] if isinstance(tasks, str) else tasks
    if not isinstance(items, list) or not items:
        raise ConfigError("config key 'env.kwargs.tasks': must be a task name or a non-empty list of tasks")
    out = []
    for i, item in enumerate(items):
        key = f"env.kwargs.tasks[{i}]" if not isinstance(tasks, str) else "env.kwargs.tasks"
        item = {"name": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or set(item) - {"name", "weight", "config"} or "name" not in item:
            raise ConfigError(f"config key {key!r}: must be a task name or {{name, weight, config}}, got {item!r}")
        name, weight, config = item["name"], item.get("weight", 1.0), item.get("config", {})
        if name not in DATASETS:
            close = difflib.get_close_matches(str(name), DATASETS, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f" (its {len(DATASETS)}: reasoning_gym.factory)"
            raise ConfigError(f"config key {key!r}: reasoning-gym has no task {name!r}{hint}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ConfigError(f"config key '{key}.weight'={weight!r}: must be a number > 0")
        if not isinstance(config, dict) or set(config) & set(OURS):
            raise ConfigError(
                f"config key '{key}.config': must be a mapping of {name}'s own settings without {' or '.join(OURS)} "
                "(moerl sets them: env.kwargs.seed, size, test_size)"
            )
        try:
            create_dataset(name, **config, seed=0, size=1)
        except Exception as e:  # the task's own config class refuses it (a TypeError, an AssertionError)
            why = f"{type(e).__name__}: {e}"
            raise ConfigError(f"config key '{key}.config'={config!r}: {name} refuses it: {why}") from None
        if name in (n for n, _, _ in out):
            raise ConfigError(f"config key {key!r}: task {name!r} is named twice")
        out.append((name, float(weight), dict(config)))
    return out


class ReasoningGymEnv:
    """reasoning-gym tasks (see the module docstring): prompt = the item's question, answer = its answer; reward =
    ``score_answer`` of the completion's answer: its first line, or (``answer_tag``, e.g. ``"answer"``) the text in
    the last ``<answer>...</answer>``, as reasoning-gym's own ``extract_answer`` reads it."""

    name = "reasoning_gym"

    def __init__(
        self,
        tasks: str | list,
        seed: int = 0,
        size: int = 100_000,
        test_size: int = 200,
        answer_tag: str | None = None,
    ) -> None:
        _rg()
        if size < 1 or test_size < 1:
            raise ConfigError(f"reasoning_gym: size and test_size must be >= 1, got {size}, {test_size}")
        self.specs = _specs(tasks)
        self.tasks, self.seed, self.size, self.test_size, self.answer_tag = tasks, seed, size, test_size, answer_tag

    def __reduce__(self) -> tuple:
        """Pickle as the config (the reward worker rebuilds the datasets)."""
        return ReasoningGymEnv, (self.tasks, self.seed, self.size, self.test_size, self.answer_tag)

    def _dataset(self, seed: int):
        from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

        specs = [DatasetSpec(name, weight, config) for name, weight, config in self.specs]
        return CompositeDataset(CompositeConfig(size=self.size, seed=seed, datasets=specs))

    @cached_property
    def _train(self):
        return self._dataset(self.seed)

    @cached_property
    def _test(self) -> list[dict]:
        test = self._dataset(self.seed + self.size + len(self.specs) + 1)  # past every seed the train split uses
        return [test[i] for i in range(self.test_size)]

    @cached_property
    def _test_questions(self) -> set[str]:
        return {e["question"] for e in self._test}

    @staticmethod
    def _problem(entry: dict) -> Problem:
        return Problem(entry["question"], entry["answer"], {"entry": entry})

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        """``n`` problems of ``split``, deterministic in ``(seed, split)``; no train question is a test question."""
        check_split(split)
        rng = random.Random(f"{self.name}:{split}:{seed}")
        if split == "test":
            return [self._problem(self._test[rng.randrange(self.test_size)]) for _ in range(n)]
        out: list[Problem] = []
        for _ in range(100 * n + 100):
            if len(out) == n:
                return out
            entry = self._train[rng.randrange(self.size)]
            if entry["question"] not in self._test_questions:
                out.append(self._problem(entry))
        raise ConfigError(
            f"reasoning_gym: could not draw {n} train problems that are not test problems; the tasks' question space "
            f"is too small for test_size={self.test_size} (lower it, or widen the tasks' config)"
        )

    def answer(self, completion: str) -> str | None:
        """The completion's answer as the scorer reads it (see the class docstring)."""
        if self.answer_tag is None:
            return completion.split("\n", 1)[0].strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion, tag_name=self.answer_tag)

    def reward(self, problem: Problem, completion: str) -> float:
        """reasoning-gym's ``score_answer`` of the completion's answer for the problem's item (the task's own scorer:
        1.0 for a right answer, partial credit where the task gives it)."""
        return float(self._train.score_answer(self.answer(completion), entry=problem.meta["entry"]))

    def sft_examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``(question, answer)`` pairs from the train split (the answer in ``<answer_tag>`` tags where one is set;
        no terminator: the trainer appends EOS)."""
        tag = self.answer_tag
        return [
            (p.prompt, str(p.answer) if tag is None else f"<{tag}>{p.answer}</{tag}>")
            for p in self.problems(n, seed, "train")
        ]
