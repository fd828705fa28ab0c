"""Restart latency of trainguard's in-process restart vs. a torchrun full restart and NVRx.

Usage::

    python bench/inprocess_restart.py --ranks 4 [--faults 5] [--nvrx-python PY] [--skip-torchrun]

The workload (``bench/_inprocess_workload.py``) is a small DDP model over gloo on CPU (a step takes
a few ms) that builds its process group and loads its checkpoint at every (re)start. Figures,
medians over the injected faults, in seconds, all measured by the workload itself (wall-clock
stamps written by every rank), not taken from the wrapper:

* ours, exception on one rank: until every rank re-entered the wrapped function
  (``restart_s_median``) and until every rank completed its first step (``first_step_s_median``);
* ours, a hang in a C call (``time.sleep``): hang start -> the sleep was interrupted, and -> every
  rank back, both minus ``soft_timeout`` (``hang_detect_over_soft_s_median``,
  ``hang_all_back_over_soft_s_median``);
* ours, SIGKILL of one rank (the world shrinks, or ``--reserve`` ranks take over): until every
  survivor re-entered (``kill_reenter_s_median``);
* baseline torchrun ``--max-restarts``: raise -> every rank's first step after the full restart
  (``torchrun_restart_s_median``); ``ratio_vs_torchrun`` divides it by ``first_step_s_median``;
* baseline NVRx ``inprocess.Wrapper`` (its defaults) run by ``--nvrx-python``: raise -> every rank
  re-entered (``nvrx_restart_s_median``, with the first of ``--nvrx-gloo-timeouts``);
  ``ratio_vs_nvrx`` divides it by ``restart_s_median``.

Ours runs with a large gloo timeout (``--gloo-timeout``, 60 s) to show it does not wait for it; NVRx
cannot break a blocked gloo collective, so its figure follows the gloo timeout it is given.
Prints rich tables, then exactly one JSON line. Every run is bounded in time, and every process
(including daemons that detach from a rank) is stopped and reaped on exit, also on Ctrl-C. Exit
code 1 when a fault was not recovered or a rank process failed (``failed_runs``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from _bench_procs import RankGroup, become_subreaper, exit_on_signals, kill_descendants
from _inprocess_metrics import FaultFigures, fault_figures, load_events, median
from _inprocess_report import console, print_faults, print_summary, targets

from trainguard._core.net import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "_inprocess_workload.py")
FAILED_RUNS: list[str] = []  # runs whose processes failed or timed out (reported in the JSON)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="world size (>= 2)")
    p.add_argument("--faults", type=int, default=5, help="exceptions injected (median over them)")
    p.add_argument("--hang-faults", type=int, default=3, help="hangs injected (0 = skip)")
    p.add_argument(
        "--kill-faults",
        type=int,
        default=2,
        help="SIGKILLs (<= ranks-1; each shrinks the world unless a reserve takes over)",
    )
    p.add_argument("--reserve", type=int, default=0, help="extra idle ranks (ours only)")
    p.add_argument("--skip-hang", action="store_true", help="same as --hang-faults 0")
    p.add_argument("--skip-kill", action="store_true", help="same as --kill-faults 0")
    p.add_argument("--skip-torchrun", action="store_true", help="skip the torchrun baseline")
    p.add_argument("--skip-ours", action="store_true", help="baselines only (for debugging)")
    p.add_argument("--nvrx-python", help="interpreter with nvidia-resiliency-ext installed")
    p.add_argument("--nvrx-faults", type=int, default=None, help="default: --faults")
    p.add_argument(
        "--nvrx-gloo-timeouts",
        default="10",
        help="gloo timeouts (s) of the NVRx runs, e.g. 10,3; the first is reported",
    )
    p.add_argument("--gloo-timeout", type=float, default=60.0, help="seconds, ours and torchrun")
    p.add_argument("--soft-timeout", type=float, default=2.0, help="seconds")
    p.add_argument("--hard-timeout", type=float, default=10.0, help="seconds")
    p.add_argument(
        "--last-call-wait", type=float, default=None, help="seconds; default: the wrapper's"
    )
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="wrapper modes: build a 1-rank DDP before the wrapper (off: what a plain script does)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, events)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error(f"--ranks must be >= 2 (one rank faults, the others must notice), got {args.ranks}")
    if args.reserve < 0:
        p.error(f"--reserve must be >= 0, got {args.reserve}")
    if args.faults < 1:
        p.error(f"--faults must be >= 1, got {args.faults}")
    try:
        args.nvrx_gloo_timeouts = [float(v) for v in args.nvrx_gloo_timeouts.split(",") if v]
    except ValueError:
        p.error(
            f"--nvrx-gloo-timeouts must be comma-separated seconds, got {args.nvrx_gloo_timeouts!r}"
        )
    if not args.nvrx_gloo_timeouts or min(args.nvrx_gloo_timeouts) <= 0:
        p.error("--nvrx-gloo-timeouts needs at least one positive number of seconds")
    args.hang_faults = 0 if args.skip_hang else max(0, args.hang_faults)
    args.kill_faults = 0 if args.skip_kill else min(max(0, args.kill_faults), args.ranks - 1)
    return args


def _rank_env(rank: int, world: int, master_port: int, store_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "GROUP_RANK")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        TRAINGUARD_STORE_PORT=str(store_port),
        OMP_NUM_THREADS="1",
        TORCH_CPP_LOG_LEVEL="ERROR",
        PYTHONUNBUFFERED="1",
    )
    return env


def _plan(args: argparse.Namespace, n_exc: int, hangs: int, kills: int) -> list[dict[str, Any]]:
    """Exceptions and hangs rotate over ranks 1..W-1; kills take the highest ranks first."""
    others = list(range(1, args.ranks))
    plan = [{"kind": "exc", "rank": others[i % len(others)]} for i in range(n_exc)]
    plan += [{"kind": "hang", "rank": others[(i + 1) % len(others)]} for i in range(hangs)]
    plan += [{"kind": "kill", "rank": args.ranks - 1 - i} for i in range(kills)]
    return plan


def _report_failure(group: RankGroup, tags: list[str], codes: list, timed_out: bool) -> None:
    FAILED_RUNS.append(group.name)
    note = " (timed out)" if timed_out else ""
    console.print(f"{group.name}: exit codes {codes}{note}", style="red", markup=False)
    for tag in tags:
        tail = group.log_tail(tag)
        if tail:
            console.print(f"--- {group.name}_{tag}.log (tail) ---\n{tail}", markup=False)


def run_wrapped(
    args: argparse.Namespace,
    work: str,
    name: str,
    mode: str,
    python: str,
    plan: list[dict[str, Any]],
    extra: list[str],
    reserve: int = 0,
) -> list[FaultFigures]:
    """Run the workload as ``args.ranks`` (+ ``reserve``) plain processes under a wrapper."""
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    master, store = free_port(), free_port()
    cmd = [python, *_workload_args(mode, out, plan, args), "--store-port", str(store), *extra]
    # Generous: a mechanism that waits for the gloo timeout still finishes and shows it.
    slack = 15.0 + args.gloo_timeout
    per_fault = {"exc": slack, "hang": args.hard_timeout + slack, "kill": slack}
    world = args.ranks + reserve
    if reserve:
        cmd += ["--active", str(args.ranks)]
    budget = 60.0 + 5.0 * world + sum(per_fault[f["kind"]] for f in plan)
    with RankGroup(work, name) as group:
        for rank in range(world):
            group.start(cmd, _rank_env(rank, world, master, store), f"rank{rank}")
        codes, timed_out = group.wait(budget)
        killed = {f["rank"] for f in plan if f["kind"] == "kill"}
        bad = [r for r, c in enumerate(codes) if r not in killed and c != 0]
        if timed_out or bad:
            _report_failure(group, [f"rank{r}" for r in (bad or range(world))], codes, timed_out)
    return fault_figures(load_events(out))


def _workload_args(mode: str, out: str, plan: list, args: argparse.Namespace) -> list[str]:
    """The workload script and the arguments every mode shares."""
    return [WORKLOAD, "--mode", mode, "--out", out, "--plan", json.dumps(plan),
            "--gloo-timeout", str(args.gloo_timeout)]


def run_torchrun(args: argparse.Namespace, work: str) -> list[FaultFigures]:
    """The same workload under ``torchrun --max-restarts``: every fault restarts the whole job."""
    out = os.path.join(work, "torchrun")
    os.makedirs(out, exist_ok=True)
    plan = _plan(args, args.faults, 0, 0)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        f"--max-restarts={args.faults}",
        "--monitor-interval=0.1",
        *_workload_args("torchrun", out, plan, args),
    ]
    env = _rank_env(0, args.ranks, 0, 0)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        env.pop(key)  # torchrun sets them per worker
    with RankGroup(work, "torchrun") as group:
        group.start(cmd, env, "agent")
        codes, timed_out = group.wait(60.0 + 10.0 * args.ranks + 25.0 * args.faults)
        if timed_out or codes != [0]:
            _report_failure(group, ["agent"], codes, timed_out)
    return fault_figures(load_events(out))


def nvrx_available(python: str) -> bool:
    try:
        res = subprocess.run(
            [python, "-c", "import nvidia_resiliency_ext.inprocess"],
            capture_output=True,
            timeout=120,
            check=False,
            env=_rank_env(0, 1, 0, 0),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        console.print(f"[yellow]NVRx not usable with {python}: {exc}")
        return False
    if res.returncode != 0:
        console.print(f"[yellow]NVRx not importable with {python}:\n{res.stderr.decode()[-500:]}")
    return res.returncode == 0


def ours_summary(
    args: argparse.Namespace, plan: list[dict[str, Any]], figs: list[FaultFigures]
) -> dict[str, Any]:
    kind = {k: [f for f in figs if f.kind == k] for k in ("exc", "hang", "kill")}
    soft = args.soft_timeout
    return {
        "restart_s_median": median([f.reentered_s for f in kind["exc"]]),
        "first_step_s_median": median([f.first_step_s for f in kind["exc"]]),
        "hang_detect_over_soft_s_median": median([f.detect_s for f in kind["hang"]], soft)
        if kind["hang"]
        else None,
        "hang_all_back_over_soft_s_median": median([f.reentered_s for f in kind["hang"]], soft)
        if kind["hang"]
        else None,
        "kill_reenter_s_median": median([f.reentered_s for f in kind["kill"]])
        if kind["kill"]
        else None,
        "faults_injected": {k: len(v) for k, v in kind.items()},
        "faults_unrecovered": len(plan) - sum(f.recovered for f in figs),
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den else None


def run_all(args: argparse.Namespace, work: str) -> dict[str, Any]:
    load_start = round(os.getloadavg()[0], 2)
    extra = ["--soft-timeout", str(args.soft_timeout), "--hard-timeout", str(args.hard_timeout)]
    if args.last_call_wait is not None:
        extra += ["--last-call-wait", str(args.last_call_wait)]
    if args.warm_up:
        extra.append("--warm-up")
    plan = _plan(args, args.faults, args.hang_faults, args.kill_faults)
    ours: list[FaultFigures] = []
    if not args.skip_ours:
        kinds = [f["kind"] for f in plan]
        console.print(f"[bold]ours[/]: {args.ranks} ranks + {args.reserve} reserve, plan {kinds}")
        ours = run_wrapped(args, work, "ours", "ours", sys.executable, plan, extra, args.reserve)
        print_faults("trainguard", ours)
    result: dict[str, Any] = {
        "ranks": args.ranks,
        "reserve_ranks": args.reserve,
        "faults": args.faults,
        **ours_summary(args, [] if args.skip_ours else plan, ours),
    }
    result.update(
        torchrun_restart_s_median=None,
        ratio_vs_torchrun=None,
        nvrx_restart_s_median=None,
        ratio_vs_nvrx=None,
    )
    if not args.skip_torchrun:
        console.print("[bold]torchrun --max-restarts[/] (full restart)")
        tr = run_torchrun(args, work)
        print_faults("torchrun", tr)
        result["torchrun_restart_s_median"] = median([f.first_step_s for f in tr])
        result["ratio_vs_torchrun"] = _ratio(
            result["torchrun_restart_s_median"], result["first_step_s_median"]
        )
    if args.nvrx_python and nvrx_available(args.nvrx_python):
        result.update(run_nvrx(args, work, result["restart_s_median"]))
    result.update(
        gloo_timeout_s=args.gloo_timeout,
        soft_timeout_s=args.soft_timeout,
        last_call_wait_s=args.last_call_wait,  # None: the wrapper's default
        warm_up=args.warm_up,
        load_avg_1m=[load_start, round(os.getloadavg()[0], 2)],  # shared machine: noise hint
    )
    return result


def run_nvrx(args: argparse.Namespace, work: str, ours_restart: float | None) -> dict[str, Any]:
    """NVRx's Wrapper with its defaults; one run per gloo timeout in ``--nvrx-gloo-timeouts``."""
    n = args.nvrx_faults or args.faults
    by_timeout: dict[str, float | None] = {}
    for gloo in args.nvrx_gloo_timeouts:
        console.print(f"[bold]NVRx inprocess.Wrapper[/] (defaults), gloo timeout {gloo:g} s")
        sub = argparse.Namespace(**{**vars(args), "gloo_timeout": gloo})
        extra = ["--gloo-timeout", str(gloo)] + (["--warm-up"] if args.warm_up else [])
        figs = run_wrapped(
            sub, work, f"nvrx_gloo{gloo:g}", "nvrx", args.nvrx_python, _plan(args, n, 0, 0), extra
        )
        print_faults(f"NVRx (gloo timeout {gloo:g} s)", figs)
        by_timeout[f"{gloo:g}"] = median([f.reentered_s for f in figs])
    first = next(iter(by_timeout.values()), None)
    return {
        "nvrx_restart_s_median": first,
        "ratio_vs_nvrx": _ratio(first, ours_restart),
        "nvrx_gloo_timeout_s": float(next(iter(by_timeout), "nan")),
        "nvrx_faults": n,
        "nvrx_restart_s_median_by_gloo_timeout": by_timeout,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    become_subreaper()
    work = tempfile.mkdtemp(prefix="tg_bench_restart_")
    try:
        with exit_on_signals():
            result = run_all(args, work)
    except KeyboardInterrupt:
        console.print("[red]interrupted: all benchmark processes stopped")
        return 130
    finally:
        kill_descendants()
        if args.keep:
            console.print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["targets_met"] = {k: ok for k, _, ok in targets(result)}
    result["failed_runs"] = FAILED_RUNS
    print_summary(result)
    print(json.dumps(result), flush=True)
    ok = result["faults_unrecovered"] == 0 and not FAILED_RUNS
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
