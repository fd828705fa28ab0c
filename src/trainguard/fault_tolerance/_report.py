"""After a failed cycle: attribution verdict, progress tracker, control requests; and the final
summary table."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

from trainguard.fault_tolerance._attr_record import append_record
from trainguard.fault_tolerance._cycle import CycleResult, Outcome

if TYPE_CHECKING:
    from trainguard.fault_tolerance._agent import Launcher

__all__ = ["after_failure", "preload_summary", "print_summary", "read_iteration"]

_log = logging.getLogger("trainguard.fault_tolerance")


def read_iteration(path: str) -> int | None:
    """The iteration in a checkpoint-iteration file (first integer token), None if unreadable."""
    try:
        with open(path) as fh:
            text = fh.read(4096)
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _attribute(launcher: Launcher, res: CycleResult) -> str:
    """The attribution decision for this cycle's log ('' when unavailable)."""
    ft = launcher.spec.ft
    log = launcher.cycle_log(res.cycle)
    if not ft.attribution or not os.path.isfile(log) or os.path.getsize(log) == 0:
        return ""
    try:
        if ft.attrsvc_url:
            from trainguard.attribution import AttributionClient

            with AttributionClient(ft.attrsvc_url, timeout_s=10.0) as client:
                rec = client.submit(launcher.spec.run_id, [log], cycle=res.cycle, job_ended=True)
                done = client.wait(rec["id"], timeout_s=30.0)
            result = done.get("result") or {}
            decision, reason = str(result.get("decision", "")), str(result.get("reason", ""))
        else:
            from trainguard.attribution import analyze

            # the one pipeline (as the CLI and the service); this cycle is known to have ended
            out = analyze([log], job_ended=True)
            decision, reason = str(out["decision"]), str(out["reason"])
    except Exception as exc:  # noqa: BLE001 - attribution must never end the job by itself
        _log.warning("cycle %d: attribution unavailable: %s", res.cycle, exc)
        return ""
    _log.info("cycle %d attribution: %s (%s)", res.cycle, decision, reason)
    return decision


def _attribute_async(launcher: Launcher, res: CycleResult) -> None:
    res.verdict = _attribute(launcher, res)


def _progress(launcher: Launcher, res: CycleResult) -> bool:
    """Update the no-progress counter; True when the job must stop (no progress for N cycles)."""
    ft = launcher.spec.ft
    if ft.max_no_progress_cycles <= 0:
        return False
    if ft.checkpoint_iteration_file:
        it = read_iteration(ft.checkpoint_iteration_file)
        if it is None:
            return False  # unreadable: skip this cycle
        prev, launcher.last_iteration = launcher.last_iteration, it
        progressed = prev is None or it - prev >= ft.min_progress_iterations
    elif any(r.progress for r in launcher.results):
        progressed = res.progress >= ft.min_progress_iterations
    else:
        return False  # no progress source: the tracker stays inactive
    launcher.no_progress = 0 if progressed else launcher.no_progress + 1
    if launcher.no_progress >= ft.max_no_progress_cycles:
        _log.error("no progress for %d cycle(s) in a row: stopping with the no-restart exit code "
                   "%d", launcher.no_progress, ft.no_restart_exit_code)
        return True
    return False


def after_failure(launcher: Launcher, res: CycleResult) -> int | None:
    """The exit code that ends the job now, or None to restart."""
    ft = launcher.spec.ft
    root = res.root_cause
    if root is not None:
        _log.error("cycle %d failed: rank %d %s", res.cycle, root.rank, root.detail)
    try:  # what the launcher knows (exit codes, signals, hangs) goes into what attribution reads
        append_record(launcher.cycle_log(res.cycle), launcher.node, res, launcher.hang_events)
    except OSError as exc:
        _log.warning("cycle %d: cannot append the launcher record: %s", res.cycle, exc)
    if ft.attribution_stop_action == "no-restart":
        res.verdict = _attribute(launcher, res)  # the restart decision waits for the verdict
    else:  # only logged: never delay the restart for it
        thread = threading.Thread(target=_attribute_async, args=(launcher, res),
                                  name=f"tg-launch-attribution-{res.cycle}", daemon=True)
        thread.start()
        launcher.background.append(thread)
    if res.verdict == "STOP" and ft.attribution_stop_action == "no-restart":
        _log.error("attribution verdict STOP: not restarting (exit %d)", ft.no_restart_exit_code)
        return ft.no_restart_exit_code
    if root is not None and root.kind == "no_client":
        _log.error("rank %d never connected to its rank monitor although client timeouts are "
                   "configured: a restart will not fix this (exit %d)", root.rank,
                   ft.no_restart_exit_code)
        return ft.no_restart_exit_code
    if launcher.stop_requested:
        _log.error("%s: not restarting (exit %d)", launcher.stop_requested,
                   ft.no_restart_exit_code)
        return ft.no_restart_exit_code
    if _progress(launcher, res):
        return ft.no_restart_exit_code
    return None


def preload_summary() -> None:
    """Import what :func:`print_summary` needs ahead of time (about 0.1-0.5 s on a loaded
    machine), so a launcher that must exit fast (a fenced node) does not pay it then."""
    import importlib

    for name in ("rich.console", "rich.markup", "rich.table"):
        try:
            importlib.import_module(name)
        except ImportError:
            return


def print_summary(launcher: Launcher) -> None:
    """One row per cycle on stderr, then the root cause of the first failed cycle; nothing when
    no cycle ran (a spare, or bad input found while joining: its one error line stays alone)."""
    if not launcher.results:
        return
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:  # rich is a dependency; stay useful without it
        for r in launcher.results:
            print(f"cycle {r.cycle}: {r.outcome.value}", file=sys.stderr)
        return
    table = Table(title=f"trainguard launch {launcher.spec.run_id}: {len(launcher.results)} "
                        f"cycle(s), logs in {launcher.run_dir}")
    cols = ["cycle", "outcome", "start", "duration (s)", "root cause", "verdict"]
    with_stragglers = any(r.stragglers for r in launcher.results)
    if with_stragglers:
        cols.append("stragglers")
    for col in cols:
        table.add_column(col)
    for r in launcher.results:
        root = r.root_cause
        cause = f"rank {root.rank}: {root.detail}" if root else ""
        if r.outcome is Outcome.SIGNALLED:
            cause = f"launcher got signal {r.signum}"
        row = [str(r.cycle), r.outcome.value, "warm" if r.warm else "cold",
               f"{(r.ended_ns - r.started_ns) / 1e9:.1f}", escape(cause[:160]), r.verdict]
        table.add_row(*row, *([r.stragglers] if with_stragglers else []))
    console = Console(stderr=True, width=160)
    console.print(table)
    first = next((r for r in launcher.results if r.root_cause), None)
    if first is not None and first.root_cause is not None:
        rc = first.root_cause
        console.print(f"root cause: cycle {first.cycle}, rank {rc.rank}, {rc.kind}: {rc.detail}",
                      markup=False, highlight=False)
