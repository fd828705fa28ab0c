"""``Tree``: topology-aware rank assignment with spare (reserve) ranks and backfill.

Follows: NVRx ``inprocess.rank_assignment.Tree`` (layers with min/max ranks, RESERVE and BACKFILL
flags, the same six reassignment steps); differences: the tree is rebuilt whenever a call's first
assignment arrives (``Mode.INITIALIZED``) or after :meth:`Tree.reset`, so nothing leaks between
Wrapper calls, no exception or State is cached, and an inactive rank gets ``active_rank=None``
with ``Mode.INACTIVE`` (never the string "None").
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from trainguard._core.clock import as_seconds
from trainguard._core.store import wait_key
from trainguard.errors import ConfigError
from trainguard.inprocess.exceptions import BarrierOverflow, BarrierTimeout, InternalError
from trainguard.inprocess.rank_assignment._base import (
    KEY_PREFIX,
    RankAssignment,
    RankAssignmentCtx,
    checked_state,
    discard,
    next_sequence,
    require_store,
)
from trainguard.inprocess.rank_assignment._filter_count import resolve_key
from trainguard.inprocess.rank_assignment._tree_model import Layer, TreeEntry, TreeModel
from trainguard.inprocess.state import Mode, State

__all__ = ["Tree", "announce"]


def announce(
    store: dist.Store, state: State, layers: Sequence[Layer], index: int, count: int
) -> str:
    """Publish this rank's key path as participant ``index`` of ``count``; returns the namespace.

    Raises:
        BarrierOverflow: more than ``count`` ranks published (ranks disagree on who survives).
    """
    ns = f"{KEY_PREFIX}/tree/{next_sequence(store, state, 'tree')}"
    frozen = state.freeze()
    keys = [resolve_key(layer.key_or_fn, frozen, layer) for layer in layers]
    initial = state.initial_rank if state.initial_rank is not None else state.rank
    store.set(f"{ns}/rec/{index}", json.dumps({"initial_rank": initial, "keys": keys}))
    total = int(store.add(f"{ns}/count", 1))
    if total > count:
        raise BarrierOverflow(f"Tree: {total} ranks published their keys, expected {count}")
    if total == count:
        store.set(f"{ns}/done", b"1")
    return ns


def _gather(store: dist.Store, ns: str, count: int, timeout_s: float) -> list[tuple[int, tuple]]:
    if not wait_key(store, f"{ns}/done", timeout_s, interval_s=0.1):
        missing = [i for i in range(count) if not store.check([f"{ns}/rec/{i}"])]
        raise BarrierTimeout(
            f"Tree: ranks {missing[:32]} (numbered among survivors) did not publish their keys "
            f"within {timeout_s:.1f} s",
            count - len(missing),
        )
    raw = store.multi_get([f"{ns}/rec/{i}" for i in range(count)])
    records = [json.loads(r) for r in raw]
    return [(int(r["initial_rank"]), tuple(r["keys"])) for r in records]


def _exchanges_keys(store: object) -> bool:
    """A store offering NVRx's key exchange (``send_key``/``get_keys``) rather than c10d's."""
    return (store is not None and not isinstance(store, dist.Store)
            and hasattr(store, "send_key") and hasattr(store, "get_keys"))


class Tree(RankAssignment):
    """Topology-aware assignment: ranks are leaves of a tree of layers (e.g. job, host).

    First assignment of a call (state in ``Mode.INITIALIZED``): every rank publishes its key
    path through the store and builds the same tree; leaves are activated in depth-first order
    while every ancestor stays below its ``max_ranks``, the rest are spares. Each later
    assignment, computed locally from the terminated set:

    1. bottom-up, every node with fewer healthy ranks than ``min_ranks`` is terminated;
    2. each lost active rank (ascending ``active_rank``) climbs its ancestors and, at RESERVE
       layers, takes the first spare (tree order) that keeps the spare's ancestors within
       ``max_ranks``; the spare inherits its ``active_rank``;
    3. remaining gaps are filled by moving the highest active ranks of the same BACKFILL domain;
    4. active ranks are shifted to close what is left (A shrinks);
    5. ``world_size_filter(A)`` (an int in [0, A]) deactivates the excess;
    6. ``rank`` is renumbered in order among the survivors; terminated ranks are discarded.

    Inactive ranks get ``active_rank=None`` and ``Mode.INACTIVE``. It cannot be composed with
    re-indexing steps (it re-indexes itself); a ``FilterCountGroupedByKey`` to its right works.

    Per-call reset (spec defect 4): the cached tree is rebuilt whenever the state is in
    ``Mode.INITIALIZED`` (the first assignment of every Wrapper call), and :meth:`reset` drops
    it explicitly. Only plain data is cached (no State, exception or store).

    Args:
        layers: root first. The root's key must be the same on every rank.
        world_size_filter: optional ``f(A) -> A'`` with ``0 <= A' <= A``.
        timeout: limit for the first call's key exchange (timedelta or seconds).

    Raises:
        RankDiscarded: this rank was terminated (lost, or its branch fell below ``min_ranks``).
        BarrierTimeout: not every survivor published its keys within ``timeout``.
        ConfigError: invalid layers, differing root keys, or a bad ``world_size_filter`` result.
        InternalError: the state does not match the cached tree (call :meth:`reset`).
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        world_size_filter: Callable[[int], int] | None = None,
        timeout: timedelta | float = timedelta(seconds=60),
    ) -> None:
        layers = list(layers)
        if not layers or not all(isinstance(x, Layer) for x in layers):
            raise ConfigError(f"Tree needs a non-empty list of Layer objects, got {layers!r}")
        if world_size_filter is not None and not callable(world_size_filter):
            raise ConfigError(
                f"world_size_filter must be callable or None, got {world_size_filter!r}"
            )
        self.layers = layers
        self.world_size_filter = world_size_filter
        self.timeout_s = as_seconds(timeout, "timeout")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        self._model: TreeModel | None = None

    def __repr__(self) -> str:
        return f"Tree({self.layers!r})"

    def reset(self) -> None:
        """Forget the cached tree; the next call rebuilds it through the store."""
        self._model = None

    def table(self) -> list[TreeEntry]:
        """Every rank's current assignment (empty before the first call); same on every rank."""
        return [] if self._model is None else self._model.table()

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = checked_state(ctx, self)
        rank = cast(int, state.rank)  # checked_state: an int in [0, world_size)
        dead = ctx.terminated_ranks
        if self._model is None or state.mode is Mode.INITIALIZED:
            self._model = None
            if _exchanges_keys(ctx.store):
                model, own = self._build_from_key_store(ctx, state), rank
            else:
                if rank in dead:
                    raise discard(state, self, f"it is in the terminated set {sorted(dead)}")
                model = self._build(ctx, state)
                own = rank - sum(r < rank for r in dead)
        else:
            model = self._model
            if len(model.order) != state.world_size:
                raise InternalError(
                    f"Tree holds {len(model.order)} ranks but the state has world_size="
                    f"{state.world_size}; call Tree.reset() at the start of every Wrapper call"
                )
            own = model.order[rank]
            try:
                model.reassign(set(dead), self.world_size_filter)
            except BaseException:
                self._model = None  # half-updated: never reuse it
                raise
        self._model = model
        if model.mode[own] is Mode.TERMINATED:
            why = (
                f"it is in the terminated set {sorted(dead)}"
                if state.rank in dead
                else "its branch has fewer healthy ranks than a layer's min_ranks"
            )
            raise discard(state, self, why)
        return dataclasses.replace(
            ctx, state=self._result(model, own, state), terminated_ranks=set()
        )

    def _build_from_key_store(self, ctx: RankAssignmentCtx, state: State) -> TreeModel:
        """Build from a store with NVRx's key-exchange methods (every rank's path at once).

        The terminated ranks of this first call are applied after the build, as NVRx does.
        """
        store: Any = ctx.store
        frozen = state.freeze()
        store.send_key([resolve_key(x.key_or_fn, frozen, x) for x in self.layers], state.rank)
        ranks = list(range(state.world_size))
        paths = store.get_keys(ranks)
        states = store.get_states(ranks) if hasattr(store, "get_states") else [None] * len(ranks)
        initial = [r if s is None or getattr(s, "initial_rank", None) is None else s.initial_rank
                   for r, s in zip(ranks, states, strict=True)]
        model = TreeModel(self.layers, [(ir, tuple(p)) for ir, p in
                                        zip(initial, paths, strict=True)])
        model.activate_initial(self.world_size_filter)
        if ctx.terminated_ranks:
            model.reassign(set(ctx.terminated_ranks), self.world_size_filter)
        return model

    @property
    def init_rank_map(self) -> dict[int, Any]:
        """Initial rank -> node with ``.state`` (a :class:`State` of that rank), from the cached
        tree; empty before the first call. For NVRx code; prefer :meth:`table`."""
        model = self._model
        if model is None:
            return {}
        rank_of = {leaf: r for r, leaf in enumerate(model.order)}
        out: dict[int, Any] = {}
        for leaf, initial in enumerate(model.initial):
            out[initial] = types.SimpleNamespace(state=State(
                rank=rank_of.get(leaf), world_size=len(model.order),
                active_rank=model.active[leaf], active_world_size=model.active_world_size,
                initial_rank=initial, initial_world_size=len(model.initial),
                mode=model.mode[leaf]))
        return out

    def _build(self, ctx: RankAssignmentCtx, state: State) -> TreeModel:
        store = require_store(ctx, self)
        dead = ctx.terminated_ranks
        count = state.world_size - len(dead)
        index = state.rank - sum(r < state.rank for r in dead)  # type: ignore[operator]
        ns = announce(store, state, self.layers, index, count)
        model = TreeModel(self.layers, _gather(store, ns, count, self.timeout_s))
        model.activate_initial(self.world_size_filter)
        return model

    def _result(self, model: TreeModel, leaf: int, state: State) -> State:
        active = model.active[leaf]
        return dataclasses.replace(
            state,
            rank=model.order.index(leaf),
            world_size=len(model.order),
            active_rank=active,
            active_world_size=model.active_world_size,
            mode=Mode.ACTIVE if active is not None else Mode.INACTIVE,
        )
