"""Launcher restart latency and hang detection: ``trainguard launch`` vs torchrun (and NVRx).

Usage::

    python bench/ft_launcher.py [--ranks 2 4] [--faults 3] [--nvrx-python PY] [--skip-torchrun]
    python bench/ft_launcher.py --nodes 3 --nodes-only [--faults 5]   # multi-node figures only

Workload: a small DDP model over gloo on CPU that imports torch, builds its process group (on a
per-attempt store prefix, which torchrun's restarts need) and DDP model at every (re)start and
writes wall-clock stamps per rank (``start`` = first line of the
script, ``first_step`` = first completed step of a cycle, ``crash`` = just before rank 1 raises).
One launcher run injects ``--faults`` crashes (one per cycle, ``--max-restarts`` = faults), so
every figure is a median over the faults, measured by the workload itself:

* ``crash_to_spawn_s``: crash -> the last rank of the next cycle started its script;
* ``crash_to_first_step_s``: crash -> every rank of the next cycle completed its first step;
  the same under ``torchrun --standalone --max-restarts`` (``torchrun_crash_to_first_step_s``) and
  NVRx ``ft_launcher`` (``nvrx_crash_to_first_step_s``, with ``--nvrx-python``);
  ``ratio_vs_torchrun`` = torchrun / ours (target >= 3);
* ``hang_detect_overhead_s``: a rank sends client heartbeats every step, then sleeps in C; the
  launcher's detection time (``launcher_events.jsonl``) minus the hang start minus the configured
  heartbeat timeout (``--hb-timeout``, 2 s);
* ``heartbeat_us_median`` / ``section_us_median``: one ``send_heartbeat()`` / one section mark
  (half a ``start_section`` + ``end_section`` pair), measured in a worker under the launcher
  (median of 30 interleaved batches of 5000 calls; ``*_min_max`` the extremes);
  ``empty_method_call_us`` is an empty Python method call in the same process, interleaved with
  them, to read the figures against the machine's load; ``*_cpu_us*`` are the same from the
  thread's CPU time, which leaves out time the worker was preempted by other processes.

With ``--nodes N`` (see ``bench/_ft_nodes.py``), N simulated nodes (network namespaces on a
bridge; root needed, else N launchers on localhost) each run one launcher with
``--nproc-per-node`` 2; one node is lost (launcher and workers SIGKILLed) per run, ``--faults``
runs, min/median/max reported:

* ``torchrun_node_loss_to_restart_s``: torchrun c10d, ``--nnodes N-1:N``: kill -> every
  survivor completed its first step of the next generation;
* ``lease_s``, ``node_loss_to_restart_s``, ``store_loss_to_exit_s``, ``partition_to_fence_s``,
  ``spare_promotion_s``: trainguard's multi-node launcher (null until it supports them).

Headline keys are for the smallest ``--ranks``; ``by_ranks`` holds every configuration. Prints
tables, then exactly one JSON line. Every run is bounded (``--timeout``) and its whole process
tree stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainguard._core.procs import terminate_processes

WORKLOAD = r'''
import time; T0 = time.time()
import json, os, sys
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"]); rank = int(os.environ["RANK"])
out = open(os.path.join(sys.argv[1], f"stamps_{rank}.jsonl"), "a")
def stamp(ev, **kw):
    out.write(json.dumps({"ev": ev, "t": time.time(), "cycle": cycle, "rank": rank, **kw}) + "\n")
    out.flush()
stamp("start", t0=T0)
import torch, torch.distributed as dist
faults, mode = int(sys.argv[2]), sys.argv[3]
client = None
if mode == "hang":
    from trainguard.fault_tolerance import RankMonitorClient
    client = RankMonitorClient(); client.init_workload_monitoring()
from datetime import timedelta
# a fresh store prefix per attempt: torchrun's agent store outlives restarts, and a restarted gloo
# group reading the previous attempt's keys fails in connectFullMesh (launcher-research.md E1)
agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
world = int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      rank == 0 and not agent, timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{cycle}", store), rank=rank,
                        world_size=world, timeout=timedelta(seconds=120))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
for step in range(40):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
    if client is not None:
        client.send_heartbeat()
    if step == 0:
        stamp("first_step")
    if cycle < faults and rank == 1 and step == 5:
        if mode == "hang":
            stamp("hang"); time.sleep(3600)
        stamp("crash"); raise RuntimeError("injected crash")
    time.sleep(0.02)
stamp("done")
dist.destroy_process_group()
'''

MICRO = r'''
import json, time
from trainguard.fault_tolerance import RankMonitorClient
c = RankMonitorClient(); c.init_workload_monitoring()
class Empty:
    def call(self):
        pass
def pair():
    c.start_section("step"); c.end_section("step")
# interleaved batches (heartbeat, section pair, empty call), so load changes hit all three alike
fns = {"heartbeat": (c.send_heartbeat, 1), "section": (pair, 2), "empty_call": (Empty().call, 1)}
res = {k: [] for k in fns}
cpu = {k: [] for k in fns}
for _ in range(30):
    for k, (fn, per) in fns.items():
        t, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(5000):
            fn()
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        res[k].append((t1 - t) / 5000 / 1000 / per)
        cpu[k].append((c1 - c0) / 5000 / 1000 / per)
out = {}
for k, v in res.items():
    v.sort()
    out[f"{k}_us"] = v[len(v) // 2]
    out[f"{k}_us_min"], out[f"{k}_us_max"] = v[0], v[-1]
    out[f"{k}_cpu_us"] = sorted(cpu[k])[len(v) // 2]  # CPU time: preemption by load excluded
print("MICRO " + json.dumps(out), flush=True)
'''


def _stamps(folder: Path) -> list[dict]:
    out = []
    for f in folder.glob("stamps_*.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = "(timed out)"
    finally:
        tree = [proc] + [p.pid for p in _tree(proc.pid)]
        terminate_processes(tree, grace_s=2.0, groups=True)
    return proc.returncode if proc.returncode is not None else -9, out or ""


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _crash_figures(stamps: list[dict], faults: int, ranks: int) -> dict[str, list[float]]:
    spawn, first = [], []
    for c in range(faults):
        crash = [s["t"] for s in stamps if s["ev"] in ("crash", "hang") and s["cycle"] == c]
        starts = [s["t0"] for s in stamps if s["ev"] == "start" and s["cycle"] == c + 1]
        steps = [s["t"] for s in stamps if s["ev"] == "first_step" and s["cycle"] == c + 1]
        if crash and len(starts) == ranks and len(steps) == ranks:
            spawn.append(max(starts) - crash[0])
            first.append(max(steps) - crash[0])
    return {"spawn": spawn, "first": first}


def _launch_cmd(kind: str, args: argparse.Namespace, ranks: int, faults: int) -> list[str]:
    common = ["--nproc-per-node", str(ranks), "--max-restarts", str(faults)]
    if kind == "ours":
        return [sys.executable, "-m", "trainguard.fault_tolerance.launcher", *common,
                "--rdzv-id", "bench", "--ft-workers-stop-timeout", "5"]
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common]
    nvrx_bin = str(Path(args.nvrx_python).parent / "ft_launcher")
    return [nvrx_bin, "--standalone", *common]


def run_crashes(kind: str, args: argparse.Namespace, ranks: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"tg_bench_{kind}_") as tmp:
        folder = Path(tmp)
        (folder / "work.py").write_text(WORKLOAD)
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
        cmd = _launch_cmd(kind, args, ranks, args.faults)
        cmd += ["--log-dir", str(folder / "logs")] if kind == "ours" else []
        rc, out = _run([*cmd, str(folder / "work.py"), str(folder), str(args.faults), "crash"],
                       folder, args.timeout, env)
        figs = _crash_figures(_stamps(folder), args.faults, ranks)
    return {"rc": rc, **figs, "log_tail": out[-1500:] if rc else ""}


def run_hang(args: argparse.Namespace, ranks: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tg_bench_hang_") as tmp:
        folder = Path(tmp)
        (folder / "work.py").write_text(WORKLOAD)
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
        cmd = [*_launch_cmd("ours", args, ranks, args.faults), "--log-dir", str(folder / "logs"),
               "--ft-rank-heartbeat-timeout", str(args.hb_timeout),
               "--ft-initial-rank-heartbeat-timeout", "120"]
        rc, out = _run([*cmd, str(folder / "work.py"), str(folder), str(args.faults), "hang"],
                       folder, args.timeout, env)
        stamps = _stamps(folder)
        events = [json.loads(line) for line in
                  (folder / "logs" / "bench" / "launcher_events.jsonl").read_text().splitlines()]
    over = []
    for c in range(args.faults):
        hang = [s["t"] for s in stamps if s["ev"] == "hang" and s["cycle"] == c]
        det = [e["detected_wall"] for e in events
               if e["event"] == "hang_detected" and e["cycle"] == c]
        if hang and det:
            over.append(det[0] - hang[0] - args.hb_timeout)
    return {"rc": rc, "over": over, "log_tail": out[-1500:] if rc else ""}


def run_micro(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="tg_bench_micro_") as tmp:
        folder = Path(tmp)
        (folder / "micro.py").write_text(MICRO)
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        rc, out = _run([sys.executable, "-m", "trainguard.fault_tolerance.launcher",
                        "--nproc-per-node", "1", "--ft-warm-restart", "false",
                        "--ft-rank-section-timeouts", "step:600", "--log-dir",
                        str(folder / "logs"), str(folder / "micro.py")], folder, 300, env)
    line = next((ln for ln in out.splitlines() if "MICRO " in ln), "")
    return json.loads(line.split("MICRO ", 1)[1]) if line else {"rc": rc, "error": out[-800:]}


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes")
    p.add_argument("--faults", type=int, default=3, help="crashes (and hangs) per configuration")
    p.add_argument("--hb-timeout", type=float, default=2.0, help="heartbeat timeout, seconds")
    p.add_argument("--nvrx-python", help="interpreter of a venv with nvidia-resiliency-ext")
    p.add_argument("--skip-torchrun", action="store_true", help="skip the torchrun baseline")
    p.add_argument("--skip-hang", action="store_true", help="skip the hang measurement")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launcher run")
    p.add_argument("--micro-only", action="store_true",
                   help="only the heartbeat / section-mark cost (no launcher restarts)")
    p.add_argument("--nodes", type=int, default=0,
                   help="simulated nodes for the multi-node figures (0: skip them; >= 3)")
    p.add_argument("--lease", type=float, default=2.0,
                   help="trainguard's --ft-lease-s in the multi-node runs, seconds")
    p.add_argument("--nodes-only", action="store_true",
                   help="skip the single-node figures (their keys are reported as null)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.nodes and args.nodes < 3:
        print("ft_launcher: --nodes must be >= 3 (one node is lost, and neither the store host "
              "nor rank 0's node is chosen)", file=sys.stderr)
        return 2
    load_start = round(os.getloadavg()[0], 2)
    by_ranks: dict[str, dict] = {}
    failed: list[str] = []
    for ranks in [] if (args.micro_only or args.nodes_only) else args.ranks:
        row: dict[str, object] = {}
        kinds = ["ours"] + ([] if args.skip_torchrun else ["torchrun"]) + \
            (["nvrx"] if args.nvrx_python else [])
        for kind in kinds:
            res = run_crashes(kind, args, ranks)
            prefix = "" if kind == "ours" else f"{kind}_"
            row[f"{prefix}crash_to_first_step_s"] = _med(res["first"])
            row[f"{prefix}crash_to_spawn_s"] = _med(res["spawn"])
            row[f"{prefix}samples"] = len(res["first"])
            if res["rc"] != 0 or len(res["first"]) < args.faults:
                failed.append(f"{kind} ranks={ranks} rc={res['rc']}: {res['log_tail'][-600:]}")
        if not args.skip_hang:
            hang = run_hang(args, ranks)
            row["hang_detect_overhead_s"] = _med(hang["over"])
            row["hang_samples"] = len(hang["over"])
            if hang["rc"] != 0 or not hang["over"]:
                failed.append(f"hang ranks={ranks} rc={hang['rc']}: {hang['log_tail'][-600:]}")
        ours, torchrun = row.get("crash_to_first_step_s"), row.get("torchrun_crash_to_first_step_s")
        row["ratio_vs_torchrun"] = round(torchrun / ours, 2) if ours and torchrun else None
        by_ranks[str(ranks)] = row
    micro = {} if args.nodes_only else run_micro(args)
    nodes = run_nodes(args, failed) if args.nodes else {}
    _print_tables(by_ranks, micro, nodes)
    head = by_ranks.get(str(min(args.ranks)), {})
    result = {
        "bench": "ft_launcher", "ranks": args.ranks, "faults": args.faults,
        "hang_detect_overhead_s": head.get("hang_detect_overhead_s"),
        "crash_to_spawn_s": head.get("crash_to_spawn_s"),
        "crash_to_first_step_s": head.get("crash_to_first_step_s"),
        "torchrun_crash_to_first_step_s": head.get("torchrun_crash_to_first_step_s"),
        "nvrx_crash_to_first_step_s": head.get("nvrx_crash_to_first_step_s"),
        "ratio_vs_torchrun": head.get("ratio_vs_torchrun"),
        "heartbeat_us_median": _round(micro.get("heartbeat_us")),
        "section_us_median": _round(micro.get("section_us")),
        "empty_method_call_us": _round(micro.get("empty_call_us")),
        "heartbeat_cpu_us_median": _round(micro.get("heartbeat_cpu_us")),
        "section_cpu_us_median": _round(micro.get("section_cpu_us")),
        "empty_method_call_cpu_us": _round(micro.get("empty_call_cpu_us")),
        "heartbeat_us_min_max": [_round(micro.get("heartbeat_us_min")),
                                 _round(micro.get("heartbeat_us_max"))],
        "section_us_min_max": [_round(micro.get("section_us_min")),
                               _round(micro.get("section_us_max"))],
        "hb_timeout_s": args.hb_timeout, "by_ranks": by_ranks,
        "nodes": args.nodes or None, **{k: nodes.get(k) for k in NODE_KEYS},
        "by_nodes": nodes.get("by_key"), "failed_runs": failed,
        "load_avg_1m": [load_start, round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(result))
    return 1 if failed else 0


NODE_KEYS = ("lease_s", "node_loss_to_restart_s", "store_loss_to_exit_s", "partition_to_fence_s",
             "spare_promotion_s", "torchrun_node_loss_to_restart_s")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run_nodes(args: argparse.Namespace, failed: list[str]) -> dict:
    """Multi-node figures (medians as the headline keys, min/median/max in ``by_key``)."""
    from _ft_nodes import SCENARIOS, run_scenario

    keys = [] if args.skip_torchrun else ["torchrun_node_loss_to_restart_s"]
    if _launcher_has_leases():
        keys += [k for k in SCENARIOS if not k.startswith("torchrun")]
    else:
        failed.append("trainguard launch has no --ft-lease-s (multi-node launcher missing)")
    by_key: dict[str, dict] = {}
    for key in keys:
        res = run_scenario(key, args.nodes, 2, args.lease, args.faults, args.timeout)
        by_key[key] = res
        failed += [f"{key} nodes={args.nodes}: {e}" for e in res["errors"]]
    out: dict[str, object] = {k: v["median"] for k, v in by_key.items()}
    out["lease_s"] = args.lease if len(keys) > 1 else None
    out["by_key"] = {k: {m: v[m] for m in ("min", "median", "max", "values")}
                     for k, v in by_key.items()}
    return out


def _launcher_has_leases() -> bool:
    out = subprocess.run([sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--help"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    return "--ft-lease-s" in out.stdout


def _print_tables(by_ranks: dict[str, dict], micro: dict, nodes: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="crash -> first step of the next cycle (median, seconds)")
    cols = ["ranks", "ours spawn", "ours first step", "torchrun", "nvrx", "ratio vs torchrun",
            "hang overhead"]
    for c in cols:
        table.add_column(c)
    for ranks, row in by_ranks.items():
        vals = [row.get(k) for k in ("crash_to_spawn_s", "crash_to_first_step_s",
                                     "torchrun_crash_to_first_step_s",
                                     "nvrx_crash_to_first_step_s", "ratio_vs_torchrun",
                                     "hang_detect_overhead_s")]
        table.add_row(ranks, *["-" if v is None else str(v) for v in vals])
    console = Console(stderr=True)
    console.print(table)
    if nodes.get("by_key"):
        ntable = Table(title="multi-node (seconds: min / median / max)")
        for c in ("figure", "min", "median", "max", "runs"):
            ntable.add_column(c)
        for key, row in nodes["by_key"].items():
            ntable.add_row(key, *[str(row[m]) for m in ("min", "median", "max")],
                           str(len(row["values"])))
        console.print(ntable)
    if micro:
        for k in ("heartbeat", "section", "empty_call"):
            console.print(f"{k}: median {micro.get(f'{k}_us', -1):.3f} us/call wall (min "
                          f"{micro.get(f'{k}_us_min', -1):.3f}, max "
                          f"{micro.get(f'{k}_us_max', -1):.3f}), "
                          f"{micro.get(f'{k}_cpu_us', -1):.3f} us CPU time; 30 interleaved "
                          "batches of 5000 calls")


if __name__ == "__main__":
    sys.exit(main())
