"""Trainer-side DCP save planning: DTensor and ShardedTensor shards, deduplication, plan cache.

The trainer plans with torch's ``DefaultSavePlanner`` (so the checkpoint is what
``torch.distributed.checkpoint.save`` would write and ``dcp.load`` can reshard it), resolves
every write item to this rank's data (the local shard of a ``DTensor``, each local shard of a
``ShardedTensor``, a plain tensor, or the pickled bytes of any other value) and hands the writer
only plain tensors and bytes: the writer process has no process group or device mesh.

Deduplication: an item that several ranks hold (a plain tensor or value under the same key, or a
``DTensor`` shard replicated over a mesh dimension) is written by one rank only, chosen by torch's
``dedup_save_plans`` (the rank with the least planned bytes so far). The chosen assignment is
cached: each save costs one scalar all-reduce ("did any rank's plan change?"); the plans are
all-gathered again only when some rank's plan changed.

Follows: ``torch.distributed.checkpoint.state_dict_saver`` (local plan -> global dedup ->
write) and NVRx's plan cache; difference: no per-save gather once the plans are stable.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import threading
from typing import Any, cast

import torch
import torch.distributed as dist

from trainguard._core.logging import get_logger
from trainguard.checkpointing._staging import TensorRef

__all__ = ["DcpPlanner", "import_dcp", "import_dcp_in_background"]

_log = get_logger("trainguard.checkpointing")
_DCP_MODULES = ("torch.distributed.checkpoint.default_planner",
                "torch.distributed.checkpoint._dedup_save_plans")
_IMPORT_WAIT_S = 300.0  # longest a first save waits for the background import (then imports)
_import_lock = threading.Lock()
_import_thread: list[threading.Thread] = []


def import_dcp() -> None:
    """Import the DCP modules the planner uses (blocking: ~0.5 s idle, 8-11 s measured on a
    2-core machine at load 11; nothing once imported)."""
    import torch.distributed.checkpoint._dedup_save_plans
    import torch.distributed.checkpoint.default_planner  # noqa: F401


def _import_quietly() -> None:
    try:
        import_dcp()
    except Exception as exc:  # noqa: BLE001 - the first plan() imports again and raises there
        _log.debug("background import of DCP failed: %r", exc)


def import_dcp_in_background() -> threading.Thread | None:
    """Start :func:`import_dcp` in a named daemon thread (one at a time); returns at once with
    the thread to join, or None when the modules are already imported."""
    if all(m in sys.modules for m in _DCP_MODULES):
        return None
    with _import_lock:
        running = [t for t in _import_thread if t.is_alive()]
        if running:
            return running[0]
        t = threading.Thread(target=_import_quietly, name="trainguard-dcp-import", daemon=True)
        _import_thread[:] = [t]
    t.start()
    return t

_PlanKey = list[tuple[str, tuple[int, ...], int, int]]


def _plan_key(plan: Any) -> _PlanKey:
    return [(item.index.fqn, tuple(item.index.offset or ()), int(item.type.value),
             int(item.tensor_storage_size() or 0)) for item in plan.items]


def _item_key(item: Any) -> tuple[str, tuple[int, ...]]:
    return item.index.fqn, tuple(item.index.offset or ())


class DcpPlanner:
    """Plans one rank's DCP writes; keeps the deduplication of the last plan (one per checkpointer).

    Called by the trainer thread inside ``AsyncCheckpointer.save``; with a process group it is a
    collective (all ranks call :meth:`plan` with the same saves in the same order) that blocks for
    one scalar all-reduce (plus one ``all_gather_object`` of the plans when a plan changed),
    bounded by the group's timeout.
    """

    def __init__(self, warm: bool = False) -> None:
        # Importing DCP takes ~0.5 s idle and 8-11 s on a loaded 2-core machine: with ``warm``
        # it runs in a background thread from construction, so neither the constructor nor
        # (usually) the first save pays for it; the first plan() joins it.
        self._warming = import_dcp_in_background() if warm else None
        self._key: _PlanKey | None = None
        self._kept: set[tuple[str, tuple[int, ...]]] = set()
        self.gathers = 0  # how many saves re-gathered the plans (observable for tests)

    def plan(self, state_dict: dict[str, Any], rank: int, group: Any,
             use_dist: bool) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        """Return (skeleton, tensors) for the writer.

        ``skeleton`` = ``{"dcp_plan": SavePlan, "items": [(WriteItem, TensorRef | bytes)]}``:
        the deduplicated local plan and, per item, a reference to the staged tensor (index into
        ``tensors``) or the item's bytes. ``tensors`` are this rank's local shards, still the
        caller's memory (staging copies them).

        Raises:
            ValueError: torch's planner rejects the state (e.g. overlapping shards).
        """
        if self._warming is not None:
            self._warming.join(_IMPORT_WAIT_S)
            self._warming = None
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import WriteItemType

        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, is_coordinator=rank == 0)
        local = planner.create_local_plan()
        plan = self._dedup(local, group, use_dist)
        items: list[tuple[Any, Any]] = []
        tensors: list[tuple[str, torch.Tensor]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                items.append((item, bytes(cast(io.BytesIO, data).getbuffer())))
            else:
                tensors.append((item.index.fqn, cast(torch.Tensor, data)))
                items.append((item, TensorRef(len(tensors) - 1)))
        return {"dcp_plan": plan, "items": items}, tensors

    def _dedup(self, local: Any, group: Any, use_dist: bool) -> Any:
        if not use_dist:
            return local
        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

        # The kept items depend on every rank's plan AND on who the ranks are: after an in-process
        # restart that shrank the world (2 -> 1) an unchanged local plan must not keep the old
        # world's deduplication (rank 0 then wrote only its half, and a committed checkpoint
        # missed the items the lost rank used to write).
        world, me = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
        key = [("", (world, me), -1, -1), *_plan_key(local)]
        changed = torch.tensor([0 if key == self._key else 1], dtype=torch.int32)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=group)
        if changed.item():
            plans: list[Any] = [None] * world
            dist.all_gather_object(plans, local, group=group)
            mine = dedup_save_plans(plans)[me]
            self._key, self._kept = key, {_item_key(i) for i in mine.items}
            self.gathers += 1
        return dataclasses.replace(local, items=[i for i in local.items
                                                 if _item_key(i) in self._kept])
