"""The demo's run configuration (written by the parent as JSON, read by every rank) and its files.

Layout of the output directory::

    config.json            this run's DemoConfig
    data.npz               digits train/test split (standardised), made once by the parent
    checkpoints/           trainguard.checkpointing step dirs (one torch file per rank + manifest)
    events/rank{R}.jsonl   one JSON object per line per initial rank R
    markers/fault{I}.json  a fault that already fired (so a restart does not fire it again)
    logs/rank{R}.log       the rank's stdout/stderr
    pids/monitor{R}.pid    the wrapper's monitor process of rank R (reaped by the parent)
    summary.json, timeline.png
    .trainguard-demo       marker: this directory was made by the demo, so a new run may clear it
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from trainguard._demo._schedule import FaultSpec
from trainguard.errors import ConfigError

__all__ = ["MARKER", "RUN_FILES", "DemoConfig", "OutputDirError", "clear_run_files"]

# Written into every output directory the demo uses; only a directory carrying it is ever cleared.
MARKER = ".trainguard-demo"
_MARKER_TEXT = "made by `trainguard demo`; a new demo run may clear this directory's run files\n"

# Everything a previous run may have left in the output directory (removed before a new run,
# only in a directory carrying MARKER).
RUN_FILES = (
    "config.json",
    "data.npz",
    "checkpoint.pt",
    "checkpoints",
    "sync_baseline.pt",
    "events",
    "markers",
    "logs",
    "pids",
    "summary.json",
    "timeline.png",
    "goodput",
    "goodput.json",
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a rank needs; durations in seconds.

    Attributes:
        output_dir: absolute path of the run's directory.
        ranks: active ranks at start; reserve: idle spare ranks.
        steps: global optimizer steps to run; checkpoint_every: steps between checkpoints.
        batch_size: samples per active rank per step.
        seed: seeds the data split, model init and sampling.
        faults: the schedule.
        soft_timeout_s, hard_timeout_s: the wrapper's hang timeouts.
        lr: peak learning rate (cosine decay over ``steps``); hidden: MLP hidden width.
    """

    output_dir: str
    ranks: int = 4
    reserve: int = 1
    steps: int = 160
    checkpoint_every: int = 10
    batch_size: int = 32
    seed: int = 0
    faults: tuple[FaultSpec, ...] = ()
    soft_timeout_s: float = 3.0
    hard_timeout_s: float = 8.0
    lr: float = 2e-3
    hidden: int = 256

    @property
    def world_size(self) -> int:
        """Processes launched: active plus reserve ranks."""
        return self.ranks + self.reserve

    @property
    def root(self) -> Path:
        return Path(self.output_dir)

    def events_path(self, rank: int) -> Path:
        return self.root / "events" / f"rank{rank}.jsonl"

    def marker_path(self, index: int) -> Path:
        return self.root / "markers" / f"fault{index}.json"

    def log_path(self, rank: int) -> Path:
        return self.root / "logs" / f"rank{rank}.log"

    def monitor_pidfile(self) -> str:
        """Absolute pidfile template for the wrapper's monitor process (``{rank}``: initial
        rank)."""
        return str(self.root / "pids" / "monitor{rank}.pid")

    @property
    def checkpoint_dir(self) -> Path:
        """Where the asynchronous checkpointer keeps its committed steps."""
        return self.root / "checkpoints"

    @property
    def data_path(self) -> Path:
        return self.root / "data.npz"

    def save(self) -> Path:
        path = self.root / "config.json"
        data = dataclasses.asdict(self)
        data["faults"] = [f.to_json() for f in self.faults]
        path.write_text(json.dumps(data, indent=2))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DemoConfig:
        data = json.loads(Path(path).read_text())
        data["faults"] = tuple(FaultSpec.from_json(f) for f in data.get("faults", []))
        return cls(**data)


class OutputDirError(ConfigError):
    """The output directory cannot be used (not a directory, not writable, or not the demo's)."""


def _check_ours(root: Path) -> None:
    """Refuse a non-empty directory without the marker: its files belong to someone else."""
    if not root.exists():
        return
    if not root.is_dir():
        raise OutputDirError(f"cannot use output dir '{root}': it exists and is not a directory")
    if (root / MARKER).is_file() or next(root.iterdir(), None) is None:
        return
    raise OutputDirError(
        f"output dir '{root}' is not empty and was not made by trainguard demo (no {MARKER} file); "
        "refusing to clear it; choose an empty or new directory with --output-dir"
    )


def clear_run_files(root: Path) -> None:
    """Prepare ``root`` for a new run: create it, mark it, and remove a previous demo run's files.

    Only a directory that does not exist, is empty, or carries :data:`MARKER` (written by an
    earlier run) is touched; anything else is refused before a single file is removed. Files
    other than :data:`RUN_FILES` are left alone even in a marked directory.

    Raises:
        OutputDirError: ``root`` is not a directory, is a non-empty directory without the marker,
            or cannot be created or written (the message carries the OS's reason).
    """
    try:
        _check_ours(root)
        root.mkdir(parents=True, exist_ok=True)
        (root / MARKER).write_text(_MARKER_TEXT)
        for name in RUN_FILES:
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for sub in ("events", "markers", "logs", "pids"):
            (root / sub).mkdir()
    except OSError as exc:
        raise OutputDirError(f"cannot use output dir '{root}': {os_reason(exc, root)}") from exc


def os_reason(exc: OSError, root: Path) -> str:
    """The OS's reason in words, naming the path when it is not ``root`` itself."""
    reason = exc.strerror or str(exc)
    if exc.filename is not None and Path(exc.filename) != root:
        reason += f" ({exc.filename})"
    return reason
