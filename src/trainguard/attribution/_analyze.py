"""Public entry point of the log engine: :func:`analyze_logs`."""

from __future__ import annotations

import os
from collections.abc import Sequence

from trainguard.attribution._registry import load_registry
from trainguard.attribution._result import AnalysisResult
from trainguard.attribution._scan import scan_files
from trainguard.attribution._verdict import build_result

__all__ = ["analyze_logs"]


def analyze_logs(
    paths: Sequence[str | os.PathLike[str]],
    *,
    registry_path: str | None = None,
    replace_registry: bool = False,
    job_ended: bool = False,
) -> AnalysisResult:
    """Analyse one or many log files of one job attempt and attribute its failure.

    Streams each file in 1 MiB chunks (memory does not grow with log size). Deterministic: the
    same input always gives the same result.

    Args:
        paths: log files, in the order their lines should be read (e.g. one per node).
        registry_path: a YAML pattern registry merged on top of the shipped one (rows with a
            shipped ``id`` override it, new rows are added; see :func:`load_registry`).
        replace_registry: use ``registry_path`` instead of the shipped registry (it must then
            declare every category).
        job_ended: the job is known to have ended; a log with progress and no failure is then
            ``unknown`` instead of ``in_progress``.

    Returns:
        The :class:`AnalysisResult` (category, domain, culprits, cascades, decision, evidence).

    Raises:
        LogInputError: no paths, a missing/unreadable/binary file, or every file empty.
        AttributionError: ``registry_path`` is invalid.
    """
    reg = load_registry(registry_path, replace=replace_registry)
    state = scan_files([os.fspath(p) for p in paths], reg)
    return build_result(state, reg, job_ended=job_ended)
