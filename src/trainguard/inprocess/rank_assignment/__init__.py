"""Rank assignment: which surviving ranks run the wrapped function, and with which ``RANK``.

A rank assignment is a callable ``ctx -> ctx`` on a :class:`RankAssignmentCtx`. Steps compose
with ``Compose`` (rightmost first): re-indexing steps (``ShiftRanks``, ``FillGaps``) consume the
terminated set, then filters (``ActivateAllRanks``, ``MaxActiveWorldSize``,
``ActiveWorldSizeDivisibleBy``) choose the active ranks; ``FilterCountGroupedByKey`` marks extra
ranks for removal and goes to the right of a re-indexing step; ``Tree`` does all of it itself.

Protocol for the restart loop (run on every rank, with that rank's own State):

* before the first iteration of each Wrapper call: ``ctx = ra(RankAssignmentCtx(state, store,
  set()))`` with ``state`` fresh from ``State.from_env()`` (``Mode.INITIALIZED``); this is where
  ``Tree`` (re)builds its tree;
* after each restart, once the iteration barrier passed: ``ctx = ra(RankAssignmentCtx(state,
  store, terminated))`` where ``terminated`` holds the *current* ranks (``State.rank`` of the
  iteration that just ended) of every rank that left; then ``state = ctx.state``;
* ``store`` is shared by all ranks (a per-call or per-iteration ``PrefixStore`` is fine; keys
  are namespaced per invocation under ``trainguard/rank_assignment/``);
* ``RankDiscarded`` means this rank must leave (exit path, not a restart).

Steps never mutate the ctx or state they are given; always use the returned ctx.
"""

from trainguard.inprocess.exceptions import RankDiscarded
from trainguard.inprocess.rank_assignment._base import RankAssignment, RankAssignmentCtx, RankFilter
from trainguard.inprocess.rank_assignment._filter_count import FilterCountGroupedByKey
from trainguard.inprocess.rank_assignment._simple import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    MaxActiveWorldSize,
    ShiftRanks,
    default_rank_assignment,
)
from trainguard.inprocess.rank_assignment._tree import Tree
from trainguard.inprocess.rank_assignment._tree_model import Layer, LayerFlag, TreeEntry

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "Tree",
    "TreeEntry",
    "default_rank_assignment",
]
