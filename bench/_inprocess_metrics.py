"""Turn the workload's per-rank event logs into per-fault restart figures (seconds)."""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["FaultFigures", "fault_figures", "load_events", "median"]


@dataclass
class FaultFigures:
    """What one injected fault cost; ``None`` where the run never got that far.

    Attributes:
        kind: ``exc``, ``hang`` or ``kill``.
        rank: initial rank the fault was injected on.
        iteration: restart iteration (torchrun: attempt) the fault happened in.
        world: ranks in that iteration.
        reentered_s: fault -> the last rank (survivors, and a reserve rank that took over) entered
            the next iteration.
        first_step_s: fault -> the last such rank completed its first step after restart.
        detect_s: hang only: hang start -> the hung call was interrupted.
        wrapper_detect_s: the wrapper's own fault -> detection figure (ours only).
        wrapper_interrupt_s: the wrapper's own fault -> last rank interrupted (ours only).
        wrapper_restart_s: the wrapper's own fault -> re-entry figure, slowest rank (ours only).
    """

    kind: str
    rank: int
    iteration: int
    world: int
    reentered_s: float | None = None
    first_step_s: float | None = None
    detect_s: float | None = None
    wrapper_detect_s: float | None = None
    wrapper_interrupt_s: float | None = None
    wrapper_restart_s: float | None = None

    @property
    def recovered(self) -> bool:
        return self.first_step_s is not None


def load_events(out_dir: str) -> list[dict[str, Any]]:
    """All events of all ranks, in time order; a line torn by a SIGKILL is skipped."""
    events = []
    for path in glob.glob(os.path.join(out_dir, "ev_*.jsonl")):
        with open(path, errors="replace") as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return sorted(events, key=lambda e: e["t"])


def _by(events: list[dict[str, Any]], name: str, it: int) -> dict[int, dict[str, Any]]:
    """First event ``name`` of iteration ``it`` per rank."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["e"] == name and e.get("it") == it and e["rank"] not in out:
            out[e["rank"]] = e
    return out


def _last_after(got: dict[int, dict[str, Any]], expected: set[int], t0: float) -> float | None:
    """Seconds from ``t0`` until the last rank of ``got``; None if an expected rank is missing.

    ``got`` may hold more ranks than ``expected``: a reserve rank that took over a lost one.
    """
    if not expected or not expected <= set(got):
        return None  # some survivor never made it: not recovered
    return max(e["t"] for e in got.values()) - t0


def fault_figures(events: list[dict[str, Any]]) -> list[FaultFigures]:
    """One :class:`FaultFigures` per ``fault`` event, in order."""
    figures = []
    for fault in (e for e in events if e["e"] == "fault"):
        it, rank, t0 = fault["it"], fault["rank"], fault["t"]
        members = set(_by(events, "enter", it))
        survivors = members - {rank} if fault["kind"] == "kill" else members
        fig = FaultFigures(fault["kind"], rank, it, len(members))
        fig.reentered_s = _last_after(_by(events, "enter", it + 1), survivors, t0)
        fig.first_step_s = _last_after(_by(events, "step", it + 1), survivors, t0)
        if fault["kind"] == "hang":
            end = _by(events, "hang_end", it).get(rank)
            fig.detect_s = end["t"] - t0 if end else None
        records = list(_by(events, "record", it + 1).values())
        restart = [float(r["restart_s"]) for r in records if r.get("restart_s") is not None]
        detect = [float(r["detection_s"]) for r in records if r.get("detection_s") is not None]
        fig.wrapper_restart_s = max(restart) if restart else None
        fig.wrapper_detect_s = min(detect) if detect else None
        hit = [
            float(r["interrupt_time"]) - float(r["fault_time"])
            for r in records
            if r.get("interrupt_time") is not None and r.get("fault_time") is not None
        ]
        fig.wrapper_interrupt_s = max(hit) if hit else None
        figures.append(fig)
    return figures


def median(values: list[float | None], minus: float = 0.0) -> float | None:
    """Median of the measured values (``None`` if any is missing: an unrecovered fault)."""
    if not values or any(v is None for v in values):
        return None
    return round(statistics.median(values) - minus, 4)  # type: ignore[type-var]
