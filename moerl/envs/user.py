"""The user's code a config names: ``file.py:Name`` (a Python file, by path), ``package.module:Name`` (an importable
module), or a name an installed package registers in the ``moerl.envs`` entry-point group.

A file is imported as a module whose name holds its absolute path (``moerl_user_files.p<hex>``), through a finder on
``sys.meta_path`` that turns such names back into the file in any process that has imported ``moerl.envs``. So what
the file defines (an environment, its episode state, a reward function) pickles by reference, and the reward worker
process imports the same file when it unpickles it. Nothing is imported that the config does not name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import traceback
from pathlib import Path

from moerl.errors import ConfigError

PACKAGE = "moerl_user_files"
ENTRY_POINTS = "moerl.envs"  # [project.entry-points."moerl.envs"] my_task = "my_package.tasks:MyEnv"


class _FileFinder(importlib.abc.MetaPathFinder):
    """Finds ``moerl_user_files`` (an empty package) and ``moerl_user_files.p<hex of a file's path>`` (that file)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname == PACKAGE:
            return importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        if fullname.startswith(PACKAGE + ".p"):
            try:
                file = bytes.fromhex(fullname[len(PACKAGE) + 2 :]).decode()
            except ValueError:
                return None
            return importlib.util.spec_from_file_location(fullname, file)
        return None


if not any(isinstance(f, _FileFinder) for f in sys.meta_path):
    sys.meta_path.append(_FileFinder())


def is_code_path(name: str) -> bool:
    """Whether ``name`` names code by path (``file.py:Name`` or ``package.module:Name``) rather than by a name."""
    return ":" in name


def module_name(file: Path) -> str:
    """The module name the file at absolute path ``file`` is imported under."""
    return f"{PACKAGE}.p{str(file).encode().hex()}"


def _import_file(target: str, spec: str, key: str):
    file = Path(target).expanduser().absolute()
    if not file.is_file():
        raise ConfigError(f"config key {key!r}={spec!r}: no such file {file}")
    name = module_name(file)
    try:
        return importlib.import_module(name)
    except Exception as e:
        sys.modules.pop(name, None)  # a later try loads it afresh
        raise ConfigError(f"config key {key!r}={spec!r}: loading {file} failed: {_where(e, file)}") from None


def _where(e: BaseException, file: Path) -> str:
    """``e`` with the line of ``file`` it came from."""
    line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
    for frame in traceback.extract_tb(e.__traceback__):
        if Path(frame.filename) == file:
            line = frame.lineno
    return f"{type(e).__name__}: {e}" + (f" (line {line})" if line else "")


def _import_module(target: str, spec: str, key: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            missing = f"no module named {e.name!r} (a file is named as file.py)"
            raise ConfigError(f"config key {key!r}={spec!r}: {missing}") from None
        raise ConfigError(f"config key {key!r}={spec!r}: importing {target} failed: {e}") from None
    except Exception as e:
        raise ConfigError(f"config key {key!r}={spec!r}: importing {target} failed: {type(e).__name__}: {e}") from None


def load_code(spec: str, key: str) -> object:
    """The object ``spec`` names: ``file.py:Name`` (a path, relative to the working directory) or
    ``package.module:Name`` (``Name`` may be dotted: ``Class.method``). ConfigError naming ``key`` and what is
    missing: the file, the module, the name (with the names the module has), or what loading it raised."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"config key {key!r}={spec!r}: must be file.py:Name or package.module:Name")
    by_file = target.endswith(".py") or "/" in target
    module = _import_file(target, spec, key) if by_file else _import_module(target, spec, key)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in vars(module) if not n.startswith("_"))
            raise ConfigError(
                f"config key {key!r}={spec!r}: {target} has no {attr!r} (it defines: {', '.join(names) or 'nothing'})"
            )
        obj = getattr(obj, part)
    return obj


def code_fingerprint(spec: str) -> str:
    """A hash of the file a ``file.py:Name`` spec names (what a cache of results made with it must key on); "" for
    any other name or a file that is not there."""
    target = spec.rpartition(":")[0]
    if not target.endswith(".py") and "/" not in target:
        return ""
    try:
        return hashlib.sha256(Path(target).expanduser().read_bytes()).hexdigest()
    except OSError:
        return ""


def installed_envs() -> dict[str, importlib.metadata.EntryPoint]:
    """The environments installed packages register: entry-point name -> entry point (group ``moerl.envs``)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def load_installed(ep: importlib.metadata.EntryPoint, key: str) -> object:
    """What entry point ``ep`` names; ConfigError naming it and its package where it cannot be loaded."""
    try:
        return ep.load()
    except Exception as e:
        package = ep.dist.name if ep.dist is not None else "its package"
        raise ConfigError(
            f"config key {key!r}={ep.name!r}: the environment {package} registers as {ep.value!r} cannot be loaded: "
            f"{type(e).__name__}: {e}"
        ) from None
