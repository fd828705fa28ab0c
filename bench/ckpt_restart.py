"""Benchmark: in-process restart -> first commit, with checkpointers made inside the wrapped
function, with the process-wide pool of warm writers and spare writers, with the pool only, and
without either (every writer cold), in one invocation.

    python bench/ckpt_restart.py [--restarts 4] [--step-ms 20] [--numel 262144] [--kinds 3]
                                 [--busy]

Each mode runs in its own fresh process (``spare``: ``TRAINGUARD_CKPT_SPARE_WRITER=1``, a spare
per checkpointer from the start; ``auto``: the defaults, spares from the first restart that killed
a busy writer on; ``pool``: ``TRAINGUARD_CKPT_SPARE_WRITER=0``; ``no_pool``:
``TRAINGUARD_CKPT_WRITER_POOL=0``): a
one-rank ``inprocess.Wrapper`` whose function makes ``--kinds`` ``AsyncCheckpointer``s (torch
format, DCP format, and a second torch one as ``LocalCheckpointManager`` holds), trains (a
matmul per step, ~``--step-ms`` ms), saves on each at its first step and calls the non-blocking
``maybe_finalize`` every step until every checkpointer has committed that save, then raises (the
writers are idle at the fault, as with a save every N steps). With ``--busy`` every checkpointer
first starts one more save whose write takes 60 s (slow storage, injected through the writer's
test seam) and the fault comes while those writes are in flight: an abort kills a busy writer,
so the next iteration's saves need another writer (a spare, or the replacement the abort starts).
Before each raise the run waits until the spares are ready (``spare`` mode) or ~2 s (other modes,
the same time at least), as in a job whose fault comes some seconds after its last restart (the
spares' one-time start-up, which competes with training for CPU, is left out of the figures).
``--restarts`` restarts in all. Figure per restart: seconds from the
raise to the step at which every checkpointer of the new iteration has committed
(``restart_to_commit_s``); also the part after re-entry (``entry_to_commit_s``) and the longest
step of the iteration (``max_step_s``: what a soft timeout would see). Prints a table (min /
median / max per mode), then one JSON line. Exit status 0, 1 if a mode failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _child(args: argparse.Namespace) -> None:
    import torch

    from trainguard.checkpointing import AsyncCheckpointer
    from trainguard.inprocess import CallWrapper, Wrapper

    out: list[dict[str, float]] = []
    fault_t: list[float] = []
    a = torch.randn(256, 256)

    @Wrapper(soft_timeout=30.0, hard_timeout=60.0, barrier_timeout=90.0,
             heartbeat_timeout=20.0, heartbeat_interval=0.5, completion_timeout=90.0)
    def train(cw: CallWrapper) -> None:
        entry = time.monotonic()
        fmts = ["torch", "dcp", "torch"][: args.kinds]
        cks = [AsyncCheckpointer(os.path.join(args.dir, f"it{cw.iteration}_{i}"), format=f,
                                 write_timeout=120.0) for i, f in enumerate(fmts)]
        done: set[int] = set()
        step, max_step = 0, 0.0
        while len(done) < len(cks):
            t0 = time.monotonic()
            step += 1
            end = t0 + args.step_ms / 1e3
            while time.monotonic() < end:
                torch.mm(a, a)
            state = {"w": torch.full((args.numel,), float(step))}
            for i, ck in enumerate(cks):
                if step == 1:
                    ck.save(state, step)
                if i not in done and ck.maybe_finalize():
                    done.add(i)
            max_step = max(max_step, time.monotonic() - t0)
        now = time.monotonic()
        if fault_t:
            out.append({"restart_to_commit_s": now - fault_t[-1],
                        "entry_to_commit_s": now - entry, "max_step_s": max_step})
        if cw.iteration < args.restarts:
            if args.busy:
                for ck in cks:  # this write takes 60 s: busy at the fault
                    ck.faults[step + 1] = {"phase": "recv", "action": "slow", "seconds": 60.0}
                    ck.save(state, step + 1)
            _wait_spares(len(cks))
            fault_t.append(time.monotonic())
            raise RuntimeError(f"bench fault {cw.iteration}")
        for ck in cks:
            ck.close()

    train()
    print(json.dumps(out))


def _wait_spares(n: int, timeout_s: float = 60.0) -> None:
    """Until ``n`` pooled writers have imported torch (spare mode), else ~2 s (the other modes:
    the same pause, so the pool-only replacement is not given less head start)."""
    from trainguard.checkpointing.async_ckpt import _pool

    t0 = time.monotonic()
    want = _pool.spare_enabled() and any(_pool._wanting)
    while time.monotonic() - t0 < timeout_s:
        if want and len(_pool.idle_pids(ready_only=True)) >= n and time.monotonic() - t0 > 2.0:
            return
        if not want and time.monotonic() - t0 > 2.0:
            return
        time.sleep(0.05)


MODES = {"spare": {"TRAINGUARD_CKPT_SPARE_WRITER": "1"}, "auto": {},
         "pool": {"TRAINGUARD_CKPT_SPARE_WRITER": "0"},
         "no_pool": {"TRAINGUARD_CKPT_WRITER_POOL": "0"}}


def _run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, float]] | None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRAINGUARD_CKPT_WRITER_POOL", "TRAINGUARD_CKPT_SPARE_WRITER")}
    env.update(TRAINGUARD_LOG_LEVEL="ERROR", **MODES[mode])
    pool = mode
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="tg-ckpt-restart-") as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", tmp,
               "--restarts", str(args.restarts), "--step-ms", str(args.step_ms),
               "--numel", str(args.numel), "--kinds", str(args.kinds)] + (
                   ["--busy"] if args.busy else [])
        try:
            proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{pool}: timed out after {args.timeout} s")
            return None
    if proc.returncode != 0:
        print(f"{pool}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _stats(rows: list[dict[str, float]], key: str) -> dict[str, float]:
    vals = [r[key] for r in rows]
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--restarts", type=int, default=4, help="restarts per mode (>= 3, default 4)")
    p.add_argument("--step-ms", type=float, default=20.0, help="compute per step, ms")
    p.add_argument("--numel", type=int, default=1 << 18, help="float32 elements saved")
    p.add_argument("--kinds", type=int, default=3, help="checkpointers per iteration (1-3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mode")
    p.add_argument("--busy", action="store_true",
                   help="fault while every writer is busy with a save (see the docstring)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restarts < 3 or not 1 <= args.kinds <= 3 or args.step_ms <= 0 or args.numel < 1:
        p.error("need --restarts >= 3, --kinds 1..3, --step-ms > 0 and --numel >= 1")
    if args.child:
        _child(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    results = {mode: _run_mode(mode, args) for mode in MODES}
    load = os.getloadavg()[0]
    table = Table(title=f"restart -> first commit, {args.kinds} checkpointers made inside the "
                        f"wrapped function, writers {'busy' if args.busy else 'idle'} at the "
                        f"fault (s, min / median / max over {args.restarts})")
    table.add_column("figure")
    for mode in results:
        table.add_column(mode.replace("_", " "), justify="right")
    summary: dict[str, Any] = {}
    for key in ("restart_to_commit_s", "entry_to_commit_s", "max_step_s"):
        cells = []
        for mode, rows in results.items():
            if not rows:
                cells.append("failed")
                continue
            s = _stats(rows, key)
            summary[f"{mode}_{key}"] = {k: round(v, 3) for k, v in s.items()}
            cells.append(f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}")
        table.add_row(key, *cells)
    Console(width=120).print(table)
    ok = all(results.values())
    print(json.dumps({"ok": ok, **summary, "busy": args.busy, "restarts": args.restarts,
                      "kinds": args.kinds,
                      "step_ms": args.step_ms, "numel": args.numel,
                      "load_avg_1min": round(load, 2)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
