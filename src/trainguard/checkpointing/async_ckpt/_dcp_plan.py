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
from typing import Any, cast

import torch
import torch.distributed as dist

from trainguard.checkpointing._staging import TensorRef

__all__ = ["DcpPlanner"]

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
        if warm:  # importing DCP takes ~0.5 s: pay it at construction, not in the first save
            import torch.distributed.checkpoint._dedup_save_plans
            import torch.distributed.checkpoint.default_planner  # noqa: F401
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

        key = _plan_key(local)
        changed = torch.tensor([0 if key == self._key else 1], dtype=torch.int32)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=group)
        if changed.item():
            world = dist.get_world_size(group)
            plans: list[Any] = [None] * world
            dist.all_gather_object(plans, local, group=group)
            mine = dedup_save_plans(plans)[dist.get_group_rank(group, dist.get_rank())]
            self._key, self._kept = key, {_item_key(i) for i in mine.items}
            self.gathers += 1
        return dataclasses.replace(local, items=[i for i in local.items
                                                 if _item_key(i) in self._kept])
