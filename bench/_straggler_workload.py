"""Rank program for straggler tests and bench: sleep-model compute, a declarative slow-down plan.

Each rank reads ``TG_STRAG_CFG`` (JSON): ``steps``, ``window``, ``compute_ms``, ``data_ms``,
``slow`` (list of ``{rank, start, end, factor, what}`` with ``what`` = compute | data),
``collective`` (all | sub012 | none), ``section`` (whole-step section), ``hang`` (``{rank, step}``:
that rank blocks on a store key until rank 0 finishes), ``gather`` (gather_on_rank0),
``floor_ms``, ``run_dir`` (rank 0 writes report files), ``ranks_per_node``, ``cpu_ms`` (CPU
time burnt per step on top of the sleep), ``cgroup`` (``{rank, step, path}``: that rank moves
itself into a CPU-quota cgroup at that step; root), ``tbf`` (``{rank, step, dev, rate}``: that
rank rate-limits its namespace's link with ``tc tbf`` at that step; root), ``tensor_numel``.
Returns ``{"reports": [Report.to_dict(), ...], "steps_done": n}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.straggler import Actions, Detector, ScoringConfig


def _factor(cfg: dict[str, Any], rank: int, step: int, what: str) -> float:
    for s in cfg.get("slow", []):
        if s["rank"] == rank and s.get("what", "compute") == what and s["start"] <= step < s["end"]:
            return float(s["factor"])
    return 1.0


def _burn_cpu(ms: float) -> None:
    end = time.thread_time() + ms / 1e3  # CPU time, so a CPU quota stretches the wall time
    while time.thread_time() < end:
        pass


def _inject(cfg: dict[str, Any], rank: int, step: int) -> None:
    cg = cfg.get("cgroup") or {}
    if cg.get("rank") == rank and cg["step"] == step:
        with open(os.path.join(cg["path"], "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    tbf = cfg.get("tbf") or {}
    if tbf.get("rank") == rank and tbf["step"] == step:
        subprocess.run(["tc", "qdisc", "add", "dev", tbf["dev"], "root", "tbf", "rate",
                        tbf["rate"], "burst", "4kb", "latency", "200ms"], check=True, timeout=10)


def run() -> dict[str, Any]:
    cfg = json.loads(os.environ["TG_STRAG_CFG"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sub = dist.new_group([0, 1, 2]) if cfg.get("collective") == "sub012" else None
    store = dist.distributed_c10d._get_default_store()
    run_dir = cfg.get("run_dir") if rank == 0 else None
    Detector.initialize(
        report_time_interval=0, gather_on_rank0=cfg.get("gather", True),
        node_name=f"n{rank // cfg.get('ranks_per_node', 1)}", window_steps=cfg["window"],
        scoring=ScoringConfig(floor_ms=cfg.get("floor_ms", 1.0)),
        actions=Actions(log=True, run_dir=run_dir))
    tensor = torch.ones(cfg.get("tensor_numel", 1024))
    section = Detector.detection_section("step")
    hang = cfg.get("hang") or {}
    steps_done = 0
    for step in range(cfg["steps"]):
        Detector.step()
        if hang.get("rank") == rank and hang["step"] == step:
            store.wait(["test/release"], timedelta(seconds=60))  # hung until rank 0 is done
            break
        _inject(cfg, rank, step)
        with Detector.data_wait():
            time.sleep(cfg.get("data_ms", 0.0) * _factor(cfg, rank, step, "data") / 1e3)
        with section:
            time.sleep(cfg["compute_ms"] * _factor(cfg, rank, step, "compute") / 1e3)
            if cfg.get("cpu_ms"):
                _burn_cpu(cfg["cpu_ms"])
            if cfg.get("collective", "all") == "all":
                dist.all_reduce(tensor)
            elif sub is not None and rank in (0, 1, 2):
                dist.all_reduce(tensor, group=sub)
        steps_done += 1
    if rank == 0 and hang:
        store.set("test/release", "1")
    Detector.shutdown()
    reports = [r.to_dict() for r in Detector.last_reports()]
    if not hang:
        dist.barrier()
    dist.destroy_process_group()
    return {"reports": reports, "steps_done": steps_done}
