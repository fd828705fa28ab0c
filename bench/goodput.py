"""Goodput under faults: trainguard (in-process restart + asynchronous checkpoints) vs the baseline
users have today (``torchrun --max-restarts`` + synchronous ``torch.save``), in one invocation.

    python bench/goodput.py [--duration 180] [--ranks 4] [--fault-every 30] [--seed 0]

The same DDP job (gloo, a step of ``--step-ms`` ms, a checkpoint every ``--checkpoint-every``
steps) trains for ``--duration`` seconds under each mode, with a fault every ``--fault-every``
seconds drawn from a seeded mix: an exception, a SIGKILL, a hang in a C call, a hang holding the
GIL, and a full disk for one save (a private tmpfs filled for ``--disk-full-s`` s; needs root,
otherwise that kind is left out and ``disk_full_tmpfs`` is false). Definitions of goodput, lost
time and recovery: ``trainguard._demo._goodput`` (``trainguard demo --duration`` runs the same
trainguard mode and prints the same goodput figure).

Ends with a table and one JSON line: ``goodput``, ``baseline_goodput``,
``lost_s_per_fault_median``, ``baseline_lost_s_per_fault_median``, ``faults_injected``,
``faults_recovered`` and the run's parameters. Exit status: 0 when both modes ran (targets are
reported, not enforced), 1 when a mode's processes failed or timed out, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_procs import become_subreaper, exit_on_signals, kill_descendants

from trainguard._demo._goodput import KINDS, GoodputConfig, result_json, run_modes


def _parse(argv: list[str] | None) -> tuple[GoodputConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=180.0,
                   help="seconds of training per mode (default 180)")
    p.add_argument("--ranks", type=int, default=4, help="active ranks (default 4)")
    p.add_argument("--reserve", type=int, default=None,
                   help="trainguard's spare ranks (default: one per rank-removing fault)")
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault mix and ranks")
    p.add_argument("--step-ms", type=float, default=50.0, help="step time, ms (default 50)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps (default 20)")
    p.add_argument("--soft-timeout", type=float, default=GoodputConfig.soft_timeout_s,
                   help="trainguard hang timeout, s (default 1.5: 30 steps of 50 ms)")
    p.add_argument("--hard-timeout", type=float, default=GoodputConfig.hard_timeout_s,
                   help="trainguard kill timeout, s (default 3)")
    p.add_argument("--pg-timeout", type=float, default=30.0,
                   help="baseline process-group timeout, s: what ends a hang there (default 30)")
    p.add_argument("--disk-full-s", type=float, default=3.0, help="seconds the disk stays full")
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds in the mix")
    p.add_argument("--skip-baseline", action="store_true", help="run trainguard only")
    p.add_argument("--work-dir", default=None, help="keep event logs here (default: a temp dir)")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        p.error(f"--kinds: unknown {bad}; choose from {', '.join(KINDS)}")
    if args.duration < 20 or args.ranks < 2 or args.fault_every <= 5:
        p.error("need --duration >= 20, --ranks >= 2 and --fault-every > 5")
    if args.soft_timeout >= args.hard_timeout:
        p.error("--soft-timeout must be below --hard-timeout")
    cfg = GoodputConfig(
        duration_s=args.duration, ranks=args.ranks, reserve=args.reserve,
        fault_every_s=args.fault_every, seed=args.seed, step_ms=args.step_ms,
        checkpoint_every=args.checkpoint_every, soft_timeout_s=args.soft_timeout,
        hard_timeout_s=args.hard_timeout, pg_timeout_s=args.pg_timeout,
        disk_full_s=args.disk_full_s, kinds=kinds,
    )
    return cfg, args


def print_table(ours: dict[str, Any], base: dict[str, Any] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="goodput under faults (seconds lost per fault)")
    for name in ("fault", "trainguard", "baseline (torchrun + torch.save)"):
        table.add_column(name, justify="left" if name == "fault" else "right")

    def cell(row: dict[str, Any] | None) -> str:
        if row is None:
            return "-"
        if not row["fired"]:
            return "not fired"
        return f"{row['lost_s']:.2f}" if row["recovered"] else "NOT RECOVERED"

    for i, row in enumerate(ours["faults"]):
        other = base["faults"][i] if base else None
        table.add_row(f"{row['kind']} at {row['t']:.0f} s, rank {row['rank']}", cell(row),
                      cell(other))
    for name, key, fmt in (("goodput", "goodput", "{:.3f}"), ("kept steps", "kept_steps", "{}"),
                           ("median step (ms)", "median_step_ms", "{:.1f}"),
                           ("window (s)", "window_s", "{:.1f}"), ("commits", "commits", "{}")):
        table.add_row(name, fmt.format(ours[key]), fmt.format(base[key]) if base else "-",
                      style="bold")
    Console(width=120).print(table)


def main(argv: list[str] | None = None) -> int:
    cfg, args = _parse(argv)
    become_subreaper()
    work = args.work_dir or tempfile.mkdtemp(prefix="tg-goodput-")
    os.makedirs(work, exist_ok=True)
    modes = ("ours",) if args.skip_baseline else ("ours", "baseline")
    try:
        with exit_on_signals():
            plan, runs, tmpfs, reserve = run_modes(cfg, work, modes)
    finally:
        kill_descendants()
    faults = ", ".join(f"{f['kind']}@{f['t']:.0f}s/rank{f['rank']}" for f in plan)
    print(f"plan: {faults}" + ("" if tmpfs else " (no tmpfs: disk_full left out)"))
    for run in runs.values():
        if not run.ok:
            print(f"{run.mode}: processes failed: exit codes {run.exit_codes}; logs in {work}")
    print_table(runs["ours"].figures, runs["baseline"].figures if "baseline" in runs else None)
    result = result_json(cfg, plan, runs, tmpfs, reserve)
    if args.work_dir is None and result["ok"]:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
