"""What ended (or did not end) each process: failed exits with their signal, and the faults an
in-process restart recovered from. Read by the verdict, reported as ``failed_exits`` and
``recovered`` in the analysis record.

* A failed exit names its signal in words: ``-9`` (a launcher's "exitcode: -9", "killed by
  signal 9") and ``137`` (a shell's or ``srun``'s 128 + 9) are both ``SIGKILL``.
* A recovered fault is a failure line followed, in the same file, by an in-process restart
  record (``trainguard.inprocess.Wrapper``'s ``restart 0 -> 1: cause=exception ranks=[1]``, NVRx's
  ``[NestedRestarter] ... state=handling stage=completed``), or the traceback printed with the
  Wrapper's ``iteration N raised; restarting all ranks:`` warning (see ``_scan``): the job went
  on after it, so it is reported as recovered, never as the job's failure.
"""

from __future__ import annotations

import signal
from typing import Any

from trainguard.attribution._registry import Registry
from trainguard.attribution._resolve import Resolution
from trainguard.attribution._scan import ExitEvent, Match, Recovery, ScanState

__all__ = ["describe_exit", "exit_ranks", "failed_exits", "recovered", "recovered_note",
           "signal_name"]

_MAX_LISTED = 16
_FIRST_SHELL_SIGNAL = 129  # 128 + N: a shell's (and srun's, Docker's) status for death by signal N
_MAX_SIGNAL = 64


def _signum(code: int) -> int | None:
    """The signal a process died of: ``-9`` (a launcher's form) and ``137`` (128 + 9) are 9."""
    if -_MAX_SIGNAL <= code < 0:
        return -code
    if _FIRST_SHELL_SIGNAL <= code <= 128 + _MAX_SIGNAL:
        return code - 128
    return None


def signal_name(code: int) -> str | None:
    """``SIGKILL`` for ``-9`` and for ``137`` (128 + 9); ``None`` for a plain exit code."""
    num = _signum(code)
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def describe_exit(e: ExitEvent, ranks: list[int]) -> str:
    """``rank 1 killed by SIGKILL (shell status 137)`` / ``ranks 0, 2 exited`` (the code is the
    caller's to add)
    (``ranks``: the ranks that died this way, when the log names them)."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks))}" if ranks else \
        f"local rank {e.local_rank}" if e.local_rank is not None else \
        f"task {e.task}" if e.task is not None else "a process"
    num = _signum(e.code)
    if num is None:
        return f"{who} exited"
    return f"{who} killed by {signal_name(e.code)} (shell status {128 + num})"


def _same_exit(a: ExitEvent, b: ExitEvent) -> bool:
    """The same kind of death: the same signal (``-9`` and ``137`` alike) or exit code, sent by
    the same sender."""
    na, nb = signal_name(a.code), signal_name(b.code)
    same = na == nb if na is not None or nb is not None else a.code == b.code
    return same and a.sender == b.sender


def exit_ranks(state: ScanState, res: Resolution, failed: list[ExitEvent],
               first: ExitEvent) -> set[int]:
    """Ranks of the failed exits that died like ``first`` (same signal or code, same sender)."""
    return {r for e, r in zip(state.exits, res.exit_ranks)
            if r is not None and e in failed and _same_exit(e, first)}


def failed_exits(state: ScanState, res: Resolution, reg: Registry) -> list[dict[str, Any]]:
    """Every failed process exit the launchers report, in log order (at most 16): rank (or
    ``None`` when no line names it), code, signal name, who sent the signal, node."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int | None, int]] = set()
    for e, r in zip(state.exits, res.exit_ranks):
        if reg.exit_category(e.code, e.sender) is None:
            continue
        # one death reported twice (torchrun's "failed (exitcode: -9)" line and its record)
        key = ("rank", r, e.code) if r is not None else ("pid", e.pid, e.code) \
            if e.pid is not None else None
        if key is not None and key in seen:
            prev = next(x for x in out if x["_key"] == key)
            prev["node"] = prev["node"] or e.node
            continue
        if key is not None:
            seen.add(key)
        out.append({"rank": r, "local_rank": e.local_rank, "code": e.code,
                    "signal": signal_name(e.code), "sender": e.sender, "node": e.node,
                    "line": e.order[1], "file": state.files[e.order[0]], "_key": key})
        if len(out) >= _MAX_LISTED:
            break
    for x in out:
        del x["_key"]
    return out


def _strongest(faults: list[Match]) -> Match | None:
    """The fault line that stands for a recovery: a root or confirmation before a cascade, then
    the strongest row (its severity counted), then the earliest."""
    def key(m: Match) -> tuple[int, float, tuple[int, int]]:
        weak = {"info": 10.0, "warning": 3.0}.get(m.level, 0.0)
        return (m.pattern.role == "cascade", weak - m.pattern.tier, m.order)
    return min(faults, key=key) if faults else None


def _ranks(rec: Recovery, state: ScanState, res: Resolution) -> list[int]:
    if rec.ranks:  # the Wrapper's record names the faulty ranks
        return sorted(rec.ranks)
    ranks = {res.match_rank(m, state) for m in rec.faults if m.pattern.role != "cascade"}
    return sorted(r for r in ranks if r is not None)


def recovered(state: ScanState, res: Resolution) -> list[dict[str, Any]]:
    """The in-process restarts, each with the fault it recovered from (category, ranks, the
    cited line): ``iteration``, ``cause``, ``ranks``, ``category`` (``None`` when no failure line
    precedes the record), ``file``/``line``/``text`` of the fault (else of the record)."""
    out = []
    for rec in state.recoveries:
        m = _strongest(rec.faults)
        cited = {"file": state.files[m.file], "line": m.line, "text": m.text,
                 "pattern": m.pattern.id} if m is not None else \
            {"file": state.files[rec.order[0]], "line": rec.order[1], "text": rec.text,
             "pattern": rec.pattern}
        out.append({"iteration": rec.iteration, "cause": rec.cause,
                    "ranks": _ranks(rec, state, res),
                    "category": m.pattern.category if m is not None else None, **cited})
    return out


def recovered_note(items: list[dict[str, Any]], total: int) -> str:
    """``in-process restart recovered 1 fault(s) before: code_exception on rank(s) 1 (restart
    0 -> 1) at log:17``; empty without recoveries."""
    if not items:
        return ""
    parts = []
    for it in items[:3]:
        what = it["category"] or it["cause"] or "a fault"
        ranks = f" on rank(s) {', '.join(map(str, it['ranks']))}" if it["ranks"] else ""
        step = f" (restart {it['iteration']} -> {it['iteration'] + 1})" \
            if it["iteration"] is not None else ""
        parts.append(f"{what}{ranks}{step} at {it['file']}:{it['line']}")
    more = f" and {total - 3} more" if total > 3 else ""
    return (f"in-process restart recovered {total} fault(s) in this log: "
            f"{'; '.join(parts)}{more}")
