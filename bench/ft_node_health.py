"""Node health checks and the ``--health-port`` liveness probe of ``trainguard launch``.

Usage::

    python bench/ft_node_health.py [--faults 3] [--ranks 2] [--trials 3] [--repeats 2]

Figures (medians):

* ``health_checks_s``: the default CPU checks (disk space + writability of one directory, free
  memory) run by :func:`run_health_checks`, in-process, 20 repetitions; baseline
  ``empty_checks_s`` = the same call with no check (thread and deadline overhead only);
* ``crash_to_spawn_s`` / ``crash_to_spawn_no_checks_s``: a rank exits 3 -> every rank of the
  next cycle spawned (``launcher_events.jsonl``), with the default checks before every cycle and
  with ``--ft-health-check off``, same workload, same run, ``--repeats`` alternating launcher
  runs per variant; ``health_overhead_s`` = difference (noise on a loaded machine is larger);
* ``probe_fail_after_sigstop_s``: SIGSTOP the launcher -> the first probe (0.5 s timeout, every
  50 ms) that does not answer 200 (target < 2 s); ``--trials`` SIGSTOP/SIGCONT rounds;
* ``probe_failures_during_restarts``: probes (every 50 ms) that did not answer 200 while the
  launcher ran ``--faults`` crash/restart cycles, before it began stopping (target 0).

Prints a table, then exactly one JSON line. Every launcher run is bounded and its tree reaped.
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
import threading
import time

import httpx

from trainguard._core.net import free_port
from trainguard._core.procs import terminate_processes
from trainguard.fault_tolerance.health import default_checks, run_health_checks

_CRASH = """import os, sys, time
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
time.sleep(0.3)
sys.exit(3 if cycle < int(sys.argv[1]) and os.environ["RANK"] == "1" else 0)
"""
_SLEEP = "import time\ntime.sleep(300)\n"


def _launch(work: str, script: str, args: list[str], port: int | None,
            script_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--log-dir", work,
           "--rdzv-id", "b", "--monitor-interval", "0.05", "--ft-workers-stop-timeout", "2",
           "--ft-term-timeout", "2", *args]
    if port is not None:
        cmd += ["--health-port", str(port)]
    return subprocess.Popen([*cmd, script, *script_args], cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _status(url: str) -> int | None:
    return _get(url)[0]


def _get(url: str) -> tuple[int | None, str]:
    """(status code, launcher state) of one probe; (None, '') when nothing answered in 0.5 s."""
    try:
        r = httpx.get(url, timeout=0.5)
        return r.status_code, str(r.json().get("state", ""))
    except (httpx.TransportError, ValueError):
        return None, ""


def _state(url: str) -> str:
    return _get(url)[1]


def _crash_to_spawn(work: str) -> list[float]:
    """Per restart: first non-zero exit of cycle k -> last spawn of cycle k+1 (wall seconds)."""
    with open(os.path.join(work, "b", "launcher_events.jsonl")) as fh:
        events = [json.loads(ln) for ln in fh]
    out = []
    for k in range(max(e.get("cycle", 0) for e in events)):
        crash = min((e["wall"] for e in events if e["event"] == "exited" and e["cycle"] == k
                     and e["status"] != 0), default=None)
        spawns = [e["wall"] for e in events if e["event"] == "spawned" and e["cycle"] == k + 1]
        if crash is not None and spawns:
            out.append(max(spawns) - crash)
    return out


def restarts(faults: int, ranks: int, checks: bool) -> tuple[list[float], int]:
    """Run ``faults`` crash/restart cycles; returns (crash->spawn list, failed probes)."""
    with tempfile.TemporaryDirectory(prefix="tg_bench_health_") as work:
        script = os.path.join(work, "crash.py")
        with open(script, "w") as fh:
            fh.write(_CRASH)
        port = free_port()
        url = f"http://127.0.0.1:{port}/health"
        args = ["--nproc-per-node", str(ranks), "--max-restarts", str(faults),
                "--ft-warm-restart", "true"] + ([] if checks else ["--ft-health-check", "off"])
        proc = _launch(work, script, args, port, (str(faults),))
        failed = [0]
        stop = threading.Event()

        def poll() -> None:
            answered = stopping = False
            while not stop.is_set() and not stopping:
                code, state = _get(url)
                answered = answered or code == 200
                stopping = state == "stopping"  # the server closes in the teardown
                if answered and code != 200 and proc.poll() is None:
                    failed[0] += 1
                time.sleep(0.05)

        poller = threading.Thread(target=poll, name="bench-poll", daemon=True)
        poller.start()
        try:
            proc.wait(120)
        finally:
            stop.set()
            poller.join(5)
            terminate_processes([proc], grace_s=2)
        return _crash_to_spawn(work), failed[0]


def sigstop_trials(trials: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="tg_bench_health_") as work:
        script = os.path.join(work, "sleep.py")
        with open(script, "w") as fh:
            fh.write(_SLEEP)
        port = free_port()
        url = f"http://127.0.0.1:{port}/health"
        proc = _launch(work, script, ["--ft-warm-restart", "false"], port)
        out = []
        try:
            deadline = time.monotonic() + 60
            while _state(url) != "running" and time.monotonic() < deadline:
                time.sleep(0.05)
            for _ in range(trials):
                os.kill(proc.pid, signal.SIGSTOP)
                t0 = time.monotonic()
                while _status(url) == 200 and time.monotonic() - t0 < 10:
                    time.sleep(0.05)
                out.append(time.monotonic() - t0)
                os.kill(proc.pid, signal.SIGCONT)
                t1 = time.monotonic()
                while _status(url) != 200 and time.monotonic() - t1 < 10:
                    time.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            terminate_processes([proc], grace_s=3)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2,
                    help="launcher runs per variant, alternating with/without checks")
    opts = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="tg_bench_health_") as d:
        checks = [c for c in default_checks([d], 1) if c.name != "cuda"]
        timed = []
        empty = []
        for _ in range(20):
            t0 = time.perf_counter()
            report = run_health_checks(checks, 10.0)
            timed.append(time.perf_counter() - t0)
            if not report.ok:
                raise SystemExit(f"health checks failed on this machine: {report.summary()}")
            t0 = time.perf_counter()
            run_health_checks([], 10.0)
            empty.append(time.perf_counter() - t0)
    with_checks: list[float] = []
    without: list[float] = []
    failed = 0
    for _ in range(opts.repeats):  # alternate, so load drift hits both variants alike
        for checks, out in ((True, with_checks), (False, without)):
            samples, bad = restarts(opts.faults, opts.ranks, checks=checks)
            out.extend(samples)
            failed += bad
    stops = sigstop_trials(opts.trials)

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    result = {
        "bench": "ft_node_health", "faults": opts.faults, "ranks": opts.ranks,
        "repeats": opts.repeats,
        "health_checks_s": med(timed), "empty_checks_s": med(empty),
        "crash_to_spawn_s": med(with_checks), "crash_to_spawn_no_checks_s": med(without),
        "health_overhead_s": (round(med(with_checks) - med(without), 4)  # type: ignore[operator]
                              if with_checks and without else None),
        "restart_samples": [len(with_checks), len(without)],
        "probe_fail_after_sigstop_s": med(stops), "probe_fail_after_sigstop_max_s":
            round(max(stops), 4) if stops else None,
        "probe_failures_during_restarts": failed,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title="node health checks and --health-port (median)")
    for col in ("figure", "trainguard", "baseline"):
        table.add_column(col)
    table.add_row("default CPU checks, in-process (s)", str(result["health_checks_s"]),
                  f"{result['empty_checks_s']} (no check)")
    table.add_row("crash -> next cycle spawned (s)", str(result["crash_to_spawn_s"]),
                  f"{result['crash_to_spawn_no_checks_s']} (--ft-health-check off)")
    table.add_row("SIGSTOP -> probe fails (s)", str(result["probe_fail_after_sigstop_s"]),
                  "target < 2")
    table.add_row("failed probes during restarts", str(result["probe_failures_during_restarts"]),
                  "target 0")
    Console(stderr=True).print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
