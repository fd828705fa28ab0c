"""Per-collective lateness from the flight recorder: accuracy against an injected delay, cost.

One run, 3 gloo ranks, ``--collectives`` all-reduces each preceded by ``--compute-ms`` of sleep,
with ``TORCH_FR_BUFFER_SIZE=2000``; rank 1 sleeps ``extra`` ms longer for each value of
``--extra-ms`` (0 is the baseline: nobody is late). Each rank returns its flight-recorder entries
(``trainguard._core.flight_recorder.own_dump``); ``trainguard.straggler.flight`` matches them.

Keys per configuration: ``late_median_ms`` / ``late_last_pct`` (rank 1: median lateness, share of
collectives it arrived last at), ``others_median_ms`` (max over the other ranks' medians),
``error_ms`` (late_median_ms - extra), ``dump_ms`` (median over ranks of one in-memory dump),
``analyse_ms`` (matching and per-rank statistics for all ranks). The headline keys are those of
the largest ``--extra-ms``. CUDA-event collective timing is not measured here (no GPU).

Prints a table, then one JSON line. Run: ``.venv/bin/python bench/straggler_fr.py``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainguard.straggler.flight import collective_lateness, lateness_by_rank
from trainguard.testing import run_ranks


def measure(extra_ms: float, args: argparse.Namespace) -> dict[str, float]:
    cfg = {"collectives": args.collectives, "compute_ms": args.compute_ms,
           "late": {"rank": 1, "extra_ms": extra_ms}}
    env = {"TG_FR_CFG": json.dumps(cfg), "TORCH_FR_BUFFER_SIZE": "2000",
           "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])}
    results = run_ranks("_straggler_fr_workload:run", 3, timeout_s=300, env=env,
                        pythonpath=[str(REPO / "bench")])
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise SystemExit(f"rank {bad[0].rank} failed: {bad[0].stderr[-1500:]}")
    dumps = {r.rank: {"entries": r.result["entries"]} for r in results}
    t0 = time.perf_counter()
    stats = lateness_by_rank([c for c in collective_lateness(dumps) if "all_reduce" in c.op])
    analyse_ms = (time.perf_counter() - t0) * 1e3
    return {"extra_ms": extra_ms, "late_median_ms": stats[1]["median_ms"],
            "late_last_pct": stats[1]["last_pct"],
            "others_median_ms": max(stats[r]["median_ms"] for r in stats if r != 1),
            "error_ms": stats[1]["median_ms"] - extra_ms,
            "dump_ms": statistics.median(r.result["dump_ms"] for r in results),
            "analyse_ms": analyse_ms, "collectives": stats[1]["count"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--extra-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0])
    p.add_argument("--collectives", type=int, default=50)
    p.add_argument("--compute-ms", type=float, default=5.0)
    args = p.parse_args()
    rows = [measure(x, args) for x in args.extra_ms]
    from rich.console import Console
    from rich.table import Table

    table = Table(title="flight-recorder lateness of rank 1 (3 gloo ranks)")
    cols = ["extra_ms", "late_median_ms", "late_last_pct", "others_median_ms", "error_ms",
            "dump_ms", "analyse_ms"]
    for c in cols:
        table.add_column(c)
    for row in rows:
        table.add_row(*[f"{row[c]:.2f}" for c in cols])
    Console(stderr=True).print(table)
    head = rows[-1]
    print(json.dumps({"bench": "straggler_fr", **{k: round(v, 3) for k, v in head.items()},
                      "by_extra_ms": [{k: round(v, 3) for k, v in r.items()} for r in rows],
                      "load_avg_1m": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
