"""``moerl config``: every key of a run, its true default and a description, from the config dataclasses."""

import dataclasses
import re
from pathlib import Path

from moerl.cli import main
from moerl.config import load_config
from moerl.config_doc import describe, field_comments, markdown_table, shown
from moerl.run_config import RunConfig, flatten


def test_every_key_is_listed_with_its_real_default_and_a_description():
    """Oracle: the config loader. Each listed key set to its listed default loads and reads back that value, the list
    covers every leaf key, and none lacks a description."""
    rows = describe(RunConfig())
    defaults = flatten(RunConfig())
    assert [k for k, _, _ in rows] == list(defaults)
    for key, value, doc in rows:
        assert doc, f"config key {key} has no description: comment its field"
        assert flatten(load_config(RunConfig, None, [f"{key}={shown(value)}"]))[key] == value, key


def test_a_field_without_a_comment_is_found_and_comments_belong_to_their_field():
    @dataclasses.dataclass
    class Section:
        a: int = 1  # the first; it goes on
        # below, before a field with its own comment
        b: int = 2  # the second
        # the third's, above it
        c: int = 3
        d: int = 4

    assert field_comments(Section) == {
        "a": "the first; it goes on below, before a field with its own comment",
        "b": "the second",
        "c": "the third's, above it",
    }
    assert [doc for _, _, doc in describe(Section())][-1] == ""  # d: what the first test refuses


def test_moerl_config_prints_the_table_and_train_help_points_to_it(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^policy\.lora\.rank = 8 +adapter rank r$", out, re.M)
    assert re.search(r"^algo\.async = false +", out, re.M) and "[cluster]" in out
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown_table(RunConfig())


def test_the_docs_reference_page_is_the_generated_table(tmp_path):
    """The config reference leaves the README for the docs site: ``make docs`` writes the page from the dataclasses
    (it is never committed, so it cannot go stale), mkdocs.yml's nav names it, and the Makefile's docs target writes
    it before the strict build."""
    import yaml

    from moerl.config_doc import main as write_page
    from moerl.config_doc import reference_page

    root = Path(__file__).parent.parent
    page = reference_page()
    assert page.startswith("# Config reference\n") and markdown_table(RunConfig()) in page
    assert write_page(["--write", str(tmp_path / "reference.md")]) == 0
    assert (tmp_path / "reference.md").read_text() == page

    def pages(nav) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        items = nav.values() if isinstance(nav, dict) else nav
        return [p for item in items for p in pages(item)]

    assert "reference.md" in pages(yaml.safe_load((root / "mkdocs.yml").read_text())["nav"])
    docs = re.search(r"^docs:.*?(?=^\S|\Z)", (root / "Makefile").read_text(), re.M | re.S)
    assert docs is not None, "the Makefile has no docs target"
    recipe = docs.group()
    assert "moerl.config_doc --write docs/reference.md" in recipe and "mkdocs build --strict" in recipe
    assert recipe.index("config_doc") < recipe.index("mkdocs build")
    assert markdown_table(RunConfig()) not in (root / "README.md").read_text(), "the README links the reference instead"
