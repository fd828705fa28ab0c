"""Collective loading for :class:`AsyncCheckpointer`: agree on the newest step valid everywhere."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from trainguard._core.logging import get_logger
from trainguard.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from trainguard.checkpointing.manager import rank_file
from trainguard.errors import ConfigError

__all__ = ["LoadMixin"]

_log = get_logger("trainguard.checkpointing")


class LoadMixin:
    """Loading half of AsyncCheckpointer (uses its manager, group, rank and world size)."""

    manager: Any
    rank: int
    world_size: int
    use_dist: bool
    _group: Any
    _last_step: int | None

    def _ensure_group(self) -> Any: ...  # provided by AsyncCheckpointer

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None: ...

    # -- load --------------------------------------------------------------------------------
    def _agree_candidates(self) -> list[int]:
        steps = list(reversed(self.manager.committed_steps())) if self.rank == 0 else []  # type: ignore[union-attr]
        if self.use_dist:
            box = [steps]
            self._collective(dist.broadcast_object_list, box,
                             src=dist.get_global_rank(self._group, 0), group=self._group)
            steps = box[0]
        return steps

    def _all_ok(self, ok: bool) -> bool:
        if not self.use_dist:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def find_valid_step(self, step: int | None = None) -> int:
        """Collective: newest committed step whose files verify on every rank (or ``step``).

        Raises:
            CheckpointNotFoundError: none (or ``step`` is not valid on every rank).
            CheckpointMismatchError: the checkpoint has another world size.
        """
        if self.manager is None:
            raise ConfigError("loading needs AsyncCheckpointer(root=...)")
        self._ensure_group()
        candidates = [step] if step is not None else self._agree_candidates()
        skipped: list[tuple[int, Exception | None]] = []
        for s in candidates:
            problem = None
            try:
                man = self.manager.read_manifest(s)
                if man["kind"] == "torch":
                    self.manager.check_world_size(man, self.world_size)
                names = [n for n, f in man["files"].items() if f["rank"] == self.rank]
                self.manager.verify(s, names)
            except CheckpointError as exc:
                if step is not None and not self.use_dist:
                    raise
                problem = exc
            if self._all_ok(problem is None):
                return s
            _log.warning("skipping checkpoint step %s: %s", s, problem or "invalid on another rank")
            if step is not None and problem is not None:
                raise problem
            skipped.append((s, problem))
        if skipped:  # committed checkpoints exist but none fits: never "start fresh" silently
            detail = "; ".join(f"step {s}: {p or 'invalid on another rank'}" for s, p in skipped)
            cls = (CheckpointMismatchError
                   if any(isinstance(p, CheckpointMismatchError) for _, p in skipped)
                   else CorruptCheckpointError)
            raise cls(f"{len(skipped)} committed checkpoint(s) in {self.manager.storage.url}, "
                      f"none valid on every rank: {detail}")
        raise CheckpointNotFoundError(
            f"no committed checkpoint valid on every rank in {self.manager.storage.url}"
            + (f" (requested step {step})" if step is not None else ""))

    def load(self, step: int | None = None, map_location: Any = "cpu",
             weights_only: bool = True) -> tuple[Any, int]:
        """Collective: this rank's torch-format state of the newest valid step; (state, step).

        Corrupt or partial checkpoints are skipped (with a warning) on every rank alike. With
        ``weights_only`` (the default) NumPy arrays, scalars and RNG states load too. Resuming
        this way lets ``save`` continue with steps after the loaded one.
        """
        s = self.find_valid_step(step)
        obj = self.manager.load_file(s, rank_file(self.rank), map_location, weights_only)  # type: ignore[union-attr]
        self._last_step = s
        return obj, s

    def load_dcp(self, state_dict: dict[str, Any], step: int | None = None,
                 checkpoint_id: str | os.PathLike | None = None) -> int | None:
        """Collective: load DCP data in place into ``state_dict`` (DCP reshards as needed).

        Without ``checkpoint_id``: the newest valid committed step of this root (checksums
        verified); returns it. With ``checkpoint_id``: any DCP directory (e.g. written by
        ``torch.distributed.checkpoint.save``), loaded as is; returns None.
        """
        import torch.distributed.checkpoint as dcp

        self._ensure_group()
        group = self._group if self.use_dist else None
        if checkpoint_id is not None:
            dcp.load(state_dict, checkpoint_id=os.fspath(checkpoint_id), process_group=group,
                     no_dist=not self.use_dist)
            return None
        s = self.find_valid_step(step)
        dcp.load(state_dict, checkpoint_id=self.manager.path_of(s),  # type: ignore[union-attr]
                 process_group=group, no_dist=not self.use_dist)
        self._last_step = s
        return s

