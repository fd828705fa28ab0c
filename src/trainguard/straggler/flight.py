"""Per-collective arrival lateness from PyTorch flight-recorder dumps (no instrumentation).

Every rank's flight recorder stamps ``time_created_ns`` when the rank issues a collective, that
is when it *arrives* at it. Matching one collective across ranks by process group and
``collective_seq_id`` gives each rank's lateness: its arrival minus the earliest arrival, which
equals "the longest wait over ranks minus this rank's own wait" (the others wait for the last
arriver). A rank that is late at most collectives is the straggler; the per-collective table
also shows *which* collectives (op, process group) it is late for.

Sources: files written by torch (``TORCH_FR_DUMP_TEMP_FILE`` / NCCL watchdog dumps, one per
rank) through :func:`lateness_from_path`, or dumps gathered in memory
(``trainguard._core.flight_recorder.own_dump`` on each rank) through :func:`collective_lateness`.
Works on gloo and NCCL (torch 2.13, ``TORCH_FR_BUFFER_SIZE`` > 0). ``time_created_ns`` is the
wall clock: across nodes the figures include clock skew (NTP: typically < 1 ms).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainguard._core import flight_recorder as _fr
from trainguard.straggler._stats import median
from trainguard.straggler.errors import StragglerError

__all__ = ["CollectiveArrival", "collective_lateness", "lateness_by_rank", "lateness_from_path"]


@dataclasses.dataclass(frozen=True)
class CollectiveArrival:
    """One collective as seen by every rank that recorded it.

    Attributes:
        group: process-group name. seq: ``collective_seq_id`` in that group. op: e.g.
            ``gloo:all_reduce``. arrivals_ns: rank -> ``time_created_ns`` (wall clock, ns).
    """

    group: str
    seq: int
    op: str
    arrivals_ns: dict[int, int]

    @property
    def lateness_ms(self) -> dict[int, float]:
        """rank -> arrival minus the earliest arrival, in ms (0 for the first arriver)."""
        first = min(self.arrivals_ns.values())
        return {r: (t - first) / 1e6 for r, t in self.arrivals_ns.items()}

    @property
    def last_rank(self) -> int:
        """The rank everyone else waited for."""
        return max(self.arrivals_ns, key=lambda r: (self.arrivals_ns[r], r))


def collective_lateness(dumps: dict[int, dict[str, Any]]) -> list[CollectiveArrival]:
    """Collectives recorded by at least two ranks, oldest first (point-to-point ops skipped).

    Args:
        dumps: rank -> a flight-recorder dump (``load_dumps`` or ``own_dump`` format).
    """
    found: dict[tuple[str, int], tuple[str, dict[int, int]]] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            created, seq = entry.get("time_created_ns"), entry.get("collective_seq_id")
            if entry.get("is_p2p") or not isinstance(created, int) or not isinstance(seq, int):
                continue
            group = str((entry.get("process_group") or ("?",))[0])
            op = str(entry.get("profiling_name", "?"))
            found.setdefault((group, seq), (op, {}))[1][int(rank)] = created
    out = [CollectiveArrival(g, s, op, arr) for (g, s), (op, arr) in found.items()
           if len(arr) >= 2]
    return sorted(out, key=lambda c: min(c.arrivals_ns.values()))


def lateness_by_rank(arrivals: list[CollectiveArrival]) -> dict[int, dict[str, float]]:
    """Per rank: ``count``, ``median_ms``, ``p90_ms``, ``max_ms`` lateness and ``last_pct``
    (the share of collectives it arrived last at, in %)."""
    per: dict[int, list[float]] = {}
    last: dict[int, int] = {}
    for c in arrivals:
        for r, ms in c.lateness_ms.items():
            per.setdefault(r, []).append(ms)
        last[c.last_rank] = last.get(c.last_rank, 0) + 1
    out = {}
    for r, values in sorted(per.items()):
        values.sort()
        out[r] = {"count": float(len(values)), "median_ms": median(values),
                  "p90_ms": values[min(len(values) - 1, int(0.9 * len(values)))],
                  "max_ms": values[-1], "last_pct": 100.0 * last.get(r, 0) / len(values)}
    return out


def lateness_from_path(path: str) -> dict[int, dict[str, float]]:
    """:func:`lateness_by_rank` of the dumps under ``path`` (directory, file prefix or file).

    Raises:
        StragglerError: no readable dumps, or they come from different jobs (the message says
            which file and why).
    """
    try:
        dumps = _fr.load_dumps(path)
    except _fr.FlightRecorderError as exc:
        raise StragglerError(str(exc)) from None
    return lateness_by_rank(collective_lateness(dumps))
