"""Real fail-slow injection (root only): a CPU-quota cgroup, and a ``tc tbf`` slow link between
two network namespaces standing in for two nodes. Skipped when not root or the tools are missing;
every cgroup, namespace and qdisc is removed in ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from trainguard._core.clock import Deadline
from trainguard._core.net import free_port
from trainguard._core.procs import terminate_processes
from trainguard.testing import run_ranks

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
CPU_CG = Path("/sys/fs/cgroup/cpu")
WINDOW = 20

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def _stragglers(reports: list[dict[str, Any]]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for r in reports:
        for s in r["stragglers"]:
            out.setdefault(s["rank"], set()).add(s["kind"])
    return out


@root_only
@pytest.mark.skipif(not (CPU_CG / "cpu.cfs_quota_us").exists(), reason="no cgroup v1 cpu")
def test_cpu_quota_throttled_rank_is_a_compute_straggler():
    path = CPU_CG / f"tg_strag_{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text("10000")  # well below the step time
        (path / "cpu.cfs_quota_us").write_text("1000")  # 10 % of one CPU
        cfg = {"steps": 200, "window": WINDOW, "compute_ms": 3.0, "cpu_ms": 1.0,
               "collective": "all", "cgroup": {"rank": 1, "step": 60, "path": str(path)}}
        results = run_ranks("_straggler_workload:run", 4, timeout_s=150, pythonpath=[BENCH],
                            env={"TG_STRAG_CFG": json.dumps(cfg)})
        assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
        found = _stragglers(results[0].result["reports"])
        print(found)
        assert found == {1: {"compute"}}
    finally:
        path.rmdir()  # ranks have exited, so the cgroup is empty


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, timeout=10, capture_output=True)


def _launch_in_netns(cfg: dict[str, Any], ns: list[str], devs: list[str], addr: str,
                     timeout_s: float) -> list[Any]:
    """4 ranks, ranks 0-1 in ns[0] (node n0) and 2-3 in ns[1]; returns their results."""
    procs, files = [], []
    with tempfile.TemporaryDirectory(prefix="tg-strag-ns-") as tmp:
        base = {**os.environ, "WORLD_SIZE": "4", "MASTER_ADDR": addr,
                "MASTER_PORT": str(free_port()), "PYTHONPATH": BENCH,
                "TG_STRAG_CFG": json.dumps(cfg), "PYTHONUNBUFFERED": "1"}
        try:
            for rank in range(4):
                node = rank // 2
                env = {**base, "RANK": str(rank), "GLOO_SOCKET_IFNAME": devs[node],
                       "TRAINGUARD_RESULT_FILE": f"{tmp}/r{rank}.json"}
                err = open(f"{tmp}/r{rank}.err", "w+")  # noqa: SIM115 - closed below
                files.append(err)
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns[node], sys.executable, "-m",
                     "trainguard.testing.faults", "_straggler_workload:run"],
                    env=env, stdout=subprocess.DEVNULL, stderr=err))
            deadline = Deadline(timeout_s)
            for p in procs:
                p.wait(timeout=max(0.1, deadline.remaining()))
        finally:
            terminate_processes(procs, grace_s=2.0)
            errs = []
            for f in files:
                f.seek(0)
                errs.append(f.read()[-2000:])
                f.close()
        assert all(p.returncode == 0 for p in procs), errs
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(4)]


@root_only
@pytest.mark.skipif(not (shutil.which("ip") and shutil.which("tc")), reason="needs ip and tc")
def test_tbf_slow_link_between_namespaces_is_communication():
    tag = uuid.uuid4().hex[:6]
    ns = [f"tgs{tag}a", f"tgs{tag}b"]
    devs = [f"tgs{tag}va", f"tgs{tag}vb"]
    addrs = ["10.233.7.1", "10.233.7.2"]
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", devs[0], "netns", ns[0], "type", "veth", "peer", "name",
            devs[1], "netns", ns[1])
        for n, dev, a in zip(ns, devs, addrs):
            _sh("ip", "-n", n, "addr", "add", f"{a}/24", "dev", dev)
            _sh("ip", "-n", n, "link", "set", dev, "up")
            _sh("ip", "-n", n, "link", "set", "lo", "up")
        cfg = {"steps": 170, "window": WINDOW, "compute_ms": 4.0, "collective": "all",
               "ranks_per_node": 2, "tensor_numel": 16_384,
               "tbf": {"rank": 2, "step": 80, "dev": devs[1], "rate": "16mbit"}}
        results = _launch_in_netns(cfg, ns, devs, addrs[0], timeout_s=150)
        reports = results[0]["reports"]
        steps = [round(r["step_ms_median"], 1) for r in reports]
        found = _stragglers(reports)
        print("step ms per window", steps, "stragglers", found)
        assert found and all(kinds == {"communication"} for kinds in found.values())
        assert set(found) == {0, 1, 2, 3}  # every rank waits on the slow link
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], timeout=10, check=False,
                           capture_output=True)  # deleting a namespace removes its veth end
