"""Every config key of a run with its default and what it does, read from the config dataclasses themselves: the
comment on a field's line, or the comment lines just above it. ``moerl config`` prints them; the docs site's config
reference page is this module's markdown, written by ``make docs`` (``python -m moerl.config_doc --write
docs/reference.md``), never committed, so it cannot fall behind the dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
from pathlib import Path

from moerl.config import config_key
from moerl.run_config import RunConfig


def field_comments(cls) -> dict[str, str]:
    """Field name -> its comment in ``cls``'s source (the line's own comment, else the comment block above it)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for i, line in enumerate(lines, start=1):
        head = line.strip().split(":", 1)[0]
        if head not in names or line[: len(line) - len(line.lstrip())] != "    " or head in out:
            continue
        text = comments.get(i)
        if text is None or line.lstrip().startswith("#"):
            above, j = [], i - 1
            while j >= 1 and lines[j - 1].lstrip().startswith("#"):
                above.insert(0, comments[j])
                j -= 1
            text = " ".join(above) if above else None
        else:  # comment lines below go on with this one unless the field after them has no comment of its own
            j = i + 1
            while j <= len(lines) and lines[j - 1].lstrip().startswith("#"):
                j += 1
            if j > i + 1 and j <= len(lines) and j in comments:
                text = " ".join([text, *(comments[k] for k in range(i + 1, j))])
        if text:
            out[head] = text
    return out


def describe(obj, prefix: str = "") -> list[tuple[str, object, str]]:
    """``(dotted key, default, description)`` for every leaf field of config dataclass instance ``obj``."""
    rows = []
    comments = field_comments(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + config_key(f.name)
        if dataclasses.is_dataclass(value):
            rows += describe(value, key + ".")
        else:
            rows.append((key, value, comments.get(f.name, "")))
    return rows


def shown(value) -> str:
    """A default as a YAML user would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)) or value == "":
        return json.dumps(value)
    return str(value)


def text_table(obj) -> str:
    """The keys as ``key = default  description`` lines, grouped by section."""
    rows = describe(obj)
    width = max(len(f"{k} = {shown(v)}") for k, v, _ in rows)
    out, section = [], None
    for key, value, doc in rows:
        head = key.split(".", 1)[0] if "." in key else ""
        if head != section:
            section = head
            out.append(f"\n[{head}]" if head else "")
        out.append(f"{f'{key} = {shown(value)}':<{width}}  {doc}")
    return "\n".join(out).strip("\n") + "\n"


def markdown_table(obj) -> str:
    """The keys as a markdown table: key, default, description."""
    out = ["| key | default | what it does |", "|---|---|---|"]
    for key, value, doc in describe(obj):
        cell = doc.replace("|", "\\|")
        out.append(f"| `{key}` | `{shown(value)}` | {cell} |")
    return "\n".join(out) + "\n"


REFERENCE_INTRO = """# Config reference

Every key of `moerl train`, its default and what it does. Set a key in a YAML config, under its section
(`policy: {lora: {rank: 16}}`), or on the command line as `section.key=value` (`policy.lora.rank=16`);
overrides come after the config file and win over it. `moerl config` prints the same list in a terminal and
`moerl config --markdown` prints this table. `make docs` writes this page from the config dataclasses, so the
defaults and descriptions are the code's own.

"""


def reference_page() -> str:
    """The docs site's config reference page: a short heading and intro, then ``markdown_table(RunConfig())``."""
    return REFERENCE_INTRO + markdown_table(RunConfig())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moerl.config_doc", description="the docs' config reference page")
    parser.add_argument("--write", metavar="PATH", help="write the config reference page there (default: print it)")
    args = parser.parse_args(argv)
    page = reference_page()
    if args.write is None:
        print(page, end="")
    else:
        Path(args.write).write_text(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
