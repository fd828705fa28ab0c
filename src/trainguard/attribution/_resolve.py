"""Resolve who printed a match: global ranks and node names from prefixes and identity facts."""

from __future__ import annotations

import re

from trainguard.attribution._context import LineContext
from trainguard.attribution._scan import ScanState

__all__ = ["nodes_of", "ranks_of"]

_IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def _rank(ctx: LineContext, groups: dict[str, str], state: ScanState) -> int | None:
    if ctx.rank is not None:
        return ctx.rank
    if "rank" in groups:
        return int(groups["rank"])
    if ctx.node and ctx.pid is not None and (ctx.node, ctx.pid) in state.pid_rank:
        return state.pid_rank[(ctx.node, ctx.pid)][1]
    task = ctx.task if ctx.task is not None else groups.get("task")
    if task is not None:
        ranks = state.task_ranks.get(int(task), set())
        if len(ranks) == 1:  # this task is exactly one training process
            return next(iter(ranks))
    # --tee local rank equals the global rank only on a single node
    if ctx.local_rank is not None and len(set(state.rank_host.values())) <= 1 and (
            state.world_size is None or ctx.local_rank < state.world_size):
        return ctx.local_rank
    return None


def ranks_of(state: ScanState, pattern_ids: list[str]) -> set[int]:
    """Global ranks that printed any match of ``pattern_ids``."""
    out: set[int] = set()
    for pid in pattern_ids:
        for ctx, groups in state.who.get(pid, ()):
            r = _rank(ctx, dict(groups), state)
            if r is not None:
                out.add(r)
    return out


def _host(name: str, state: ScanState) -> str:
    return state.ip_host.get(name, name) if _IP.match(name) else name


def nodes_of(state: ScanState, pattern_ids: list[str]) -> set[str]:
    """Nodes implicated by matches of ``pattern_ids``: printing node, named node, peers."""
    out: set[str] = set()
    for pid in pattern_ids:
        for ctx, groups in state.who.get(pid, ()):
            g = dict(groups)
            named = [v for k, v in g.items() if k.startswith("node")]
            node = ctx.node or (named[0] if named else None)
            if node is None:
                r = _rank(ctx, g, state)
                if r is not None:
                    node = state.rank_host.get(r)
            if node is None and ctx.task is not None:
                node = state.task_host.get(ctx.task)
            if node:
                out.add(_host(node, state))
            if g.get("peer"):
                out.add(_host(g["peer"], state))
    return out
