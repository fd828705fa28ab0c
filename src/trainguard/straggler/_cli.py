"""``trainguard straggler report RUN_DIR``: the windows as a table and a per-rank heat map.

Reads ``RUN_DIR/straggler.jsonl`` (written by ``Actions(run_dir=...)``), prints a rich table of
windows and of ranks, and saves ``straggler_heatmap.png`` (ranks x windows, colour = work ratio to
the median rank). Bad input: one line on stderr saying what to fix, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]

_EXIT_BAD_INPUT = 2
_PROG = "trainguard straggler report"  # prefix of every bad-input line, like other sub-commands


def register(subparsers: Any) -> list[str]:
    """Add ``straggler`` (with sub-command ``report``) to the ``trainguard`` command line."""
    p = subparsers.add_parser("straggler", help="straggler detection tools")
    sub = p.add_subparsers(dest="straggler_command", metavar="SUBCOMMAND")
    r = sub.add_parser("report", help="render RUN_DIR/straggler.jsonl as a table and heat map")
    r.add_argument("run_dir", metavar="RUN_DIR", help="directory given as Actions(run_dir=...)")
    r.add_argument("--png", help="heat-map path (default RUN_DIR/straggler_heatmap.png)")
    r.add_argument("--no-png", action="store_true", help="print the tables only")
    r.add_argument("--last", type=int, default=30,
                   help="windows shown in the table (default %(default)s; the PNG has all)")
    r.set_defaults(func=_report)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return ["straggler"]


def load_windows(run_dir: Path) -> list[dict[str, Any]]:
    """The window records of ``run_dir/straggler.jsonl``, oldest first.

    Raises:
        ValueError: ``run_dir`` or the file is missing, the file is empty or has a line that is
            not JSON (the message says which, and how to fix it).
    """
    path = run_dir / "straggler.jsonl"
    if not path.is_file():
        missing = run_dir if not run_dir.is_dir() else path
        raise ValueError(f"no such file or directory: {missing} (pass the run_dir given to "
                         "Actions(run_dir=...) in Detector.initialize)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg}); was the file "
                             "truncated or written by something else?") from None
    if not rows:
        raise ValueError(f"{path} is empty: no window was scored yet (run longer than "
                         "warm-up + window_steps steps)")
    return rows


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _tables(rows: list[dict[str, Any]], last: int) -> list[Any]:
    from rich.table import Table

    win = Table(title="straggler windows")
    for col in ("window", "step ms", "stragglers (rank kind ratio cost)", "missing", "warnings"):
        win.add_column(col)
    for row in rows[-last:]:
        strag = ", ".join(f"{s['rank']} {s['kind']} {_fmt(s['ratio'])}x "
                          f"{_fmt(s['est_loss_pct'], '.1f')}%" for s in row.get("stragglers", []))
        win.add_row(str(row["window"]) + (" (warm-up)" if row.get("warmup") else ""),
                    _fmt(row.get("step_ms_median")), strag or "-",
                    ",".join(map(str, row.get("missing_ranks", []))) or "-",
                    str(len(row.get("warnings", []))))
    ranks = Table(title="ranks")
    for col in ("rank", "node", "median ratio", "windows flagged", "kinds", "max cost %"):
        ranks.add_column(col)
    for rank, info in sorted(_per_rank(rows).items()):
        ranks.add_row(str(rank), info["node"], _fmt(_med(info["ratios"])),
                      str(info["flagged"]), ",".join(sorted(info["kinds"])) or "-",
                      _fmt(info["max_loss"], ".1f"))
    return [win, ranks]


def _med(values: list[float]) -> float:
    vals = sorted(v for v in values if v is not None)
    return vals[len(vals) // 2] if vals else float("nan")


def _per_rank(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for row in rows:
        for r, v in row.get("per_rank", {}).items():
            info = out.setdefault(int(r), {"node": row.get("rank_to_node", {}).get(r, "?"),
                                           "ratios": [], "flagged": 0, "kinds": set(),
                                           "max_loss": 0.0})
            info["ratios"].append(v.get("ratio"))
        for s in row.get("stragglers", []):
            info = out.setdefault(int(s["rank"]), {"node": s["node"], "ratios": [], "flagged": 0,
                                                   "kinds": set(), "max_loss": 0.0})
            info["flagged"] += 1
            info["kinds"].add(s["kind"])
            info["max_loss"] = max(info["max_loss"], s.get("est_loss_pct") or 0.0)
    return out


def save_heatmap(rows: list[dict[str, Any]], path: Path) -> None:
    """Write a ranks x windows heat map of the work ratio (1.0 = median rank) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({int(r) for row in rows for r in row.get("per_rank", {})})
    grid = [[float("nan")] * len(rows) for _ in ranks]
    index = {r: i for i, r in enumerate(ranks)}
    for j, row in enumerate(rows):
        for r, v in row.get("per_rank", {}).items():
            ratio = v.get("ratio")
            grid[index[int(r)]][j] = float("nan") if ratio is None else ratio
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(rows) + 2), max(2.5, 0.35 * len(ranks))))
    try:
        im = ax.imshow(grid, aspect="auto", cmap="RdYlGn_r", vmin=0.8, vmax=1.6,
                       interpolation="nearest",
                       extent=(rows[0]["window"] - 0.5, rows[-1]["window"] + 0.5,
                               len(ranks) - 0.5, -0.5))
        ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
        ax.set_xlabel("window")
        ax.set_ylabel("rank")
        ax.set_title("work time / median rank")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.last < 1:
        print(f"{_PROG}: error: --last must be >= 1 (got {args.last})", file=sys.stderr)
        return _EXIT_BAD_INPUT
    try:
        rows = load_windows(run_dir)
    except ValueError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _EXIT_BAD_INPUT
    from rich.console import Console

    console = Console()
    for table in _tables(rows, args.last):
        console.print(table)
    if not args.no_png:
        png = Path(args.png) if args.png else run_dir / "straggler_heatmap.png"
        try:
            save_heatmap(rows, png)
        except ModuleNotFoundError:
            print(f"{_PROG}: error: the heat map needs matplotlib: pip install "
                  "'trainguard[demo]' (or pass --no-png)", file=sys.stderr)
            return _EXIT_BAD_INPUT
        console.print(f"heat map: {png}")
    return 0
