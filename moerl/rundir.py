"""A run directory, owned: one process at a time (a lock held for the run's lifetime), no run started over another
without ``overwrite``, and a resume that is the same run (the recorded config, changes only where allowed, recorded
with the step they took effect, metrics cut back to the checkpoint). A resume of a directory that holds no run yet
(its run stopped before it began, in its warm-up say) starts it, so a requeued job goes on.

Opening a run checks everything before it writes anything: a refused start or resume leaves the directory as it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import yaml

from moerl.config import from_dict, save_config, set_dotted
from moerl.errors import CheckpointError, ConfigError, RunDirError
from moerl.metrics import METRICS, read_metrics
from moerl.run_config import MUTABLE, RunConfig, flatten
from moerl.trainer.checkpoint import read_meta, recover_checkpoint

CONFIG, HISTORY, LOCK, CHECKPOINT = "config.yaml", "config_history.jsonl", ".lock", "checkpoint"
# a run's records: any of them means the directory holds a run; --overwrite removes them and the OUTPUTS
RUN_FILES = (CONFIG, HISTORY, METRICS, CHECKPOINT, "checkpoint.tmp", "checkpoint.old")
# base_model: a fresh run writes it anew; libraries.log: moerl.logs
OUTPUTS = ("tensorboard", "curves.png", "adapter", "merged", "libraries.log", "wandb", "wandb_id")


class RunLock:
    """An exclusive ``flock`` on ``<dir>/.lock`` (holder's pid and host written inside). The kernel drops it when the
    holder exits in any way (kill -9 included), so a lock file that no live process holds is stale and is taken
    over; ``release`` removes the file."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.fd: int | None = None
        self.stale_holder: str | None = None  # the pid / host left in a stale lock file we took over

    def acquire(self) -> RunLock:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunDirError(f"run directory {str(self.path.parent)!r} is not writable: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 256).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunDirError(
                    f"run directory {str(self.path.parent)!r} is in use by another process (pid and host: {holder}; "
                    f"lock {self.path}); wait for it to finish or stop it"
                ) from None
            try:  # a releasing holder unlinks the file: the one we locked must still be the one at the path
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.stale_holder = os.read(fd, 256).decode(errors="replace").strip() or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def holds_run(run_dir: Path) -> list[str]:
    """The run files present in ``run_dir`` (empty: no run there)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def recorded_config(run_dir: Path) -> tuple[RunConfig, list[dict]]:
    """The run's config as it stands now: ``config.yaml`` (the original record) with every recorded change applied;
    and the change records."""
    path = run_dir / CONFIG
    try:
        data = yaml.safe_load(path.read_text())
        cfg_dict = data if isinstance(data, dict) else None
    except (OSError, yaml.YAMLError) as e:
        raise RunDirError(f"{path}: the run's recorded config cannot be read: {e}") from None
    if cfg_dict is None:
        raise RunDirError(f"{path}: the run's recorded config is not a mapping")
    history = []
    if (run_dir / HISTORY).exists():
        for n, line in enumerate((run_dir / HISTORY).read_text().splitlines(), 1):
            try:
                history.append(json.loads(line))
            except json.JSONDecodeError:
                raise RunDirError(f"{run_dir / HISTORY} line {n} is not valid JSON") from None
    for record in history:
        for key, change in record["changes"].items():
            set_dotted(cfg_dict, key, change["to"])
    try:
        return from_dict(RunConfig, cfg_dict), history
    except ConfigError as e:
        raise RunDirError(f"{path}: the run's recorded config no longer loads: {e}") from None


def config_changes(old: RunConfig, new: RunConfig) -> dict[str, dict]:
    """Dotted key -> {"from", "to"} of every field that differs; ConfigError naming those a resume may not change."""
    a, b = flatten(old), flatten(new)
    changed = {k: {"from": a[k], "to": b[k]} for k in a if a[k] != b[k]}
    fixed = [k for k in changed if k not in MUTABLE]
    if fixed:
        detail = "; ".join(f"{k}: {changed[k]['from']!r} -> {changed[k]['to']!r}" for k in fixed)
        raise ConfigError(
            f"--resume: the config changes field(s) that define the run and cannot change mid-run ({detail}); "
            f"fields a resume may change: {', '.join(MUTABLE)}"
        )
    return changed


class RunDir:
    """An opened run directory: the lock, the step to start from, the checkpoint to load and the resolved notes.

    ``open`` only reads (and takes the lock); ``begin`` writes the run's records once the caller has validated
    everything else (e.g. loaded the checkpoint): config or config history, metrics cut back to the checkpoint,
    an interrupted save's checkpoint moved back into place.
    """

    def __init__(self, path: Path, cfg: RunConfig, resume: bool, overwrite: bool):
        self.path, self.cfg, self.resume, self.overwrite = path, cfg, resume, overwrite
        self.lock = RunLock(path)
        self.start_step = 0
        self.checkpoint: Path | None = None  # where the complete checkpoint to resume from lies now
        self.changes: dict[str, dict] = {}
        self.notes: list[str] = []
        self.made: Path | None = None  # the topmost directory ``open`` made (None: the run directory was there)
        self.begun = False  # ``begin`` wrote the run's records

    @classmethod
    def open(cls, cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> RunDir:
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: continue the run, or start over")
        path = Path(cfg.run_dir)
        if path.exists() and not path.is_dir():
            raise RunDirError(f"run directory {str(path)!r} exists and is not a directory")
        if resume and not path.is_dir():
            raise RunDirError(f"--resume: run directory {str(path)!r} does not exist")
        made = _first_missing(path)  # the topmost directory this run makes, if it makes any
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"run directory {str(path)!r} cannot be created: {e.strerror or e}") from None
        run = cls(path, cfg, resume, overwrite)
        run.made = made
        run.lock.acquire()
        try:
            run._check()
        except BaseException:
            run.lock.release()
            raise
        return run

    def _check(self) -> None:
        present = holds_run(self.path)
        if self.resume and not present:  # stopped before it began (in its warm-up, say): going on is starting it
            self.resume = False
            self.notes.append("--resume: no run here yet (one stopped before its first step records none): starting it")
        if not self.resume:
            if present and not self.overwrite:
                raise RunDirError(
                    f"run directory {str(self.path)!r} already holds a run ({', '.join(present)}): pass --resume to "
                    "continue it, --overwrite to start over (its run files are removed), or choose another run_dir"
                )
            return
        found, note = recover_checkpoint(self.path / CHECKPOINT, dry_run=True)
        if found is None:
            why = ""
            if (self.path / CHECKPOINT).exists():  # say what is wrong with it: the file, the shard
                try:
                    read_meta(self.path / CHECKPOINT)
                except (CheckpointError, OSError) as e:
                    why = f" ({e})"
            raise RunDirError(f"--resume: no complete checkpoint in {self.path / CHECKPOINT}{why}; nothing to resume")
        if not (self.path / CONFIG).exists():
            raise RunDirError(f"--resume: {self.path / CONFIG} is missing: the run's config was never recorded")
        if note:
            self.notes.append(note)
        recorded, _ = recorded_config(self.path)
        self.changes = config_changes(recorded, self.cfg)
        state = read_meta(found).get("state", {})
        if not isinstance(state.get("step"), int):
            raise CheckpointError(f"{found}: its state has no loop step: not a checkpoint of `moerl train`")
        self.start_step, self.checkpoint = state["step"], found
        if self.cfg.train.steps < self.start_step:
            raise ConfigError(
                f"config key 'train.steps'={self.cfg.train.steps} is below the checkpoint's step {self.start_step}: "
                f"a resumed run cannot end before where it stopped"
            )

    def begin(self, log=None) -> None:
        """Write the run's records (call after everything that can refuse the run has passed)."""
        log = log or (lambda msg: print(f"moerl: {msg}", file=sys.stderr))
        self.begun = True
        if self.lock.stale_holder:
            log(f"took over the stale lock of {self.path} left by an exited process ({self.lock.stale_holder})")
        if not self.resume:
            for note in self.notes:
                log(f"{self.path}: {note}")
            removed = [n for n in RUN_FILES + OUTPUTS if (self.path / n).exists()] if self.overwrite else []
            for name in removed:
                p = self.path / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            if removed:
                log(f"--overwrite: removed the previous run's {', '.join(removed)} from {self.path}")
            save_config(self.cfg, self.path / CONFIG)
            return
        for note in self.notes:
            log(f"{self.path / CHECKPOINT}: {note}")
        self.checkpoint, _ = recover_checkpoint(self.path / CHECKPOINT)
        if self.changes:
            record = {"step": self.start_step, "changes": self.changes}
            with (self.path / HISTORY).open("a") as f:
                f.write(json.dumps(record) + "\n")
            log(
                f"resumed at step {self.start_step} with changes: "
                + ", ".join(f"{k} {c['from']!r} -> {c['to']!r}" for k, c in self.changes.items())
            )
        dropped = truncate_metrics(self.path, self.start_step)
        if dropped:
            log(f"{self.path / METRICS}: dropped {dropped} row(s) logged after the checkpoint's step {self.start_step}")

    def close(self, refused: bool = False) -> None:
        """Release the lock. A run ``refused`` before it began (bad input: nothing of it is written) takes back the
        directories ``open`` made for it, where they are still empty; a run stopped before it began (a signal in
        its warm-up) keeps its directory, for ``--resume``."""
        self.lock.release()
        if not (refused and not self.begun and self.made is not None):
            return
        d = self.path
        while True:  # from the run directory up to the topmost one made, each only where empty
            try:
                d.rmdir()
            except OSError:
                return
            if d == self.made:
                return
            d = d.parent

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_missing(path: Path) -> Path | None:
    """The topmost directory of ``path`` that does not exist yet (None: ``path`` exists)."""
    missing = None
    for d in [path, *path.parents]:
        if d.exists():
            return missing
        missing = d
    return missing


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Keep the metrics rows up to ``step`` (and drop a truncated last line); returns how many rows were dropped."""
    path = run_dir / METRICS
    if not path.exists():
        return 0
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = read_metrics(run_dir)
    kept = [r for r in rows if r["step"] <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return len(lines) - len(kept)
