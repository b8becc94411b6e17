"""Other libraries' log lines (vLLM, torchao, Ray, transformers, ...) go to the run's ``libraries.log``, not the
console: a run's console is moerl's progress and what it says in words; vLLM alone prints ~100-300 lines a run
(weights it skips at every sync, its start-up) and torchao warns of kernels it does not need on a CPU."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG = "libraries.log"
FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


@contextmanager
def library_logs(run_dir: str | os.PathLike) -> Iterator[Path]:
    """While the run lasts: Python logging of every library to ``run_dir/libraries.log`` (the root logger's records
    and vLLM's, in this process and the vLLM processes started meanwhile). A ``VLLM_LOGGING_CONFIG_PATH`` the user
    set is kept. Everything is as it was afterwards."""
    path = Path(run_dir) / LOG
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=True)  # no file until a line comes
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)  # records of libraries without handlers of their own land here, not on stderr
    if level > logging.INFO:  # INFO and up are kept in the file
        root.setLevel(logging.INFO)
    fd, name = tempfile.mkstemp(prefix="moerl-vllm-logging-", suffix=".json")  # not in the run directory: a run
    vllm_config = Path(name)  # refused before it begins leaves that as it was
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(_vllm_config(path)))
    had_env = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if had_env is None:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(vllm_config.resolve())
    vllm = logging.getLogger("vllm") if "vllm.logger" in sys.modules else None  # configured at its import: redo
    vllm_handlers = vllm.handlers[:] if vllm is not None else []
    if vllm is not None and had_env is None:
        vllm.handlers = [handler]
    try:
        yield path
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        if vllm is not None:
            vllm.handlers = vllm_handlers
        if had_env is None:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        vllm_config.unlink(missing_ok=True)  # vLLM's processes read it when they start, and they are gone now
        handler.close()


def _vllm_config(path: Path) -> dict:
    """A logging dictConfig for vLLM's processes: its ``vllm`` logger to ``path`` (appended)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"moerl": {"format": FORMAT}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(path.resolve()),
                "mode": "a",
                "delay": True,
                "formatter": "moerl",
            }
        },
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }


@contextmanager
def held_lines(logger_name: str, run_dir: str | os.PathLike) -> Iterator[None]:
    """Log records of ``logger_name`` (e.g. Ray's in the driver of a Ray run, whose run directory a Ray actor opens
    later) are held meanwhile, then appended to ``run_dir/libraries.log`` if the run made that directory, else
    given to the logger's own handlers after all: nothing is lost, nothing reaches a directory the run never had."""
    logger = logging.getLogger(logger_name)
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    own = logger.handlers[:]
    logger.handlers = [Hold()]
    try:
        yield
    finally:
        logger.handlers = own
        path = Path(run_dir) / LOG
        if held and path.parent.is_dir():
            formatter = logging.Formatter(FORMAT)
            with path.open("a", encoding="utf-8") as f:
                f.writelines(formatter.format(r) + "\n" for r in held)
        elif held:
            for record in held:
                logger.handle(record)
