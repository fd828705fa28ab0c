"""Reusing a checkpoint directory: resume from an earlier run's checkpoints or refuse clearly.

A step directory holds one timeline: steps only grow. A save whose step is not newer than the
newest committed step would be deleted by keep-last pruning right after its commit (an earlier
run's steps 28-30 outrank a new run's 5, 10, 15), so :meth:`AsyncCheckpointer.save` refuses it up
front with :func:`refuse_step`, naming the fixes: resume (``load()``), a new directory or
``run_id``, and ``format="dcp"`` when the world size changed under the torch format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from trainguard.checkpointing.manager import CheckpointManager
from trainguard.errors import ConfigError

__all__ = ["ExistingRun", "join_run_id", "refuse_step", "scan_existing"]


@dataclass(frozen=True)
class ExistingRun:
    """The newest committed checkpoint found in the directory when the checkpointer was made."""

    step: int
    world_size: int
    kind: str

    def to_list(self) -> list[Any]:
        return [self.step, self.world_size, self.kind]


def scan_existing(manager: CheckpointManager) -> ExistingRun | None:
    """Newest committed step of ``manager``'s directory (manifest read, checksums not)."""
    for step in reversed(manager.committed_steps()):
        try:
            man = manager.read_manifest(step)
        except Exception:  # noqa: BLE001, S112 - raced with a deletion: try the next one
            continue
        return ExistingRun(step, int(man["world_size"]), str(man["kind"]))
    return None


def join_run_id(root: Any, run_id: str | None) -> Any:
    """``root/run_id`` (local path or URL); ``root`` unchanged without a run id.

    Raises:
        ConfigError: ``run_id`` is empty, contains '/' or is '.'/'..', or ``root`` is missing.
    """
    if run_id is None:
        return root
    if not isinstance(run_id, str) or not run_id or "/" in run_id or run_id in (".", ".."):
        raise ConfigError(f"run_id must be a non-empty name without '/', got {run_id!r}")
    if root is None:
        raise ConfigError("run_id needs a root directory: AsyncCheckpointer(root, run_id=...)")
    text = os.fspath(root)
    return f"{text.rstrip('/')}/{run_id}"


def refuse_step(step: int, newest: int, existing: ExistingRun | None, world_size: int,
                fmt: str, location: str) -> None:
    """Raise the ConfigError for ``save(step)`` when ``newest`` (committed or queued) >= step."""
    if existing is None or newest > existing.step:
        raise ConfigError(f"step {step} is not newer than step {newest}, the last one saved or "
                          "committed by this checkpointer; checkpoints are never overwritten: "
                          "save with increasing steps")
    hint = ("resume from it (load(), then save steps after "
            f"{existing.step}), or start a fresh run in a new directory or with "
            "AsyncCheckpointer(..., run_id='<new id>')")
    if existing.kind == "torch" and existing.world_size != world_size:
        hint = (f"it was written by {existing.world_size} ranks in format 'torch', which cannot be "
                f"resharded to this job's {world_size}: relaunch with {existing.world_size} ranks "
                "to resume, use format='dcp' (reshardable on load) for jobs whose size changes, "
                "or start a fresh run in a new directory or with "
                "AsyncCheckpointer(..., run_id='<new id>')")
    raise ConfigError(
        f"step {step} is not newer than committed step {existing.step} in {location}, which holds "
        f"the checkpoints of an earlier run; keep-last pruning would delete the new saves. {hint}")
