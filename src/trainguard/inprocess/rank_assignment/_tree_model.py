"""The whole job's rank tree behind :class:`Tree`: pure data, identical on every rank.

Nodes are numbered as they first appear in rank order; leaves are ranks. Every operation is a
deterministic function of the records and the terminated sets, so each rank computes the same
tree locally. Costs are O(leaves x layers) per reassignment (16,384 ranks: tens of ms).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from trainguard._core.logging import get_logger
from trainguard.errors import ConfigError
from trainguard.inprocess.state import Mode

__all__ = ["Layer", "LayerFlag", "TreeEntry", "TreeLayoutError", "TreeModel"]

_log = get_logger("trainguard.inprocess.rank_assignment")


class LayerFlag(enum.Flag):
    """Per-layer behaviour of :class:`Tree`; combine with ``|``.

    RESERVE: a lost active rank may be replaced by a spare found under a node of this layer.
    BACKFILL: gaps that no spare filled are filled by moving the highest active ranks within
        the node of the highest layer of the contiguous BACKFILL chain above the leaves.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


@dataclasses.dataclass
class Layer:
    """One depth level of a :class:`Tree` (the first is the root, the last groups the ranks).

    Args:
        min_ranks: a node with fewer healthy (active + spare) ranks below it is terminated with
            all its ranks.
        max_ranks: at most this many active ranks below one node (None: no limit); the others
            are spares.
        key_or_fn: the node a rank belongs to on this level: a constant (str/int) or a function
            of the rank's FrozenState returning a str/int (e.g. the host name). The root
            layer's key must be the same on every rank.
        flag: :class:`LayerFlag` bits (None: neither).

    Fields may be changed after construction (as in NVRx); :class:`Tree` validates them again
    when it builds its tree.

    Raises:
        ConfigError: invalid ``min_ranks``/``max_ranks``/``flag``.
    """

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: Any = ""
    flag: LayerFlag | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields (see the class docstring); ``flag=None`` becomes ``LayerFlag(0)``."""
        if (
            isinstance(self.min_ranks, bool)
            or not isinstance(self.min_ranks, int)
            or (self.min_ranks < 0)
        ):
            raise ConfigError(f"Layer min_ranks must be an int >= 0, got {self.min_ranks!r}")
        if self.max_ranks is not None and (
            isinstance(self.max_ranks, bool)
            or not isinstance(self.max_ranks, int)
            or self.max_ranks < 1
        ):
            raise ConfigError(
                f"Layer max_ranks must be None or an int >= 1, got {self.max_ranks!r}"
            )
        if self.flag is None:
            self.flag = LayerFlag(0)
        elif not isinstance(self.flag, LayerFlag):
            raise ConfigError(f"Layer flag must be a LayerFlag or None, got {self.flag!r}")


class TreeLayoutError(ConfigError, RuntimeError):
    """The ranks' key paths do not form one tree (a ``ConfigError``; also a ``RuntimeError``,
    the type NVRx raises for it)."""


def warn_if_not_rank_ordered(paths: Sequence[tuple]) -> None:
    """Warn (``UserWarning``) when the tree's depth-first leaf order differs from rank order.

    Spares and backfill follow tree order, so such a layout usually means a ``key_or_fn`` that
    does not group neighbouring ranks (e.g. ``rank % 2`` instead of ``rank // 2``).
    """
    seen: dict[tuple, int] = {}
    order = []
    for keys in paths:
        pos = []
        for depth in range(len(keys)):
            prefix = tuple(keys[: depth + 1])
            pos.append(seen.setdefault(prefix, len(seen)))
        order.append(tuple(pos))
    if any(a > b for a, b in itertools.pairwise(order)):
        warnings.warn(
            "Tree: depth-first leaf order differs from rank order; check that each Layer's "
            "key_or_fn groups neighbouring ranks", UserWarning, stacklevel=3,
        )


class TreeEntry(NamedTuple):
    """One rank of the tree: ``rank``/``active_rank`` are None when terminated/inactive."""

    initial_rank: int
    rank: int | None
    active_rank: int | None
    mode: Mode


class TreeModel:
    """Rank tree built from per-rank key paths (``records[i]`` = (initial rank, keys) of rank i).

    Raises:
        ConfigError: the root-layer key differs between ranks.
    """

    def __init__(self, layers: Sequence[Layer], records: Sequence[tuple[int, tuple]]) -> None:
        for layer in layers:
            layer.validate()
        roots = {keys[0] for _, keys in records}
        if len(roots) > 1:
            raise TreeLayoutError(
                f"Tree: the root layer's key must be the same on every rank, got {sorted(roots)}; "
                "give the first Layer a constant key_or_fn"
            )
        warn_if_not_rank_ordered([keys for _, keys in records])
        self.layers = list(layers)
        self.flags = [x.flag if x.flag is not None else LayerFlag(0) for x in self.layers]
        self.initial = [ir for ir, _ in records]
        self._build_nodes([keys for _, keys in records])
        n = len(records)
        self.mode = [Mode.INACTIVE] * n
        self.active: list[int | None] = [None] * n
        self.order = list(range(n))  # current rank -> leaf
        self.active_world_size = 0
        depth = len(self.layers)
        chain = 0
        while chain < depth and LayerFlag.BACKFILL in self.flags[depth - 1 - chain]:
            chain += 1
        self.backfill_depth = depth - chain if chain else None

    def _build_nodes(self, paths: Sequence[tuple]) -> None:
        index: dict[tuple, int] = {}
        self.node_depth: list[int] = []
        self.node_parent: list[int] = []
        ordinal: list[int] = []
        n_children: dict[int, int] = {}
        self.leaf_anc: list[tuple[int, ...]] = []  # per leaf: deepest node ... root
        sort_keys = []
        for leaf, keys in enumerate(paths):
            parent, path = -1, []
            for d in range(len(self.layers)):
                node = index.get(keys[: d + 1])
                if node is None:
                    node = index[keys[: d + 1]] = len(self.node_depth)
                    self.node_depth.append(d)
                    self.node_parent.append(parent)
                    ordinal.append(n_children.get(parent, 0))
                    n_children[parent] = ordinal[-1] + 1
                path.append(node)
                parent = node
            self.leaf_anc.append(tuple(reversed(path)))
            sort_keys.append(tuple(ordinal[x] for x in path) + (leaf,))
        self.dfs = sorted(range(len(paths)), key=sort_keys.__getitem__)
        self.node_leaves: list[list[int]] = [[] for _ in self.node_depth]
        for leaf in self.dfs:
            for node in self.leaf_anc[leaf]:
                self.node_leaves[node].append(leaf)
        self.node_max = [self.layers[d].max_ranks for d in self.node_depth]
        self.nodes_bottom_up = sorted(
            range(len(self.node_depth)), key=lambda x: -self.node_depth[x]
        )
        if self.dfs != list(range(len(paths))):
            _log.warning(
                "Tree: depth-first leaf order differs from rank order; active ranks "
                "follow the tree order"
            )

    # -- helpers -----------------------------------------------------------------------------
    def _fits(self, leaf: int, counts: list[int]) -> bool:
        for node in self.leaf_anc[leaf]:
            cap = self.node_max[node]
            if cap is not None and counts[node] >= cap:
                return False
        return True

    def _activate(self, leaf: int, value: int, counts: list[int]) -> None:
        self.mode[leaf], self.active[leaf] = Mode.ACTIVE, value
        for node in self.leaf_anc[leaf]:
            counts[node] += 1

    def _terminate(self, leaf: int, gaps: list[tuple[int, int]]) -> None:
        if self.mode[leaf] is Mode.ACTIVE:
            gaps.append((self.active[leaf], leaf))  # type: ignore[arg-type]
        self.mode[leaf], self.active[leaf] = Mode.TERMINATED, None

    def _active_counts(self) -> list[int]:
        counts = [0] * len(self.node_depth)
        for leaf, mode in enumerate(self.mode):
            if mode is Mode.ACTIVE:
                for node in self.leaf_anc[leaf]:
                    counts[node] += 1
        return counts

    # -- steps -------------------------------------------------------------------------------
    def activate_initial(self, world_size_filter: Callable[[int], int] | None) -> None:
        """First assignment: leaves in depth-first order are active while every ancestor is
        below its ``max_ranks``; the others are spares."""
        self._enforce_min_ranks([])
        counts = [0] * len(self.node_depth)
        value = 0
        for leaf in self.dfs:
            if self.mode[leaf] is not Mode.TERMINATED and self._fits(leaf, counts):
                self._activate(leaf, value, counts)
                value += 1
        self.active_world_size = value
        self._finish(world_size_filter)

    def reassign(self, terminated: set[int], world_size_filter) -> None:
        """Remove the leaves of ``terminated`` (current ranks) and repair the assignment."""
        gaps: list[tuple[int, int]] = []
        for rank in terminated:
            self._terminate(self.order[rank], gaps)
        self._enforce_min_ranks(gaps)
        gaps.sort()
        counts = self._active_counts()
        spares = _SparePool(self._spare_lists())
        unfilled = []
        for value, dead in gaps:
            spare = self._find_spare(dead, counts, spares)
            if spare is None:
                unfilled.append((value, dead))
            else:
                self._activate(spare, value, counts)
        self._backfill(unfilled)
        self._shift()
        self._finish(world_size_filter)

    def _enforce_min_ranks(self, gaps: list[tuple[int, int]]) -> None:
        """Bottom-up: terminate each branch with fewer healthy leaves than its ``min_ranks``."""
        healthy = [0] * len(self.node_depth)
        for leaf, mode in enumerate(self.mode):
            if mode is not Mode.TERMINATED:
                healthy[self.leaf_anc[leaf][0]] += 1
        for node in self.nodes_bottom_up:
            if healthy[node] < self.layers[self.node_depth[node]].min_ranks:
                for leaf in self.node_leaves[node]:
                    if self.mode[leaf] is not Mode.TERMINATED:
                        self._terminate(leaf, gaps)
                healthy[node] = 0
            if self.node_parent[node] >= 0:
                healthy[self.node_parent[node]] += healthy[node]

    def _spare_lists(self) -> dict[int, list[int]]:
        spares: dict[int, list[int]] = {}
        for leaf in self.dfs:
            if self.mode[leaf] is Mode.INACTIVE:
                for node in self.leaf_anc[leaf]:
                    spares.setdefault(node, []).append(leaf)
        return spares

    def _find_spare(self, dead: int, counts: list[int], pool: _SparePool) -> int | None:
        """Climb from the dead leaf to the root; at each RESERVE node take the first spare (in
        tree order) whose ancestors all stay within ``max_ranks``.

        Counts only grow while spares are taken, so a spare that does not fit now never will
        in this reassignment: it is dropped for good, which keeps the search linear overall.
        """
        for node in self.leaf_anc[dead]:
            if LayerFlag.RESERVE not in self.flags[self.node_depth[node]]:
                continue
            found = pool.first(
                node, lambda x: self.mode[x] is Mode.INACTIVE and self._fits(x, counts)
            )
            if found is not None:
                return found
        return None

    def _backfill(self, unfilled: list[tuple[int, int]]) -> None:
        """In each backfill domain, the highest active ranks move into the lowest gaps."""
        if self.backfill_depth is None or not unfilled:
            return
        up = len(self.layers) - 1 - self.backfill_depth
        by_domain: dict[int, list[int]] = {}
        for value, dead in unfilled:
            by_domain.setdefault(self.leaf_anc[dead][up], []).append(value)
        for domain, holes in by_domain.items():
            alive = [
                (self.active[x], x) for x in self.node_leaves[domain] if self.mode[x] is Mode.ACTIVE
            ]
            keep = set(sorted([v for v, _ in alive] + holes)[: len(alive)])
            movers = sorted((v, x) for v, x in alive if v not in keep)  # type: ignore[type-var]
            targets = sorted(h for h in holes if h in keep)
            for (_, leaf), target in zip(movers, targets):
                self.active[leaf] = target

    def _shift(self) -> None:
        """Renumber active ranks 0 .. A-1 keeping their order (closes the remaining gaps)."""
        live = sorted((v, x) for x, v in enumerate(self.active) if v is not None)
        for new, (_, leaf) in enumerate(live):
            self.active[leaf] = new
        self.active_world_size = len(live)

    def _finish(self, world_size_filter: Callable[[int], int] | None) -> None:
        if world_size_filter is not None:
            limit = world_size_filter(self.active_world_size)
            if (
                isinstance(limit, bool)
                or not isinstance(limit, int)
                or not (0 <= limit <= self.active_world_size)
            ):
                raise ConfigError(
                    f"Tree world_size_filter({self.active_world_size}) returned {limit!r}; it "
                    f"must return an int in [0, {self.active_world_size}]"
                )
            for leaf, value in enumerate(self.active):
                if value is not None and value >= limit:
                    self.mode[leaf], self.active[leaf] = Mode.INACTIVE, None
            self.active_world_size = limit
        self.order = [x for x in self.order if self.mode[x] is not Mode.TERMINATED]

    def table(self) -> list[TreeEntry]:
        """Every leaf's current assignment, indexed by the leaf's build-time rank."""
        rank_of = {leaf: r for r, leaf in enumerate(self.order)}
        return [
            TreeEntry(self.initial[x], rank_of.get(x), self.active[x], self.mode[x])
            for x in range(len(self.initial))
        ]


class _SparePool:
    """Per-node spare lists (tree order) scanned once: rejected or taken spares are skipped."""

    def __init__(self, lists: dict[int, list[int]]) -> None:
        self.lists = lists
        self.pos: dict[int, int] = {}
        self.rejected: set[int] = set()

    def first(self, node: int, usable: Callable[[int], bool]) -> int | None:
        items = self.lists.get(node, [])
        i = self.pos.get(node, 0)
        while i < len(items):
            leaf = items[i]
            if leaf not in self.rejected:
                if usable(leaf):
                    self.pos[node] = i + 1  # the caller takes it
                    return leaf
                self.rejected.add(leaf)
            i += 1
        self.pos[node] = i
        return None
