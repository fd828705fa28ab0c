"""Tables and targets of ``bench/inprocess_restart.py`` (rich output)."""

from __future__ import annotations

from typing import Any

from _inprocess_metrics import FaultFigures
from rich.console import Console
from rich.table import Table

__all__ = ["console", "print_faults", "print_summary", "targets"]

console = Console(width=130)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_faults(name: str, figs: list[FaultFigures]) -> None:
    table = Table(title=f"{name}: per fault (seconds from the fault)")
    for col in (
        "#",
        "kind",
        "rank",
        "world",
        "hang interrupted",
        "all re-entered",
        "first step",
        "wrapper: detected",
        "wrapper: all interrupted",
        "wrapper: all re-entered",
    ):
        table.add_column(col, justify="right")
    for i, f in enumerate(figs):
        table.add_row(
            str(i + 1),
            f.kind,
            str(f.rank),
            str(f.world),
            _fmt(f.detect_s),
            _fmt(f.reentered_s),
            _fmt(f.first_step_s),
            _fmt(f.wrapper_detect_s),
            _fmt(f.wrapper_interrupt_s),
            _fmt(f.wrapper_restart_s),
        )
    console.print(table)


def targets(result: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    restart_limit = 0.5 if result["ranks"] <= 2 else 1.0
    checks = [
        ("restart_s_median", f"<= {restart_limit}", lambda v: v <= restart_limit),
        ("ratio_vs_torchrun", ">= 10 (first-step basis)", lambda v: v >= 10),
        ("ratio_vs_nvrx", ">= 10 (all re-entered basis)", lambda v: v >= 10),
        ("hang_detect_over_soft_s_median", "<= 0.5", lambda v: v <= 0.5),
        ("hang_all_back_over_soft_s_median", "<= 1.5", lambda v: v <= 1.5),
        ("kill_reenter_s_median", "<= 1.0", lambda v: v <= 1.0),
    ]
    return [(k, t, None if result[k] is None else bool(ok(result[k]))) for k, t, ok in checks]


def print_summary(result: dict[str, Any]) -> None:
    table = Table(title=f"in-process restart, {result['ranks']} ranks: medians (seconds)")
    for col in ("figure", "value", "target", "met"):
        table.add_column(col)
    keys = [
        "restart_s_median",
        "first_step_s_median",
        "torchrun_restart_s_median",
        "ratio_vs_torchrun",
        "nvrx_restart_s_median",
        "ratio_vs_nvrx",
        "hang_detect_over_soft_s_median",
        "hang_all_back_over_soft_s_median",
        "kill_reenter_s_median",
    ]
    goals = {k: (t, ok) for k, t, ok in targets(result)}
    for k in keys:
        target, ok = goals.get(k, ("", None))
        met = "" if k not in goals else {True: "yes", False: "NO", None: "not run"}[ok]
        table.add_row(k, _fmt(result[k]), target, met)
    console.print(table)
