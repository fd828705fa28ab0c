"""The one analysis pipeline: logs and/or flight-recorder dumps -> a decision record.

Assembled here once and called by every front end -- ``trainguard analyze``, the attribution
service and the launcher -- so the same inputs give the same record everywhere (one
``job_ended`` default, one merge of the flight-recorder verdict, one restart agent).

Stages, data flowing one way: scan (streaming, registry-driven) -> resolve ranks/nodes once ->
score evidence -> category verdict -> flight-recorder merge -> restart agent (history).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.attribution._agent import (
    NO_FR_DECISION,
    RestartPolicy,
    decide,
    flight_recorder_record,
)
from trainguard.attribution._analyze import analyze_logs
from trainguard.attribution._flight_recorder import analyze_flight_recorder
from trainguard.attribution._registry import load_registry
from trainguard.attribution.errors import LogInputError

__all__ = ["JOB_ENDED_DEFAULT", "analysis_part", "analyze"]

#: The one default for ``job_ended``: the caller does not know, so the log decides (a log with
#: progress and no failure or exit is ``in_progress``; a failed exit is never ``in_progress``).
JOB_ENDED_DEFAULT = False


def analyze(
    logs: Sequence[str | os.PathLike[str]] = (),
    *,
    fr_dir: str | os.PathLike[str] | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    policy: RestartPolicy | None = None,
    registry_path: str | None = None,
    replace_registry: bool = False,
    job_ended: bool = JOB_ENDED_DEFAULT,
    fr_within: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Analyse one job attempt and decide what to do next.

    Args:
        logs: text logs of the attempt, in reading order (one per node is fine). An input that
            cannot be read as a text log is flagged (``flagged_inputs``, a warning) and the
            decision is STOP, as long as another input could be read.
        fr_dir: flight-recorder dumps (a directory or a file prefix).
        history: earlier cycles' records of this job (what this function returned), oldest first.
        policy: restart-agent limits (default :class:`RestartPolicy`).
        registry_path: a YAML pattern registry merged on the shipped one (or replacing it with
            ``replace_registry``).
        job_ended: the caller knows the job has ended: a log with progress and no failure is
            then ``unknown`` instead of ``in_progress``. Default :data:`JOB_ENDED_DEFAULT`.
        fr_within: directories the dumps must lie in (the service's allow-list), or ``None``.

    Returns:
        A JSON-ready dict: the analysis keys of :meth:`AnalysisResult.to_dict` (when logs were
        given), ``flight_recorder`` (when ``fr_dir`` was), ``category_decision`` and
        ``category_reason`` (the category policy's answer), ``decision`` and ``reason`` (the
        restart agent's, ``None`` when dumps alone show nothing stuck) and ``agent``.
        :func:`analysis_part` recovers the analysis record alone (what history holds).

    Raises:
        LogInputError: neither logs nor ``fr_dir``, or no log could be read.
        FlightRecorderError: the dumps cannot be read or lie outside ``fr_within``.
        AttributionError: the registry is invalid.

    Blocks for the time the reads take: about 1 s per 100 MB of log (the scan streams in 1 MiB
    chunks in constant memory); no network, no subprocess.
    """
    if not logs and fr_dir is None:
        raise LogInputError("nothing to analyse: give at least one log file or a "
                            "flight-recorder directory")
    policy = policy or RestartPolicy()
    out: dict[str, Any] = {}
    if logs:
        out = analyze_logs(logs, registry_path=registry_path, replace_registry=replace_registry,
                           job_ended=job_ended).to_dict()
        verdict = decide(out, history, policy)
        out["category_decision"], out["category_reason"] = out["decision"], out["reason"]
        out["decision"], out["reason"] = verdict.decision, verdict.reason
        out["agent"] = verdict.to_dict()
    if fr_dir is not None:
        _merge_flight_recorder(out, os.fspath(fr_dir), history, policy, registry_path,
                               replace_registry, fr_within, has_logs=bool(logs))
    return out


def _merge_flight_recorder(out: dict[str, Any], fr_dir: str,
                           history: Sequence[Mapping[str, Any]], policy: RestartPolicy,
                           registry_path: str | None, replace_registry: bool,
                           within: Sequence[str] | None, *, has_logs: bool) -> None:
    fr = out["flight_recorder"] = analyze_flight_recorder(
        fr_dir, within=list(within) if within is not None else None).to_dict()
    if not has_logs:
        reg = load_registry(registry_path, replace=replace_registry)
        record = flight_recorder_record(fr, reg.categories["collective_timeout"].decision)
        if record is None:
            out["decision"], out["reason"], out["agent"] = None, NO_FR_DECISION, None
            return
        verdict = decide(record, history, policy)
        out.update(record, category_decision=record["decision"], agent=verdict.to_dict())
        out["decision"], out["reason"] = verdict.decision, verdict.reason
    elif out.get("primary_category") == "collective_timeout" and not out["culprit_ranks"] \
            and fr["faulty_ranks"]:
        # the log cannot say who hung; the dumps can
        out["culprit_ranks"] = fr["faulty_ranks"]
        out["reason"] += f" Flight recorder: ranks {fr['faulty_ranks']} are stuck."


#: keys :func:`analyze` adds to the analysis record (the restart agent's and the dumps')
_PIPELINE_KEYS = ("category_decision", "category_reason", "agent", "flight_recorder")


def analysis_part(out: Mapping[str, Any]) -> dict[str, Any] | None:
    """The log analysis record inside an :func:`analyze` result: its own ``decision`` and
    ``reason`` (the category policy's), without the agent's and the dumps' keys; ``None`` when
    no log was analysed. This is what a job's history holds, cycle by cycle.
    """
    if "category_reason" not in out:
        return None
    part = {k: v for k, v in out.items() if k not in _PIPELINE_KEYS}
    part["decision"], part["reason"] = out["category_decision"], out["category_reason"]
    return part
