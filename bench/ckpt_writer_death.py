"""Benchmark: an idle checkpoint writer SIGKILLed from outside (``kill -9``, the OOM killer), with
the process-wide writer pool (the dead writer is replaced there at once) vs without it (the next
save starts a cold writer), in one invocation.

    python bench/ckpt_writer_death.py [--kills 3] [--gap-s 3] [--numel 262144]

Each mode runs in its own fresh process (``TRAINGUARD_CKPT_WRITER_POOL=0`` for the baseline): one
``AsyncCheckpointer`` saves and commits, then ``--kills`` times: SIGKILL its idle writer, time
until the trainer logs the death (``detect_s``), go on "training" for ``--gap-s`` seconds (a save
every N steps), then time ``save()`` + ``wait()`` until the next save committed
(``save_after_kill_s``), and once more with the healthy writer (``save_s``, the baseline in the
same run). Prints a table (min / median / max per mode), then one JSON line. Exit status 0, 1 if
a mode failed (a save not committed, no warning), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

FIGURES = ("detect_s", "save_after_kill_s", "save_s")


def _child(args: argparse.Namespace) -> None:
    import logging

    import torch

    from trainguard.checkpointing import AsyncCheckpointer

    seen: list[float] = []

    class _Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "died" in record.getMessage():
                seen.append(time.monotonic())

    log = logging.getLogger("trainguard.checkpointing")
    log.addHandler(_Seen(logging.WARNING))
    out: dict[str, list[float]] = {k: [] for k in FIGURES}
    state = {"w": torch.randn(args.numel)}
    ck = AsyncCheckpointer(args.dir, keep_last=2, write_timeout=120.0)
    step = 0

    def save() -> float:
        nonlocal step
        step += 1
        t0 = time.monotonic()
        ck.save(state, step)
        if ck.wait() != [step]:
            raise RuntimeError(f"step {step} did not commit")
        return time.monotonic() - t0

    try:
        save()
        for _ in range(args.kills):
            pid = ck.writer.pid
            n = len(seen)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while len(seen) == n and time.monotonic() - t0 < 10.0:
                time.sleep(0.001)
            if len(seen) == n:
                raise RuntimeError(f"no warning within 10 s of killing writer pid {pid}")
            out["detect_s"].append(seen[-1] - t0)
            time.sleep(args.gap_s)
            out["save_after_kill_s"].append(save())
            out["save_s"].append(save())
    finally:
        ck.close()
    print(json.dumps(out), flush=True)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4),
            "max": round(max(xs), 4)}


def _run_mode(args: argparse.Namespace, pool: bool) -> dict[str, Any] | None:
    env = dict(os.environ, TRAINGUARD_CKPT_WRITER_POOL="1" if pool else "0")
    with tempfile.TemporaryDirectory(prefix="tg_bench_wdeath_") as d:
        cmd = [sys.executable, __file__, "--child", "--dir", d, "--kills", str(args.kills),
               "--gap-s", str(args.gap_s), "--numel", str(args.numel)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                           timeout=120 + args.kills * (args.gap_s + 60))
    if r.returncode != 0:
        print(f"mode {'pool' if pool else 'no pool'} failed (exit {r.returncode}):\n"
              f"{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3, help="writer kills per mode (default 3)")
    p.add_argument("--gap-s", type=float, default=3.0,
                   help="seconds of training between a kill and the next save (default 3)")
    p.add_argument("--numel", type=int, default=262144, help="float32 elements saved (262144)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.kills < 1 or args.gap_s < 0 or args.numel < 1:
        print("ckpt_writer_death: error: --kills and --numel must be >= 1 and --gap-s >= 0",
              file=sys.stderr)
        return 2
    if args.child:
        _child(args)
        return 0
    runs = {"pool": _run_mode(args, True), "no_pool": _run_mode(args, False)}
    ok = all(runs.values())
    result: dict[str, Any] = {"ok": ok}
    print(f"{'figure (s), min / median / max':34} {'pool':>26} {'no pool':>26}")
    for fig in FIGURES:
        cells = []
        for mode, run in runs.items():
            if run:
                s = _stats(run[fig])
                result[f"{mode}_{fig}"] = s
                cells.append(f"{s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f}")
            else:
                cells.append("failed")
        print(f"{fig:34} {cells[0]:>26} {cells[1]:>26}")
    result.update(kills=args.kills, gap_s=args.gap_s, numel=args.numel,
                  load_avg_1min=round(os.getloadavg()[0], 2))
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
