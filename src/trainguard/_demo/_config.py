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
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from trainguard._demo._schedule import FaultSpec

__all__ = ["RUN_FILES", "DemoConfig", "clear_run_files"]

# Everything a previous run may have left in the output directory (removed before a new run).
RUN_FILES = (
    "config.json", "data.npz", "checkpoint.pt", "checkpoints", "sync_baseline.pt", "events", "markers", "logs", "pids",
    "summary.json", "timeline.png",
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
        """Absolute pidfile template for the wrapper's monitor process (``{rank}`` = initial rank)."""
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


def clear_run_files(root: Path) -> None:
    """Prepare ``root`` for a new run: create it and remove what a previous demo run left there.

    Other files are left alone, so pointing ``--output-dir`` at a used directory is safe.
    """
    root.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for sub in ("events", "markers", "logs", "pids"):
        (root / sub).mkdir()
