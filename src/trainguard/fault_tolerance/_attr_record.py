"""The launcher's own failure record for one cycle, appended to the cycle log for attribution.

The workers' output says nothing when a rank is SIGKILLed or stopped as hung; the launcher
knows. After a failed cycle it appends one line per failed rank to ``cycle_<N>.log``, with the
prefix ``{node}:launcher: `` (the analyser's prefix layer takes the node from it and no rank);
after that prefix::

    trainguard launcher: cycle 0: rank 1 exited with exitcode 1
    trainguard launcher: cycle 0: rank 1 killed by signal 9 (SIGKILL) from outside the launcher
    trainguard launcher: cycle 0: rank 1 killed as hung after 5 s (heartbeat: ...)
    trainguard launcher: cycle 0: rank 1 killed by signal 9 (SIGKILL) by the launcher (hang
    detection)   [one line]

and after a cycle in which every rank exited 0 (the job's end: a rank's own completion line may
not be logged at its level)::

    trainguard launcher: cycle 0: every rank exited 0

A signal line says who sent it: ``from outside the launcher`` when the rank died while the cycle
was still running (the launcher and its rank monitors had sent nothing), ``by the launcher (hang
detection)`` when the rank's monitor had reported it hung (the monitor's SIGKILL, raced with the
report). ``trainguard.attribution``'s registry reads these rows (``trainguard_rank_exit``, whose
``sender`` feeds ``Registry.exit_category``, and ``trainguard_rank_hung``). Follows:
torchelastic's per-rank failure summary (``ChildFailedError``), one line per rank instead of a
table; unlike it, the record names the signal's sender.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainguard.fault_tolerance._cycle import CycleResult, Failure

__all__ = ["append_record", "record_lines"]

PREFIX = "trainguard launcher"


def _line(cycle: int, failure: Failure, hang_timeouts: dict[int, float],
          hung: set[int]) -> str | None:
    head = f"{PREFIX}: cycle {cycle}: rank {failure.rank}"
    if failure.kind == "hang":
        after = hang_timeouts.get(failure.rank)
        took = f" after {after:.3g} s" if after is not None else ""
        return f"{head} killed as hung{took} ({failure.detail[:200]})"
    code = failure.exitcode
    if failure.kind not in ("exit", "signal") or code is None:
        return None  # peer/fence/no_client/monitor: not about this rank's process exit
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        sender = "by the launcher (hang detection)" if failure.rank in hung \
            else "from outside the launcher"
        return f"{head} killed by signal {-code} ({name}) {sender}"
    return f"{head} exited with exitcode {code}"


def record_lines(node: str, res: CycleResult,
                 hang_events: list[tuple[int, int, int, dict]] | None = None) -> list[str]:
    """The record lines (with the ``{node}:launcher: `` prefix, no newline) for ``res``'s failures,
    earliest first; ``hang_events`` are the launcher's ``(cycle, rank, detected_ns, msg)``."""
    timeouts: dict[int, float] = {}
    for cycle, rank, _, msg in hang_events or ():
        if cycle == res.cycle and isinstance(msg.get("timeout_s"), (int, float)):
            timeouts.setdefault(rank, float(msg["timeout_s"]))
    from trainguard.fault_tolerance._cycle import Outcome

    if res.outcome is Outcome.SUCCEEDED and not res.failures:
        # the job's end in the launcher's words: a rank's own completion line may not be logged
        # at its level (the Wrapper's "call completed" is INFO), so the log would read as cut off
        return [f"{node}:launcher: {PREFIX}: cycle {res.cycle}: every rank exited 0"]
    hung = {f.rank for f in res.failures if f.kind in ("hang", "no_client")}
    out = []
    for failure in sorted(res.failures, key=lambda f: f.at_ns):
        line = _line(res.cycle, failure, timeouts, hung)
        if line is not None:
            out.append(f"{node}:launcher: {line}")
    return out


def append_record(path: str, node: str, res: CycleResult,
                  hang_events: list[tuple[int, int, int, dict]] | None = None) -> None:
    """Append :func:`record_lines` to the cycle log at ``path`` (after the workers' output ended).

    Raises:
        OSError: the log cannot be written (the caller logs it; attribution still runs).
    """
    lines = record_lines(node, res, hang_events)
    if lines:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write("".join(f"{ln}\n" for ln in lines))
