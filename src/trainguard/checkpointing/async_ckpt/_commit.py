"""Collective finalize of one save: agree across ranks, write DCP metadata and the manifest last."""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from trainguard._core.logging import get_logger
from trainguard.checkpointing.errors import (
    CheckpointError,
    CheckpointWorkerError,
    CheckpointWriteError,
)
from trainguard.checkpointing.manager import CheckpointManager

__all__ = ["build_dcp_metadata", "commit_collective", "raise_for_failures"]


_log = get_logger("trainguard.checkpointing")


def build_dcp_metadata(extras: list[bytes]) -> bytes:
    """Coordinator: merge every rank's (local plan, write results) into pickled DCP metadata.

    Replicated entries (same fqn and offset on several ranks) are kept once, like DCP's dedup.
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    plans, results = zip(*[pickle.loads(e) for e in extras])
    planner = DefaultSavePlanner()
    global_plans, metadata = planner.create_global_plan(list(plans))
    storage_md = {}
    for plan, rank_results in zip(global_plans, results):
        kept = {item.index for item in plan.items}
        storage_md.update({wr.index: wr.storage_data for wr in rank_results if wr.index in kept})
    metadata.storage_data = storage_md
    metadata.version = CURRENT_DCP_VERSION
    return pickle.dumps(metadata)


def raise_for_failures(step: int | None, failures: dict[int, str], dead: bool) -> None:
    if not failures:
        return
    what = f"checkpoint step {step}" if step is not None else "async save"
    detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
    cls = CheckpointWorkerError if dead else CheckpointWriteError
    raise cls(f"{what} failed on rank(s) {sorted(failures)}: {detail}. The previous committed "
              "checkpoint is intact; the next save starts a fresh writer if needed.", failures)


def _commit(manager: CheckpointManager, records: list[dict], extras: list[bytes | None],
            world_size: int) -> None:
    step, kind = records[0]["step"], records[0]["kind"]
    files: dict[str, Any] = {}
    for rec in records:
        files.update(rec["files"])
    if kind == "dcp":
        rel = f"{manager.step_dir(step)}/.metadata"
        size, digest = manager.storage.write_bytes(rel, build_dcp_metadata(extras))  # type: ignore[arg-type]
        files[".metadata"] = {"size": size, "xxh3": digest, "rank": 0}
    manager.commit(step, kind, world_size, files, prune=False)  # pruned after the broadcast


def commit_collective(manager: CheckpointManager, record: dict, extra: bytes | None,
                      group: Any, rank: int, world_size: int) -> None:
    """All ranks: gather records, coordinator commits, everyone learns the outcome.

    Raises:
        CheckpointWriteError / CheckpointWorkerError: on every rank when any rank failed or the
            commit itself failed (e.g. ENOSPC on the manifest).
        CheckpointError: ranks disagree on which save is at the head of their queue.
    """
    if group is None:
        gathered = [(record, extra)]
    else:
        gathered = [None] * world_size  # type: ignore[list-item]  # filled by all_gather_object
        dist.all_gather_object(gathered, (record, extra), group=group)
    records = [g[0] for g in gathered]  # type: ignore[index]
    steps = {r["step"] for r in records}
    if len(steps) != 1:
        raise CheckpointError(f"ranks finalize different saves {sorted(map(str, steps))}: every "
                              "rank must call save() with the same steps in the same order")
    step = records[0]["step"]
    failures = {r["rank"]: r["error"] for r in records if not r["ok"]}
    dead = any(r.get("dead") for r in records)
    outcome: list[Any] = [None]
    if not failures and rank == 0:
        try:
            _commit(manager, records, [g[1] for g in gathered], world_size)  # type: ignore[index]
        except OSError as exc:
            outcome[0] = f"commit of manifest failed: {type(exc).__name__}: {exc}"
    if failures and rank == 0:
        try:  # uncommitted leftovers of the failed save; may fail too (EROFS, EIO)
            manager.storage.remove(manager.step_dir(step))
        except OSError as exc:  # the outcome must still reach every rank
            _log.warning("could not remove the failed save's directory %s: %s",
                         manager.step_dir(step), exc)
    if group is not None:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
    if outcome[0] is not None:
        failures = {0: outcome[0]}
    raise_for_failures(step, failures, dead)
