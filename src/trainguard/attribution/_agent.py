"""Restart agent: analysis + history of earlier cycles -> RESTART / RESTART_EXCLUDE_NODES / STOP /
CONTINUE with a one-sentence reason. Deterministic; the only stage that decides.

Rules, in priority order (the category policy from the registry is the default):

1. STOP and CONTINUE verdicts of the analysis stand (deterministic workload faults, completion,
   cancellation, a healthy job).
2. Retry budget: after ``max_restarts`` earlier cycles, STOP.
3. Same root, no progress: when the same failure fingerprint ended ``same_root_limit``
   consecutive cycles (this one included) without the step or checkpoint advancing, STOP; any
   progress resets the count, so a job that keeps checkpointing through flaky hardware keeps
   restarting.
4. Otherwise restart (excluding the culprit nodes when the analysis names them).

Follows: NVRx restart agent L3 (history) and L4 (policy; general_retry ceiling of 3).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.attribution.errors import AttributionError
from trainguard.errors import ConfigError

__all__ = ["NO_FR_DECISION", "AgentDecision", "RestartPolicy", "decide",
           "decide_from_flight_recorder", "flight_recorder_record", "load_history"]


@dataclass(frozen=True)
class RestartPolicy:
    """Limits of the restart agent.

    Attributes:
        same_root_limit: consecutive cycles with the same fingerprint and no progress that end
            in STOP (>= 1).
        max_restarts: total earlier cycles allowed before STOP; ``None`` for no budget.
    """

    same_root_limit: int = 3
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        if self.same_root_limit < 1:
            raise ConfigError(f"same_root_limit must be >= 1, got {self.same_root_limit}")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0 or None, got {self.max_restarts}")


@dataclass(frozen=True)
class AgentDecision:
    """The agent's verdict."""

    decision: str
    reason: str
    rule: str
    repeats: int
    progressed: bool | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _step(rec: Mapping[str, Any]) -> tuple[int, int]:
    prog = rec.get("progress") or {}
    return (prog.get("last_step") or -1, prog.get("last_checkpoint_step") or -1)


def _progressed(now: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    a, b = _step(now), _step(before)
    return a[0] > b[0] or a[1] > b[1]


def decide(result: Mapping[str, Any], history: Iterable[Mapping[str, Any]] = (),
           policy: RestartPolicy | None = None) -> AgentDecision:
    """Decide what to do after the cycle described by ``result`` (an ``AnalysisResult.to_dict()``).

    Args:
        result: this cycle's analysis.
        history: earlier cycles' analyses of the same job, oldest first.
        policy: limits; defaults to :class:`RestartPolicy()`.
    """
    policy = policy or RestartPolicy()
    hist = list(history)
    base = result["decision"]
    cat = result["primary_category"]
    progressed = _progressed(result, hist[-1]) if hist else None
    if base in ("STOP", "CONTINUE"):
        return AgentDecision(base, result.get("reason") or f"{cat}: {base}", "category_policy",
                             0, progressed)
    if policy.max_restarts is not None and len(hist) >= policy.max_restarts:
        return AgentDecision("STOP", f"{cat} again after {len(hist)} restarts: the retry budget "
                             f"of {policy.max_restarts} is spent.", "retry_budget", 0, progressed)
    repeats, current = 1, result
    for prev in reversed(hist):
        if prev.get("fingerprint") != result.get("fingerprint") or _progressed(current, prev):
            break
        repeats, current = repeats + 1, prev
    if repeats >= policy.same_root_limit:
        return AgentDecision("STOP", f"{cat} ended {repeats} consecutive cycles with no training "
                             "progress in between, so restarting again will not help.",
                             "same_root_no_progress", repeats, progressed)
    reason = result.get("reason") or f"{cat}: {base}"
    if repeats > 1:
        reason = (f"{cat} repeated {repeats} time(s) without progress (limit "
                  f"{policy.same_root_limit}); {base} once more. " + reason)
    return AgentDecision(base, reason, "category_policy", repeats, progressed)


NO_FR_DECISION = ("no decision: the flight-recorder dumps show no missing or stuck rank and no "
                  "logs were given, so there is no failure to attribute; pass the job's logs")


def decide_from_flight_recorder(fr: Mapping[str, Any], history: Iterable[Mapping[str, Any]] = (),
                                policy: RestartPolicy | None = None,
                                hang_decision: str = "RESTART") -> AgentDecision | None:
    """Decide from flight-recorder dumps alone (no logs), or ``None`` when they show no fault.

    Faulty ranks mean a collective hang localised to them: the ``collective_timeout`` policy
    (``hang_decision``, RESTART in the shipped registry) applies, through :func:`decide`, so the
    same hang repeating without progress still ends in STOP.

    Args:
        fr: a ``FlightRecorderReport.to_dict()``.
        history: earlier cycles' results, oldest first.
        policy: restart-agent limits.
        hang_decision: the registry's decision for ``collective_timeout``.
    """
    record = flight_recorder_record(fr, hang_decision)
    return None if record is None else decide(record, history, policy)


def flight_recorder_record(fr: Mapping[str, Any],
                           hang_decision: str = "RESTART") -> dict[str, Any] | None:
    """The result record (``primary_category``, ``fingerprint``, ``decision``, ``reason``,
    ``progress``, ``culprit_ranks``) that dumps alone support, or ``None`` with no faulty rank.
    Records like this may be fed back as history."""
    if not fr.get("faulty_ranks"):
        return None
    stuck = fr.get("first_stuck") or {}
    where = (f" at {stuck.get('op')} seq {stuck.get('collective_seq_id')} in "
             f"{stuck.get('pg_desc')}" if stuck else "")
    reason = (f"flight recorder (no logs): ranks {fr['faulty_ranks']} never joined or never "
              f"completed a collective{where} (missing {fr.get('missing_ranks')}, incomplete "
              f"{fr.get('incomplete_ranks')}); a collective hang, whose policy is {hang_decision}."
              " Pass the job's logs to learn why those ranks stalled.")
    return {"primary_category": "collective_timeout", "decision": hang_decision,
            "reason": reason, "culprit_ranks": list(fr["faulty_ranks"]),
            "progress": {"last_step": None, "last_checkpoint_step": None},
            "fingerprint": f"collective_timeout:fr:{stuck.get('pg_desc')}:{stuck.get('op')}"}


def load_history(path: str) -> list[dict[str, Any]]:
    """Read earlier cycles' results: a JSON list or JSON lines of ``analyze --json`` outputs.

    Raises:
        AttributionError: unreadable file or a record without ``primary_category``/``decision``.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise AttributionError(f"cannot read history {path!r}: {exc}") from exc
    text = text.strip()
    try:
        records = json.loads(text) if text.startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise AttributionError(f"history {path!r} is not JSON or JSON lines: {exc}") from exc
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "primary_category" not in rec or "decision" not in rec:
            raise AttributionError(f"history {path!r} record {i} lacks primary_category/decision;"
                                   " write it with `trainguard analyze --json`")
    return records
