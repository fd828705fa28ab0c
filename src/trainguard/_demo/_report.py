"""Turn the ranks' event logs into the demo's summary (``summary.json``) and its rich table.

Definitions (all times are wall-clock seconds from the event logs):

* A fault's restart is the restart *into* iteration ``i + 1`` where ``i`` is the iteration the
  fault fired in; the ranks' restart records for it are merged (earliest detection, latest
  re-entry).
* ``detection_s``: injection -> the first rank's wrapper noticed the fault.
* ``restart_s``: the wrapper's own figure, ``RestartRecord.restart_s`` (the fault as the wrapper
  dated it -> the rank re-entered the training function; the number it logs as ``restart=``),
  the largest over the ranks: the restart is over when the last surviving rank is back.
* ``recovery_s``: injection -> the first training step completed after the restart (includes
  process-group set-up and the checkpoint reload).
* ``steps_lost``: steps completed in the faulty iteration past the checkpoint the restart
  resumed from (the newest one committed on every rank by then; saves are asynchronous).
* ``recovered``: the restart happened and training made progress after it.
* ``goodput``: useful step time (each step counted once, in the iteration that kept it) divided
  by the demo's whole wall time (the rank processes' start-up and imports included);
  ``train_goodput`` divides by the span from the first step's start to the last step's end
  instead. ``rank_processes``: how many rank processes wrote events (active plus reserve).
* ``checkpoint``: the asynchronous checkpoints: saves staged (all ranks) and commits, the
  median/max milliseconds a save blocked the training loop, the committer thread's finalize
  and the save -> durable times, and the synchronous save of the same state timed once in the
  same run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from trainguard._demo._schedule import FaultSpec

__all__ = ["ACCURACY_TARGET", "build_summary", "checkpoint_summary", "render_table"]

ACCURACY_TARGET = 0.95


def _of(events: dict[int, list[dict]], ev: str) -> list[dict]:
    return sorted(
        (e for evs in events.values() for e in evs if e.get("ev") == ev), key=lambda e: e["t"]
    )


def restart_groups(events: dict[int, list[dict]]) -> dict[int, dict]:
    """Merge the ranks' ``restart`` events into one entry per restart, keyed by the iteration it
    restarted into (``into_iteration``)."""
    by_target: dict[int, list[dict]] = defaultdict(list)
    for record in _of(events, "restart"):
        if record.get("into_iteration") is not None:
            by_target[int(record["into_iteration"])].append(record)
    groups = {}
    for target, records in sorted(by_target.items()):
        detected = [r for r in records if r.get("detection_time") is not None]
        first = min(detected, key=lambda r: r["detection_time"]) if detected else records[0]
        reentries = [r["reentry_time"] for r in records if r.get("reentry_time") is not None]
        restarts = [_record_restart_s(r) for r in records]
        groups[target] = {
            "into_iteration": target,
            "cause": first.get("cause"),
            "fault_ranks": first.get("fault_ranks"),
            "detection_time": first.get("detection_time"),
            "reentry_time": max(reentries) if reentries else None,
            "restart_s": max((x for x in restarts if x is not None), default=None),
            "reported_by": sorted({r["rank"] for r in records}),
        }
    return groups


def _record_restart_s(record: dict) -> float | None:
    """One rank's restart duration as its restart record defines it (``RestartRecord.restart_s``,
    the figure the wrapper logs); from the record's times for records written without it."""
    if record.get("restart_s") is not None:
        return float(record["restart_s"])
    if record.get("reentry_time") is None or record.get("fault_time") is None:
        return None
    return float(record["reentry_time"]) - float(record["fault_time"])


# the wrapper's interruption causes, as the table shows them
_CAUSES = {
    "exception": "exception raised",
    "soft_timeout": "monitor: soft timeout",
    "hard_timeout": "monitor: hard timeout, killed",
    "terminated": "monitor: process died",
    "unresponsive": "sibling heartbeat stale",
    "exit": "rank left (BaseException)",
    "health_check": "health check failed",
}


def _detected_by(group: dict) -> str:
    raw = str(group.get("cause") or "unknown")
    cause = _CAUSES.get(raw, raw.replace("_", " "))
    ranks = group.get("fault_ranks")
    if ranks:
        ranks = ranks if isinstance(ranks, (list, tuple, set)) else [ranks]
        return f"{cause} (rank {', '.join(map(str, sorted(ranks)))})"
    return cause


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _fault_row(spec: FaultSpec, fired: dict | None, events: dict, groups: dict) -> dict:
    row: dict[str, Any] = {
        "kind": spec.kind,
        "rank": spec.rank,
        "step": spec.step,
        "fired": fired is not None,
        "detected_by": None,
        "detection_s": None,
        "restart_s": None,
        "recovery_s": None,
        "steps_lost": None,
        "world_size_after": None,
        "recovered": False,
    }
    if fired is None:
        row["detected_by"] = "not fired"
        return row
    row["fault_time"] = fired["t"]
    it = int(fired["iteration"])
    group = groups.get(it + 1)
    if group is None:
        row["detected_by"] = "no restart seen"
        return row
    t_fault, t_detect = fired["t"], group["detection_time"]
    row["detected_by"] = _detected_by(group)
    row["detection_s"] = _round(t_detect - t_fault if t_detect is not None else None)
    row["restart_s"] = _round(group["restart_s"])
    enters = [e for e in _of(events, "enter") if e["iteration"] == it + 1]
    later_steps = [e for e in _of(events, "step") if e["iteration"] > it]
    later_done = [e for e in _of(events, "done") if e["iteration"] > it]
    if enters:
        row["world_size_after"] = enters[0]["active_world_size"]
        before = [e["step"] for e in _of(events, "step") if e["iteration"] == it]
        resumed_from = [e["resume_step"] for e in _of(events, "enter") if e["iteration"] == it]
        done_before = max(before, default=min(resumed_from, default=0))
        row["steps_lost"] = max(0, done_before - enters[0]["resume_step"])
    if later_steps:
        row["recovery_s"] = _round(later_steps[0]["t"] - t_fault)
    row["recovered"] = bool(enters) and bool(later_steps or later_done)
    return row


def _goodput(events: dict[int, list[dict]], wall_s: float) -> dict:
    kept: dict[int, tuple[int, list[float]]] = {}
    for e in _of(events, "step"):
        it, durations = kept.get(e["step"], (-1, []))
        if e["iteration"] > it:
            kept[e["step"]] = (e["iteration"], [e["t"] - e["t0"]])
        elif e["iteration"] == it:
            durations.append(e["t"] - e["t0"])
    useful = sum(statistics.median(d) for _, d in kept.values())
    steps = _of(events, "step")
    window = (steps[-1]["t"] - min(e["t0"] for e in steps)) if steps else 0.0
    return {
        "useful_step_s": round(useful, 3),
        "goodput": round(useful / wall_s, 4) if wall_s > 0 else 0.0,
        "train_window_s": round(window, 3),
        "train_goodput": round(useful / window, 4) if window > 0 else 0.0,
        "steps_completed": max(kept, default=0),
    }


def build_summary(
    events: dict[int, list[dict]],
    faults: list[FaultSpec],
    *,
    steps: int,
    wall_s: float,
    exits: dict[int, str] | None = None,
    timed_out: bool = False,
    accuracy_target: float = ACCURACY_TARGET,
    checkpoint_every: int | None = None,
) -> dict:
    """The ``summary.json`` object for one run (see the module docstring for the definitions).

    Args:
        events: event logs keyed by initial rank (:func:`read_events`).
        faults: the schedule that was injected.
        steps: steps the run was asked for.
        wall_s: the demo's wall time, seconds.
        exits: per initial rank, how its process ended (text).
        timed_out: the parent's global timeout expired.
        checkpoint_every: steps between checkpoints; when given, the last checkpoint due
            (step ``steps // checkpoint_every * checkpoint_every``) must be committed.

    ``ok`` (PASS) means: every planned fault recovered, no unplanned restart, no failed
    checkpoint save or commit, the checkpoints due committed, training finished every step at
    the target accuracy, and the global timeout did not expire. Otherwise ``problems`` lists
    each reason in a sentence.
    """
    fired = {e["index"]: e for e in _of(events, "fault")}
    groups = restart_groups(events)
    rows = [_fault_row(spec, fired.get(i), events, groups) for i, spec in enumerate(faults)]
    matched = {int(fired[i]["iteration"]) + 1 for i in range(len(faults)) if i in fired}
    done = _of(events, "done")
    accuracy = done[-1]["accuracy"] if done else None
    good = _goodput(events, wall_s)
    unplanned = [g for t, g in groups.items() if t not in matched]
    ck = checkpoint_summary(events)
    problems = [
        f"{spec.label} not recovered ({row['detected_by']})"
        for spec, row in zip(faults, rows)
        if not row["recovered"]
    ]
    problems += [
        f"unplanned restart into iteration {g['into_iteration']}: {_detected_by(g)}"
        for g in unplanned
    ]
    planned_its = {int(fired[i]["iteration"]) for i in range(len(faults)) if i in fired}
    problems += _checkpoint_problems(events, ck, steps, checkpoint_every, planned_its)
    if accuracy is None:
        problems.append("training did not finish (no accuracy)")
    elif accuracy < accuracy_target:
        problems.append(f"accuracy {accuracy:.4f} < {accuracy_target}")
    if accuracy is not None and good["steps_completed"] < steps:
        problems.append(f"only {good['steps_completed']}/{steps} steps completed")
    if timed_out:
        problems.append("the global timeout expired")
    return {
        "faults": rows,
        "accuracy": accuracy,
        "accuracy_target": accuracy_target,
        "goodput": good["goodput"],
        "wall_s": round(wall_s, 3),
        "rank_processes": len(events),
        **{k: v for k, v in good.items() if k != "goodput"},
        "steps": steps,
        "restarts": len(groups),
        "unplanned_restarts": unplanned,
        "exits": {str(k): v for k, v in sorted((exits or {}).items())},
        "timed_out": timed_out,
        "problems": problems,
        "ok": not problems,
        "checkpoint": ck,
    }


def _checkpoint_problems(
    events: dict[int, list[dict]],
    ck: dict,
    steps: int,
    every: int | None,
    planned_iterations: set[int],
) -> list[str]:
    """Why the run's checkpoints do not count as working (empty when they do).

    A failed write or commit is a problem; so is an error of the committer that is not the
    abort of a planned fault's iteration, no commit at all although saves were made, and (when
    ``every`` is given) a newest commit older than the last two checkpoints due (one may be
    skipped while its predecessor is still in flight).
    """
    out = []
    failed = _of(events, "checkpoint_failed")
    if failed:
        out.append(
            f"{len(failed)} checkpoint save(s) failed (first: step {failed[0].get('step')}: "
            f"{failed[0].get('error', 'see the rank logs')})"
        )
    errors = [
        e for e in _of(events, "checkpoint_error") if e.get("iteration") not in planned_iterations
    ]
    if errors:
        out.append(
            f"{len(errors)} checkpoint commit error(s) outside a planned fault (first: "
            f"{errors[0].get('error')})"
        )
    sync_failed = _of(events, "checkpoint_sync_failed")
    if sync_failed:
        out.append(f"the synchronous baseline save failed: {sync_failed[0].get('error')}")
    last_due = (steps // every) * every if every else 0
    newest = max(ck["committed_steps"], default=0)
    if ck["saves"] and not ck["committed"]:
        out.append(f"no checkpoint committed ({ck['saves']} saves)")
    elif last_due and newest < last_due - every:  # type: ignore[operator]
        # one skip is allowed: a save is skipped while the previous one is still in flight
        out.append(
            f"checkpoints stopped committing: the newest is step {newest or 'none'}, "
            f"the last due was step {last_due}"
        )
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def checkpoint_summary(events: dict[int, list[dict]]) -> dict:
    """The ``checkpoint`` entry of the summary, from ``checkpoint_save``/``checkpoint``/
    ``checkpoint_sync`` events (milliseconds; None where nothing was measured)."""
    saves, commits = _of(events, "checkpoint_save"), _of(events, "checkpoint")
    block = [float(e["block_ms"]) for e in saves if "block_ms" in e]
    sync = _of(events, "checkpoint_sync")
    sync_ms = float(sync[0]["ms"]) if sync else None
    median_block = _median(block)
    lags = [int(e["committed_at"]) - int(e["step"]) for e in commits if "committed_at" in e]
    return {
        "format": next((e["format"] for e in saves if "format" in e), None),
        "saves": len(saves),
        "skipped": len({(e.get("iteration"), e["step"]) for e in _of(events, "checkpoint_skip")}),
        "committed": len(commits),
        "committed_steps": sorted({int(e["step"]) for e in commits}),
        "median_block_ms": median_block,
        "min_block_ms": round(min(block), 3) if block else None,
        "max_block_ms": round(max(block), 3) if block else None,
        "median_stage_ms": _median([float(e["stage_ms"]) for e in saves if "stage_ms" in e]),
        "median_commit_ms": _median([float(e["commit_ms"]) for e in commits if "commit_ms" in e]),
        "median_durable_ms": _median(
            [float(e["durable_ms"]) for e in commits if "durable_ms" in e]
        ),
        "max_commit_lag_steps": max(lags) if lags else None,
        "sync_save_ms": sync_ms,
        "sync_save_min_ms": float(sync[0]["min_ms"]) if sync and "min_ms" in sync[0] else None,
        "sync_vs_async_block": round(sync_ms / median_block, 1)
        if sync_ms and median_block
        else None,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_COLUMNS = (  # (header, summary key or callable)
    ("fault", lambda r: f"{r['kind']} rank {r['rank']} step {r['step']}"),
    ("detected by", lambda r: str(r["detected_by"])),
    ("detection\n(s)", lambda r: _fmt(r["detection_s"])),
    ("restart\n(s)", lambda r: _fmt(r["restart_s"])),
    ("training\nagain (s)", lambda r: _fmt(r["recovery_s"])),
    ("steps\nlost", lambda r: "-" if r["steps_lost"] is None else str(r["steps_lost"])),
    (
        "world size\nafter",
        lambda r: "-" if r["world_size_after"] is None else str(r["world_size_after"]),
    ),
    ("recovered", lambda r: "yes" if r["recovered"] else "NO"),
)


def _fault_table(faults: list[dict], narrow: bool) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(
        title="trainguard demo: faults and recovery", title_style="bold", box=box.SIMPLE_HEAD
    )
    if narrow:  # one column per fault, one row per measure
        table.show_header = False
        table.add_column("")
        for _ in faults:
            table.add_column("", overflow="fold")
        for header, get in _COLUMNS:
            table.add_row(header.replace("\n", " "), *(get(r) for r in faults))
        return table
    for header, _ in _COLUMNS:
        text = header in ("fault", "detected by")
        table.add_column(
            header,
            justify="left" if text else "right",
            no_wrap=not text,
            min_width=14 if text else None,
        )
    for r in faults:
        table.add_row(*(get(r) for _, get in _COLUMNS), style=None if r["recovered"] else "red")
    return table


def _goodput_line(summary: dict) -> str:
    """Goodput over the whole wall time, saying that it includes start-up, then over training."""
    n = summary.get("rank_processes")
    procs = f"{n} rank processes" if n else "the rank processes"
    return (
        f"goodput {summary['goodput']:.1%} of {summary['wall_s']:.1f} s wall (start-up and imports "
        f"of {procs} included; training-window goodput {summary['train_goodput']:.1%} of "
        f"{summary['train_window_s']:.1f} s, useful step time {summary['useful_step_s']:.2f} s)"
    )


def render_table(summary: dict, width: int | None = None) -> Any:
    """A rich renderable: the fault table and the run's totals; ``width`` (columns) below 110
    turns the table so it fits a narrow terminal."""
    from rich.console import Group
    from rich.text import Text

    faults = summary["faults"]
    narrow = width is not None and width < 110
    table = _fault_table(faults, narrow) if faults else Text("no faults injected")
    acc = summary["accuracy"]
    lines = [
        f"accuracy {acc:.4f} (target {summary['accuracy_target']:.2f})"
        if acc is not None
        else "accuracy: training did not finish",
        _goodput_line(summary),
        f"steps {summary['steps_completed']}/{summary['steps']}, restarts {summary['restarts']}"
        + (
            f" ({len(summary['unplanned_restarts'])} unplanned)"
            if summary["unplanned_restarts"]
            else ""
        ),
    ]
    ck = summary.get("checkpoint") or {}
    if ck.get("saves"):
        sync = (
            "not measured"
            if ck.get("sync_save_ms") is None
            else (f"{ck['sync_save_ms']:.2f} ms (min {_fmt(ck.get('sync_save_min_ms'))})")
        )
        lines.append(
            f"checkpoints ({ck['format']}, async): {ck['committed']} committed, "
            f"{ck['saves']} saves; "
            f"training blocked {_fmt(ck['median_block_ms'])} ms median (min "
            f"{_fmt(ck['min_block_ms'])}, max {_fmt(ck['max_block_ms'])}) per save vs {sync} for "
            f"a synchronous torch.save + fsync; committed off the loop in "
            f"{_fmt(ck['median_commit_ms'])} ms, durable {_fmt(ck['median_durable_ms'])} ms after "
            "the save (medians)"
        )
    verdict = "PASS" if summary["ok"] else "FAIL: " + "; ".join(summary["problems"])
    status = Text(verdict, style="bold green" if summary["ok"] else "bold red")
    return Group(table, *(Text(line) for line in lines), status)
