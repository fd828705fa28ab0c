"""Opt-in actions on each scored window: log lines, metrics files, a report file, exclusion.

Hysteresis lives in the scorer (a rank is flagged after ``consecutive`` windows and cleared after
``clear_windows``); actions react to its events, so one noisy window never logs or excludes.
Nothing is done for warm-up windows. Files are written by the aggregator thread:

* ``straggler.jsonl``: one :meth:`Report.to_dict` line per window (input of
  ``trainguard straggler report``);
* ``straggler.prom``: Prometheus text exposition of the latest window (atomic rewrite, for the
  node-exporter textfile collector);
* ``straggler_report.json``: the latest report.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from trainguard.straggler.report import Report

__all__ = ["Actions", "ExcludeRequest"]

ExcludeRequest = Callable[[str, int, Report], None]


@dataclasses.dataclass(frozen=True)
class Actions:
    """What to do with scored windows; everything is off unless asked for.

    Attributes:
        log: log a WARNING line when a rank is flagged or cleared or exclusion is requested, and
            an INFO line per window.
        run_dir: write ``straggler.jsonl``, ``straggler.prom`` and ``straggler_report.json`` there.
        on_exclude: called as ``on_exclude(node, rank, report)`` once per node after
            ``exclude_windows`` windows above ``exclude_ratio`` (the launcher's "exclude this
            node" request plugs in here). Exceptions it raises are logged, not propagated.
    """

    log: bool = False
    run_dir: str | os.PathLike[str] | None = None
    on_exclude: ExcludeRequest | None = None


def _prom(report: Report) -> str:
    lines = [
        "# HELP trainguard_straggler_window Last scored window.",
        "# TYPE trainguard_straggler_window gauge",
        f"trainguard_straggler_window {report.window}",
        "# HELP trainguard_straggler_step_ms Median step time over ranks (ms).",
        "# TYPE trainguard_straggler_step_ms gauge",
        f"trainguard_straggler_step_ms {report.step_ms_median:.6g}",
        "# HELP trainguard_straggler_ratio Rank work time over the median rank's.",
        "# TYPE trainguard_straggler_ratio gauge",
    ]
    for r, v in sorted(report.per_rank.items()):
        node = report.rank_to_node.get(r, "?")
        lines.append(f'trainguard_straggler_ratio{{rank="{r}",node="{node}"}} '
                     f'{v.get("ratio", float("nan")):.6g}')
    lines += ["# HELP trainguard_straggler_flagged 1 for a flagged straggler, by kind.",
              "# TYPE trainguard_straggler_flagged gauge",
              "# HELP trainguard_straggler_est_loss_pct Estimated throughput cost (%).",
              "# TYPE trainguard_straggler_est_loss_pct gauge"]
    for s in report.stragglers:
        labels = f'rank="{s.rank}",node="{s.node}",kind="{s.kind}"'
        lines.append(f"trainguard_straggler_flagged{{{labels}}} 1")
        lines.append(f"trainguard_straggler_est_loss_pct{{{labels}}} {s.est_loss_pct:.6g}")
    lines.append(f"trainguard_straggler_missing_ranks {len(report.missing_ranks)}")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def apply(actions: Actions, report: Report, logger: logging.Logger) -> None:
    """Run the configured actions for ``report`` (aggregator thread; file I/O only)."""
    for warning in report.warnings:
        logger.warning("straggler: %s", warning)
    if actions.log and not report.warmup:
        logger.info("straggler: %s", report.summary_line())
        for ev in report.events:
            logger.warning("straggler: rank %s on node %s %s (%s test) at window %s",
                           ev["rank"], ev["node"], ev["event"], ev.get("test", "exclude"),
                           ev["window"])
    if actions.run_dir is not None:
        run_dir = Path(actions.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "straggler.jsonl", "a") as fh:
            fh.write(report.to_json() + "\n")
        _write_atomic(run_dir / "straggler.prom", _prom(report))
        _write_atomic(run_dir / "straggler_report.json", json.dumps(report.to_dict(), indent=1))
    for ev in () if report.warmup else report.events:
        if ev["event"] != "exclude":
            continue
        if actions.on_exclude is None:
            if actions.log:
                logger.warning("straggler: would request excluding node %s (rank %s); no "
                               "launcher connected", ev["node"], ev["rank"])
            continue
        try:
            actions.on_exclude(ev["node"], ev["rank"], report)
        except Exception:  # an action must never stop reporting
            logger.exception("straggler: exclusion callback failed for node %s", ev["node"])
