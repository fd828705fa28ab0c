"""``FilterCountGroupedByKey``: drop whole groups of ranks whose size fails a condition.

Follows: NVRx ``FilterCountGroupedByKey`` (two store barriers, marks ranks only); differences:
keys are namespaced per invocation (a store can be reused), the key function gets a FrozenState,
and barrier timeouts raise ``BarrierTimeout`` naming the step.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainguard._core.clock import as_seconds
from trainguard._core.store import StoreBarrierOverflow, StoreBarrierTimeout, counting_barrier
from trainguard.errors import ConfigError
from trainguard.inprocess.exceptions import BarrierOverflow, BarrierTimeout
from trainguard.inprocess.rank_assignment._base import (
    KEY_PREFIX,
    RankAssignment,
    RankAssignmentCtx,
    checked_state,
    next_sequence,
    require_store,
)
from trainguard.inprocess.state import FrozenState

__all__ = ["FilterCountGroupedByKey", "KeyOrFn", "resolve_key"]

KeyOrFn = str | int | Callable[[FrozenState], Any]


def resolve_key(key_or_fn: KeyOrFn, state: FrozenState, owner: object) -> str:
    """The JSON text of ``key_or_fn(state)`` (or of the constant key).

    Raises:
        TypeError: the key is not JSON-serializable (use str or int keys).
    """
    key = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    try:
        return json.dumps(key, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{owner!r}: key {key!r} on rank {state.rank} is not JSON-serializable; return a str "
            "or int (e.g. socket.gethostname())"
        ) from exc


class FilterCountGroupedByKey(RankAssignment):
    """Group the surviving ranks by key and terminate every group whose size fails ``condition``.

    Each survivor computes ``key_or_fn(frozen_state)`` (a str/int constant is one group),
    counts itself in its group through the store, waits at a barrier, and if
    ``condition(group_size)`` is False marks its rank; after a second barrier every rank adds
    all marked ranks to ``terminated_ranks``. It only marks ranks: a following (right-hand in
    ``Compose``) re-indexing step discards them, e.g.
    ``Compose(ShiftRanks(), FilterCountGroupedByKey(lambda s: s.rank // 2, lambda n: n == 2))``.

    Example (W=8, pairs, T={1,4,5,6}): T becomes {0,1,4,5,6,7}; ShiftRanks then maps 2->0, 3->1.

    Blocks up to ``2 * timeout``; a rank already in ``terminated_ranks`` takes no part.

    Args:
        key_or_fn: group key, or a function of the FrozenState returning one (str or int).
        condition: predicate on the group size; False removes the whole group.
        timeout: per-barrier limit (timedelta or seconds).

    Raises:
        BarrierTimeout: not every survivor reached a barrier within ``timeout``.
        BarrierOverflow: more ranks arrived than survive (ranks disagree on the terminated set).
        ConfigError: invalid arguments (at construction).
    """

    def __init__(
        self,
        key_or_fn: KeyOrFn,
        condition: Callable[[int], bool],
        timeout: timedelta | float = timedelta(seconds=60),
    ) -> None:
        if not callable(condition):
            raise ConfigError(f"condition must be callable(int) -> bool, got {condition!r}")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout_s = as_seconds(timeout, "timeout")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout_s}")

    def __repr__(self) -> str:
        return f"FilterCountGroupedByKey({self.key_or_fn!r}, {self.condition!r})"

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = checked_state(ctx, self)
        store = require_store(ctx, self)
        if state.rank in ctx.terminated_ranks:
            return ctx  # leaves through the following re-indexing step
        ns = f"{KEY_PREFIX}/filter_count/{next_sequence(store, state, 'filter_count')}"
        survivors = state.world_size - len(ctx.terminated_ranks)
        group = resolve_key(self.key_or_fn, state.freeze(), self)
        count_key = f"{ns}/group/{group}"
        store.add(count_key, 1)
        self._barrier(store, f"{ns}/counted", survivors, state.rank)
        size = int(store.add(count_key, 0))
        if not self.condition(size):
            store.append(f"{ns}/drop", f"{state.rank},")
        self._barrier(store, f"{ns}/marked", survivors, state.rank)
        raw = store.get(f"{ns}/drop").decode() if store.check([f"{ns}/drop"]) else ""
        dropped = {int(x) for x in raw.split(",") if x}
        return dataclasses.replace(ctx, terminated_ranks=set(ctx.terminated_ranks) | dropped)

    def _barrier(self, store, key: str, count: int, rank: int) -> None:
        try:
            counting_barrier(store, key, count, self.timeout_s, interval_s=0.1)
        except StoreBarrierTimeout as exc:
            raise BarrierTimeout(
                f"{self!r} on rank {rank}: {exc}; a surviving rank did not run rank assignment "
                f"within {self.timeout_s:.1f} s",
                exc.arrived,
            ) from exc
        except StoreBarrierOverflow as exc:
            raise BarrierOverflow(
                f"{self!r} on rank {rank}: {exc}; ranks disagree on the terminated set"
            ) from exc
