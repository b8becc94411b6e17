"""Per-step metrics: a jsonl file and TensorBoard scalars in the run directory, and Weights & Biases where the run
asks (``metrics.wandb``); ``plot_run`` draws the curves. TensorBoard and matplotlib are optional (``optional``): a
GPU machine's own python may have neither, and a run that does not ask for them must still start there."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from pathlib import Path

METRICS = "metrics.jsonl"
# what ``metrics.tensorboard`` and ``metrics.plot`` need: the module imported, and what installs it
LIBRARIES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "plot": ("matplotlib", "matplotlib")}


def optional(key: str, setting: bool | str) -> tuple[bool, str | None]:
    """Whether a run writes what ``metrics.<key>`` (``tensorboard`` or ``plot``) asks for, and a line to say when
    ``auto`` goes without it. ``true`` where the library does not import is a ConfigError naming the key and how to
    install it (checked before the run writes anything)."""
    from moerl.errors import ConfigError

    if setting is False:
        return False, None
    module, package = LIBRARIES[key]
    _, e = import_or_error(module)
    if e is None:
        return True, None
    if setting is True:
        raise ConfigError(
            f"config key 'metrics.{key}'=true: {module} does not import here ({e}); pip install {package} "
            f"(or set metrics.{key} to auto or false)"
        )
    return False, f"moerl: metrics.{key}=auto: {module} does not import here ({e}), so the run goes without it"


def import_or_error(module: str):
    """(the module, None), or (None, a line saying why it does not import). An install broken in another way than
    being absent (a TypeError or AttributeError from a mismatched dependency at import) is told the same way, its
    kind named, never a traceback out of moerl."""
    try:
        return importlib.import_module(module), None
    except ImportError as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - whatever a broken install raises while it imports
        first = str(e).splitlines()[0] if str(e) else ""
        return None, f"importing it raised {type(e).__name__}: {first}"


class MetricsLogger:
    """Appends one JSON line per step to ``run_dir/metrics.jsonl``, writes TensorBoard scalars and, with a
    ``wandb`` project, logs the same numbers (and the run's ``config``) to Weights & Biases."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        tensorboard: bool = True,
        purge_step: int | None = None,
        wandb=None,
        config: dict | None = None,
    ):
        """``purge_step``: a resumed run's first step; TensorBoard drops the events logged at and after it.
        ``wandb``: the run config's ``metrics.wandb`` (off when its project is empty)."""
        self.path = Path(run_dir) / METRICS
        self.tb = self.wb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge_step)
        if wandb is not None and wandb.project:
            self.wb = _wandb_run(Path(run_dir), wandb, config or {})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step} | {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(
                {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step
            )

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
            self.wb = None


def wandb_module(section):
    """The ``wandb`` module where ``metrics.wandb`` asks for it (None where it does not); a ConfigError saying how to
    install it where it is missing (checked before the run writes anything)."""
    if section is None or not section.project:
        return None
    from moerl.errors import ConfigError

    wandb, error = import_or_error("wandb")
    if wandb is not None:
        return wandb
    key = f"config key 'metrics.wandb.project'={section.project!r}"
    off = 'set metrics.wandb.project to "" to log without it'
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{key}: Weights & Biases is not installed here; pip install 'moerl[wandb]' (or {off})")
    raise ConfigError(
        f"{key}: Weights & Biases is installed but does not import ({error}); reinstall it (pip install "
        f"--force-reinstall 'moerl[wandb]') or {off}"
    )


def _wandb_run(run_dir: Path, section, config: dict):
    """The W&B run of ``run_dir``: one id per run directory (kept in ``run_dir/wandb_id``), so a resumed run goes on
    logging to the same W&B run; its files under ``run_dir/wandb``; the console left to moerl."""
    import uuid

    wandb = wandb_module(section)
    id_file = run_dir / "wandb_id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:16])
    return wandb.init(
        project=section.project,
        entity=section.entity,
        mode=section.mode,
        dir=str(run_dir),
        id=id_file.read_text().strip(),
        name=run_dir.name,
        resume="allow",
        config=config,
        settings=wandb.Settings(console="off", silent=True),
    )


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``. A cut last line (a crash mid-write) is skipped; any other line that is
    not a JSON row with a ``step`` is a ConfigError naming the line."""
    from moerl.errors import ConfigError

    path = Path(run_dir) / METRICS
    if not path.exists():
        raise ConfigError(f"{path} does not exist: not a moerl run directory")
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise ConfigError(f"{path} line {n} is not valid JSON") from None
        except RecursionError:  # json's decoder recurses once per level of nesting
            raise ConfigError(f"{path} line {n} is JSON nested too deep to read") from None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise ConfigError(f"{path} line {n} is not a metrics row (a JSON object with an integer 'step')")
        rows.append(row)
    return rows


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """A PNG of reward / accuracy and of the rollout-vs-trainer mismatch (R3 on and off) per step, written to ``out``
    (default ``run_dir/curves.png``); a path it cannot write is a RunDirError naming it."""
    from moerl.errors import ConfigError, RunDirError

    matplotlib, error = import_or_error("matplotlib")
    if matplotlib is None:
        raise ConfigError(f"drawing a run's curves needs matplotlib, which does not import here ({error}); "
                          "pip install matplotlib")  # fmt: skip

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (
        ("reward_mean", "reward mean"),
        ("accuracy", "train accuracy"),
        ("eval_accuracy", "held-out accuracy"),
    ):
        x, y = series(key)
        if x:
            ax1.plot(x, y, marker="o" if key == "eval_accuracy" else None, label=label)
    ax1.set_xlabel("step")
    ax1.set_title("reward")
    ax1.legend()
    for key, label in (("mismatch_k3_r3", "k3 KL, R3 on"), ("mismatch_k3_no_r3", "k3 KL, R3 off")):
        x, y = series(key)
        if x:
            ax2.plot(x, y, label=label)
    ax2.set_yscale("symlog", linthresh=1e-8)
    ax2.set_xlabel("step")
    ax2.set_title("rollout vs trainer logprobs")
    ax2.legend()
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:  # a read-only run directory, a directory where the file goes, a full disk
        raise RunDirError(
            f"cannot write the curves to {out} ({e.strerror or e}): pass --out with a path you can write, e.g. "
            "--out curves.png"
        ) from None
    finally:
        plt.close(fig)
    return out
