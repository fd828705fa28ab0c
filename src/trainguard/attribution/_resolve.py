"""Resolve who printed each match, once per analysis: global ranks and nodes.

The scan keeps, per pattern, the distinct (prefix context, named groups) pairs that printed it
and the launchers' exit reports. :func:`resolve` turns them into ranks and nodes in one pass,
after the scan (the identity facts -- torchrun's failure record, NCCL communicator lines,
``rank N/W on host`` lines -- may come after the line they explain). The verdict only reads the
resulting :class:`Resolution`; nothing goes back to the raw contexts.

Rules, in order, for a line's global rank: a rank prefix or an inline ``[Rank N]``; a ``rank``
group of the row; the pid of a torchrun-reported process; an NCCL ``host:pid`` seen initialising a
communicator; an srun task that ran exactly one known rank, or any srun task when no per-node
launcher (torchrun, DeepSpeed, accelerate) ran under srun -- then task N is rank N; a ``--tee``
local rank on a single node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainguard.attribution._context import LineContext
from trainguard.attribution._registry import Registry
from trainguard.attribution._scan import ExitEvent, Match, ScanState

__all__ = ["Resolution", "resolve"]

_IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


@dataclass
class Resolution:
    """Ranks and nodes per pattern and per exit, computed once from a finished scan."""

    ranks: dict[str, set[int]] = field(default_factory=dict)
    nodes: dict[str, set[str]] = field(default_factory=dict)
    exit_ranks: list[int | None] = field(default_factory=list)
    failed_ranks: set[int] = field(default_factory=set)  # ranks whose own process failed
    failed_pids: set[int] = field(default_factory=set)
    world: int | None = None  # world size, or a lower bound from the ranks seen
    by_printer: dict[tuple[LineContext, tuple[tuple[str, str], ...]], int | None] = field(
        default_factory=dict)  # (context, groups) -> global rank, resolved once

    def match_rank(self, m: Match, state: ScanState) -> int | None:
        key = (m.ctx, m.groups)
        if key not in self.by_printer:  # beyond the scan's per-pattern key cap only
            self.by_printer[key] = _rank(m.ctx, dict(m.groups), state)
        return self.by_printer[key]

    def ranks_of(self, ids: list[str]) -> set[int]:
        return set().union(*(self.ranks.get(i, set()) for i in ids)) if ids else set()

    def nodes_of(self, ids: list[str]) -> set[str]:
        return set().union(*(self.nodes.get(i, set()) for i in ids)) if ids else set()

    def is_everyone(self, ranks: set[int]) -> bool:
        return bool(self.world) and set(range(self.world or 0)) <= ranks


def _task_rank(task: int, state: ScanState) -> int | None:
    ranks = state.task_ranks.get(task, set())
    if len(ranks) == 1:  # this task is exactly one training process
        return next(iter(ranks))
    if not ranks and not state.per_node_launcher:
        return task  # srun started the ranks itself: task N is rank N
    return None


def _rank(ctx: LineContext, groups: dict[str, str], state: ScanState) -> int | None:
    if ctx.rank is not None:
        return ctx.rank
    if groups.get("rank") is not None:
        return int(groups["rank"])
    if ctx.pid is not None and ctx.pid in state.pid_global:
        return state.pid_global[ctx.pid]
    if ctx.node and ctx.pid is not None and (ctx.node, ctx.pid) in state.pid_rank:
        return state.pid_rank[(ctx.node, ctx.pid)][1]
    task = ctx.task if ctx.task is not None else groups.get("task")
    if task is not None:
        return _task_rank(int(task), state)
    # --tee local rank equals the global rank only on a single node
    if ctx.local_rank is not None and len(set(state.rank_host.values())) <= 1 and (
            state.world_size is None or ctx.local_rank < state.world_size):
        return ctx.local_rank
    return None


def _host(name: str, state: ScanState) -> str:
    return state.ip_host.get(name, name) if _IP.match(name) else name


def _nodes(ctx: LineContext, g: dict[str, str], state: ScanState) -> set[str]:
    named = [v for k, v in g.items() if k.startswith("node")]
    node = ctx.node or (named[0] if named else None)
    if node is None:
        r = _rank(ctx, g, state)
        if r is not None:
            node = state.rank_host.get(r)
    if node is None and ctx.task is not None:
        node = state.task_host.get(ctx.task)
    out = {_host(node, state)} if node else set()
    if g.get("peer"):
        out.add(_host(g["peer"], state))
    return out


def _exit_rank(e: ExitEvent, state: ScanState) -> int | None:
    if e.rank is not None:
        return e.rank
    if e.pid is not None and e.pid in state.pid_global:
        return state.pid_global[e.pid]
    if e.task is not None:
        return _task_rank(e.task, state)
    return None


def resolve(state: ScanState, reg: Registry) -> Resolution:
    """Resolve every pattern's printers and every exit report once.

    Takes time linear in the distinct (context, groups) pairs kept by the scan (at most 4096
    per pattern); never re-reads the log.
    """
    res = Resolution()
    for pid, who in state.who.items():
        ranks: set[int] = set()
        nodes: set[str] = set()
        for ctx, groups in who:
            g = dict(groups)
            r = res.by_printer[(ctx, groups)] = _rank(ctx, g, state)
            if r is not None:
                ranks.add(r)
            nodes |= _nodes(ctx, g, state)
        res.ranks[pid], res.nodes[pid] = ranks, nodes
    for e in state.exits:
        r = _exit_rank(e, state)
        res.exit_ranks.append(r)
        if reg.exit_category(e.code, e.sender) is None:  # stopped, not failed by itself
            continue
        if r is not None:
            res.failed_ranks.add(r)
        if e.pid is not None:
            res.failed_pids.add(e.pid)
    seen = state.ranks_seen | set(state.rank_host) | {r for rs in res.ranks.values() for r in rs}
    # without a world-size line, the ranks seen bound it from below (one rank bounds nothing)
    res.world = state.world_size or (max(seen) + 1 if len(seen) >= 2 else None)
    return res
