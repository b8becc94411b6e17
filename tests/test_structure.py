"""The package's layering, read from the source: the parallel plans wrap the trainer's model from outside and import
nothing of the trainer; the Policy reaches the split only through its Layout."""

import ast
import sys
from pathlib import Path

import pytest

import moerl

ROOT = Path(moerl.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (``import a.b`` and ``from a.b import c``, at any depth, lazy ones included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def importers(package: str, target: str) -> dict[str, list[str]]:
    """The files of ``moerl/<package>`` that import something under ``moerl.<target>``, with what they import."""
    found = {}
    for path in sorted((ROOT / package).glob("*.py")):
        hits = sorted(m for m in imported_modules(path) if m == f"moerl.{target}" or m.startswith(f"moerl.{target}."))
        if hits:
            found[path.name] = hits
    return found


def test_parallel_imports_nothing_from_the_trainer():
    assert importers("parallel", "trainer") == {}


def test_the_check_sees_an_import_of_the_trainer(tmp_path, monkeypatch):
    # negative control: the same scan over a copy of parallel/ with one lazy import of the trainer added finds it
    copy = tmp_path / "moerl" / "parallel"
    copy.mkdir(parents=True)
    for path in (ROOT / "parallel").glob("*.py"):
        (copy / path.name).write_text(path.read_text())
    layout = copy / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _late():\n    from moerl.trainer.batch import Batch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "moerl")
    assert importers("parallel", "trainer") == {"layout.py": ["moerl.trainer.batch"]}


def test_the_policy_reaches_the_split_only_through_its_layout():
    # the pipeline, FSDP, expert-parallel and row plumbing live in moerl.parallel.layout, not in the policy (which
    # writes its shards through moerl.parallel.shards, given its Layout)
    uses = {m for m in imported_modules(ROOT / "trainer" / "policy.py") if m.startswith("moerl.parallel")}
    assert uses <= {"moerl.parallel.layout", "moerl.parallel.pipeline", "moerl.parallel.shards", "moerl.parallel.world"}
    names = set()
    for node in ast.walk(ast.parse((ROOT / "trainer" / "policy.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in ("moerl.parallel.pipeline", "moerl.parallel.world"):
            names |= {alias.name for alias in node.names}
    assert names <= {"Step", "World", "local"}


PLAIN_MODEL = ("config.py", "grouped.py", "linear.py", "moe.py", "rope.py", "transformer.py")


def model_graph(root: Path) -> dict[str, set[str]]:
    """moerl.model's modules and which of them each imports (lazy imports included)."""
    files = {p.stem: p for p in (root / "model").glob("*.py") if p.stem != "__init__"}
    return {
        name: {m.rsplit(".", 1)[1] for m in imported_modules(path) if m.startswith("moerl.model.")} & set(files)
        for name, path in files.items()
    }


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node, []))), None)


def test_the_plain_model_knows_neither_lora_nor_mx_and_model_has_no_import_circle():
    for name in PLAIN_MODEL:
        hits = {m for m in imported_modules(ROOT / "model" / name) if m in ("moerl.model.lora", "moerl.model.mx")}
        assert not hits, f"model/{name} imports {hits}: modes are swapped in from outside"
    graph = model_graph(ROOT)
    assert {"lora", "mx", "moe"} <= set(graph)
    assert cycle(graph) is None


def test_the_circle_check_finds_a_circle():
    graph = model_graph(ROOT)
    assert cycle({**graph, "moe": graph["moe"] | {"lora"}}) is not None  # moe -> lora -> moe, as it was


def mode_names_compared(root: Path) -> list[str]:
    """Places outside ``moerl/modes`` that compare something to a training mode's name (``x.mode == "lora"``,
    ``mode in ("full", "mxfp8")``): what a mode decides belongs to its handler."""
    from moerl.modes import MODES

    found = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "modes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = [getattr(x, "id", getattr(x, "attr", "")) for x in sides]
            if not any(n.endswith("mode") for n in named):  # ``qk_norm == "full"``: not a training mode
                continue
            items = [e for x in sides for e in (x.elts if isinstance(x, ast.Tuple | ast.List | ast.Set) else [x])]
            if {e.value for e in items if isinstance(e, ast.Constant)} & set(MODES):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_the_mode_handlers_ask_which_mode_it_is(tmp_path, monkeypatch):
    assert mode_names_compared(ROOT) == []
    # negative control: a copy of the loop asking for a mode by name is found
    copy = tmp_path / "moerl"
    copy.mkdir()
    (copy / "loop.py").write_text((ROOT / "loop.py").read_text() + '\n\ndef _f(cfg):\n    return cfg.mode != "full"\n')
    assert mode_names_compared(copy) == [f"loop.py:{len((copy / 'loop.py').read_text().splitlines())}"]


def package_graph(root: Path, package: str) -> dict[str, set[str]]:
    """The modules of ``moerl/<package>`` and which of them each imports (``from moerl.pkg import module`` and lazy
    imports included)."""
    files = {p.stem: p for p in (root / package).glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == f"moerl.{package}":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"moerl.{package}."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith(f"moerl.{package}.")}
        graph[name] = found & set(files)
    return graph


@pytest.mark.parametrize("package", ["bridges", "model", "modes", "trainer", "parallel", "engine", "plan", "rollout"])
def test_no_import_circle_inside_a_package(package):
    assert cycle(package_graph(ROOT, package)) is None


def test_the_package_circle_check_sees_a_from_import_of_a_module(tmp_path):
    # negative control: a family file importing the registry through ``from moerl.bridges import registry`` while
    # the registry imports the family closes a circle the check finds
    copy = tmp_path / "moerl" / "bridges"
    copy.mkdir(parents=True)
    for path in (ROOT / "bridges").glob("*.py"):
        (copy / path.name).write_text(path.read_text())
    (copy / "olmoe.py").write_text((copy / "olmoe.py").read_text() + "\nfrom moerl.bridges import registry\n")
    (copy / "registry.py").write_text((copy / "registry.py").read_text() + "\nfrom moerl.bridges import olmoe\n")
    assert cycle(package_graph(tmp_path / "moerl", "bridges")) is not None
