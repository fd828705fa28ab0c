"""The commit of one save: agree across ranks, then rank 0's writer writes the manifest last.

Trainer side (every rank): :func:`check_same_save` and :func:`raise_for_failures` on the gathered
records, :func:`commit_header` for rank 0's request to its writer. Writer side (rank 0's writer
process): :func:`run_commit` writes the DCP ``.metadata`` (format ``dcp``), the manifest and
``latest``, then prunes to ``keep_last`` - so no fsync or directory scan runs on a trainer thread.
"""

from __future__ import annotations

import pickle
from typing import Any

from trainguard.checkpointing.errors import (
    CheckpointError,
    CheckpointWorkerError,
    CheckpointWriteError,
)

__all__ = ["build_dcp_metadata", "check_same_save", "commit_header", "raise_for_failures",
           "run_commit"]


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
    """Raise the typed error for ``failures`` (global rank -> error text); nothing if empty.

    Raises:
        CheckpointWorkerError: a writer died or was stuck (``dead``).
        CheckpointWriteError: any other failure.
    """
    if not failures:
        return
    what = f"checkpoint step {step}" if step is not None else "async save"
    detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
    cls = CheckpointWorkerError if dead else CheckpointWriteError
    raise cls(f"{what} failed on rank(s) {sorted(failures)}: {detail}. The previous committed "
              "checkpoint is intact; the next save starts a fresh writer if needed.", failures)


def check_same_save(records: list[dict[str, Any]]) -> None:
    """Raises CheckpointError when ranks finalize different saves (a usage error)."""
    steps = {r["step"] for r in records}
    if len(steps) != 1:
        raise CheckpointError(f"ranks finalize different saves {sorted(map(str, steps))}: every "
                              "rank must call save() with the same steps in the same order")


def commit_header(req_id: int, records: list[dict[str, Any]], world_size: int, rel_dir: str,
                  storage_url: str, keep_last: int, fault: dict | None) -> dict[str, Any]:
    """Rank 0: the writer request that commits the save every rank wrote (JSON-able)."""
    files: dict[str, Any] = {}
    for rec in records:
        files.update(rec["files"])
    return {"op": "commit", "id": req_id, "step": records[0]["step"], "kind": records[0]["kind"],
            "world_size": world_size, "files": files, "dir": rel_dir, "storage": storage_url,
            "keep_last": keep_last, "fault": fault}


def run_commit(storage: Any, header: dict[str, Any], extras: list[bytes] | None) -> dict[str, Any]:
    """Writer: write ``.metadata`` (DCP), the manifest (the commit marker) and ``latest``, then
    prune. Returns the reply fields; raises OSError when a write fails (step stays uncommitted).
    """
    from trainguard.checkpointing.manager import CheckpointManager

    manager = CheckpointManager(storage, int(header["keep_last"]))
    step, files = int(header["step"]), dict(header["files"])
    if header["kind"] == "dcp":
        size, digest = storage.write_bytes(f"{header['dir']}/.metadata",
                                           build_dcp_metadata(extras or []))
        files[".metadata"] = {"size": size, "xxh3": digest, "rank": 0}
    manager.commit(step, header["kind"], int(header["world_size"]), files, prune=False)
    try:
        pruned = manager.prune(protect=step)
    except OSError as exc:  # the step is committed; a failed prune is retried after the next
        return {"ok": True, "pruned": [], "prune_error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "pruned": pruned}
