"""``trainguard demo --launcher``: the demo's ranks under ``trainguard launch``, two layers.

The same rank program (``trainguard._demo._rank``, ``inprocess.Wrapper`` around DDP training) runs
as the workers of one ``trainguard launch`` job. Exceptions and hangs are handled in-process by
the wrapper (the same processes go on); a process death is handled by the launcher, which stops
every worker and restarts the job from the newest checkpoint at full world size (in-job restart,
warm from its fork server). That covers what in-process restart alone cannot: a second SIGKILL
once the reserve rank is used up would leave the wrapper short of ranks; under the launcher the
job comes back with every rank.

The launcher's own hang detection stays on as a backstop, with a timeout above the wrapper's hard
timeout so the wrapper always acts first on a hang it can handle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainguard._core.clock import Deadline
from trainguard._core.procs import terminate_processes
from trainguard._demo._config import DemoConfig

__all__ = ["DEFAULT_LAUNCHER_FAULTS", "run_under_launcher"]

# the default schedule plus a second SIGKILL after the reserve rank has been used
DEFAULT_LAUNCHER_FAULTS = ("exception@rank1:step40,hang@rank2:step80,sigkill@rank3:step110,"
                           "sigkill@rank0:step130")
_TERM_WAIT_S = 40.0  # the launcher's own teardown bound (term timeout + grace) and some slack


def launcher_command(config: DemoConfig, config_path: Path) -> list[str]:
    """The ``trainguard launch`` command line that runs the demo's ranks."""
    kills = sum(1 for f in config.faults if f.kind == "sigkill")
    backstop = config.hard_timeout_s + 30.0
    return [sys.executable, "-m", "trainguard.fault_tolerance.launcher",
            "--nproc-per-node", str(config.world_size), "--max-restarts", str(kills + 1),
            "--rdzv-id", "demo", "--log-dir", str(config.root / "launch"),
            "--ft-auto-heartbeat-timeout", f"{backstop:g}",
            "-m", "trainguard._demo._rank", str(config_path)]


def _events(root: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((root / "events").glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a SIGKILL
    return sorted(out, key=lambda e: float(e.get("t", 0.0)))


def summarize(config: DemoConfig, rc: int | None) -> tuple[list[str], dict[str, Any]]:
    """``(problems, summary)`` of a finished run, read from the ranks' event files."""
    events = _events(config.root)
    cycles = sorted({int(e.get("cycle", 0)) for e in events if e["ev"] == "start"})
    fired = {(e["rank"], e["step"], e["kind"]) for e in events if e["ev"] == "fault"}
    done = [e for e in events if e["ev"] == "done"]
    last_cycle = cycles[-1] if cycles else 0
    starts_last = [e for e in events if e["ev"] == "start" and e.get("cycle", 0) == last_cycle]
    enters = [e for e in events if e["ev"] == "enter"]
    final_world = enters[-1]["active_world_size"] if enters else 0
    accuracy = max((float(e["accuracy"]) for e in done), default=0.0)
    problems = []
    if rc != 0:
        problems.append(f"trainguard launch exited with {rc}")
    for f in config.faults:
        if (f.rank, f.step, f.kind) not in fired:
            problems.append(f"fault {f.label} never fired")
    kills = sum(1 for f in config.faults if f.kind == "sigkill")
    if len(cycles) != kills + 1:
        problems.append(f"{len(cycles)} launcher cycle(s), expected {kills + 1} (one per SIGKILL)")
    if len(starts_last) != config.world_size:
        problems.append(f"the last cycle started {len(starts_last)} of {config.world_size} ranks")
    if final_world != config.ranks:
        problems.append(f"training ended at world size {final_world}, not {config.ranks}")
    if accuracy < 0.95:
        problems.append(f"test accuracy {accuracy:.3f} < 0.95")
    summary = {"launcher_rc": rc, "cycles": len(cycles), "final_world_size": final_world,
               "accuracy": round(accuracy, 4),
               "faults": [f.label for f in config.faults], "problems": problems,
               "passed": not problems}
    return problems, summary


def run_under_launcher(config: DemoConfig, config_path: Path, *, timeout_s: float,
                       console: Console) -> int:
    """Run the demo under ``trainguard launch``; returns the demo's exit status (0 PASS, 1).

    Blocks at most ``timeout_s`` seconds plus the launcher's teardown (about 40 s). The
    launcher's output (its log lines and summary table) goes to this process's stderr.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                        "TRAINGUARD_STORE_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TORCH_CPP_LOG_LEVEL=env.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    cmd = launcher_command(config, config_path)
    console.print(f"[bold]under trainguard launch[/]: {' '.join(cmd[1:])}", markup=True,
                  highlight=False)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    try:
        proc.wait(Deadline(timeout_s).remaining())
    except subprocess.TimeoutExpired:
        console.print(f"[bold red]global timeout of {timeout_s:.0f} s expired; stopping the job")
        proc.send_signal(signal.SIGTERM)  # the launcher forwards it and reaps every worker
        try:
            proc.wait(_TERM_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    finally:
        terminate_processes([proc], grace_s=5.0)
    problems, summary = summarize(config, proc.returncode)
    (config.root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = Table(title="trainguard demo --launcher")
    for col in ("launcher exit", "cycles", "final world size", "accuracy", "faults"):
        table.add_column(col)
    table.add_row(str(summary["launcher_rc"]), str(summary["cycles"]),
                  str(summary["final_world_size"]), f"{summary['accuracy']:.3f}",
                  ", ".join(summary["faults"]) or "none")
    console.print(table)
    for p in problems:
        console.print(f"[bold red]FAIL[/]: {p}")
    if not problems:
        console.print("[bold green]PASS[/]: exceptions and hangs recovered in-process, process "
                      "deaths by in-job restarts at full world size")
    return 1 if problems else 0
