"""Multi-node part of ``bench/ft_launcher.py`` (``--nodes N``): node loss on simulated nodes.

Each simulated node (:class:`trainguard.testing.SimNodes`: a network namespace with its own
address on a bridge; :class:`~trainguard.testing.LocalNodes` on 127.0.0.1 where namespaces are
unavailable) runs one launcher with ``--nproc-per-node`` ranks of a small DDP model over gloo.
Once every rank trains, one node is lost: its launcher and its workers are SIGKILLed together (a
machine that dies). The figure is the time from the kill to the moment every surviving rank has
completed its first step in the next generation, read from the ranks' own wall-clock stamps.

* ``torchrun_node_loss_to_restart_s``: ``torchrun --rdzv-backend c10d --nnodes N-1:N`` (the
  rendezvous store hosted on the first node with ``--rdzv-conf is_host=1``; defaults otherwise,
  so its keep-alive and last-call timeouts apply). The node lost is neither the store host nor
  the node of global rank 0, so the survivors can continue.
* ``node_loss_to_restart_s``: the same with ``trainguard launch`` (``--ft-lease-s`` = lease).
* ``store_loss_to_exit_s``: a standalone ``trainguard store`` on a service namespace; its link
  goes down -> every launcher exited with 75 (store lost, self-fenced).
* ``partition_to_fence_s``: one node blackholes its route to the store -> it exited 75.
* ``spare_promotion_s``: N launchers train, one more parks as a spare; a node's rank asks for
  its exclusion -> every rank of the next cycle (the spare's too) completed its first step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainguard.testing import (
    LocalNodes,
    SimNodes,
    netns_unavailable,
    trainguard_shm_segments,
)

RDZV_PORT = 29411
_SHM_OWNER = re.compile(r"tg_[a-z]+?([0-9a-f]+)_")  # segment names carry the owner's pid
EXIT_STORE_LOST = 75  # trainguard launch: this node lost its lease and fenced itself
NODE_WORKLOAD = r'''
import time; T0 = time.time()
import json, os, sys
cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")); rank = int(os.environ["RANK"])
node = int(os.environ["TG_BENCH_NODE"])
out = open(os.path.join(sys.argv[1], f"stamps_{node}_{os.getpid()}.jsonl"), "a")
def stamp(ev, **kw):
    out.write(json.dumps({"ev": ev, "t": time.time(), "cycle": cycle, "rank": rank, "node": node,
                          **kw}) + "\n")
    out.flush()
stamp("start", t0=T0)
import torch, torch.distributed as dist
from datetime import timedelta
agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
world = int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      rank == 0 and not agent, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{cycle}", store), rank=rank,
                        world_size=world, timeout=timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 64)
stop = os.path.join(sys.argv[1], "stop")
step = 0
exclude = os.path.join(sys.argv[1], f"exclude_{node}")
while not os.path.exists(stop) and step < 20000:
    if os.environ.get("LOCAL_RANK") == "0" and os.path.exists(exclude):
        from trainguard.fault_tolerance import (RankMonitorClient, WorkloadAction,
                                                WorkloadControlRequest)
        client = RankMonitorClient(); client.init_workload_monitoring()
        stamp("exclude")
        client.send_workload_control_request(
            WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "bench: spare promotion"))
        time.sleep(0.5); sys.exit(3)
    opt.zero_grad(); model(x).sum().backward(); opt.step()
    if step == 0:
        stamp("first_step", world=world)
    step += 1
    time.sleep(0.05)
stamp("done")
dist.destroy_process_group()
'''


def stamps(folder: Path) -> list[dict]:
    out = []
    for f in folder.glob("stamps_*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _wait_for(pred, timeout_s: float, interval_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval_s)
    return False


def kill_node(agent: subprocess.Popen) -> float:
    """SIGKILL a node's launcher and every process under it at once; returns the wall time."""
    tree = [agent.pid]
    with contextlib.suppress(psutil.Error):
        tree += [p.pid for p in psutil.Process(agent.pid).children(recursive=True)]
    t = time.time()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(agent.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    agent.wait(timeout=10)
    return t


def torchrun_cmd(node_addr: str, store_addr: str, n: int, nproc: int, is_host: bool) -> list[str]:
    conf = ["--rdzv-conf", "is_host=1" if is_host else "is_host=0"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{n - 1}:{n}",
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{store_addr}:{RDZV_PORT}", "--rdzv-id", "bench-nodes", *conf, "--local-addr",
            node_addr, "--max-restarts", "3", "--monitor-interval", "0.1"]


def trainguard_cmd(node_addr: str, store_addr: str, n: int, nproc: int, node_rank: int,
                   lease_s: float, is_host: bool, log_dir: str) -> list[str]:
    conf = ["--rdzv-conf", "is_host=1"] if is_host else ["--rdzv-conf", "is_host=0"]
    return [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--nnodes",
            f"{n - 1}:{n}", "--nproc-per-node", str(nproc), "--rdzv-endpoint",
            f"{store_addr}:{RDZV_PORT}", "--rdzv-id", "bench-nodes", *conf, "--node-rank",
            str(node_rank), "--local-addr", node_addr, "--ft-lease-s", str(lease_s),
            "--max-restarts", "3", "--monitor-interval", "0.1", "--ft-workers-stop-timeout", "2",
            "--log-dir", log_dir]


class Run:
    """One job on ``n`` simulated nodes: namespace 0 is a service node (``trainguard store``
    when the store is standalone), 1..n the training nodes, n+1 a spare."""

    def __init__(self, kind: str, n: int, nproc: int, lease_s: float, standalone: bool) -> None:
        self.kind, self.n, self.nproc, self.lease_s = kind, n, nproc, lease_s
        self.standalone = standalone
        self.local = netns_unavailable() is not None
        self.cluster: SimNodes | LocalNodes = LocalNodes(n + 2) if self.local else SimNodes(n + 2)
        self._tmp = tempfile.TemporaryDirectory(prefix="tg_bench_nodes_")
        self.dir = Path(self._tmp.name)
        (self.dir / "work.py").write_text(NODE_WORKLOAD)
        self.agents: dict[int, subprocess.Popen] = {}
        self.store: subprocess.Popen | None = None
        self.shm_before = trainguard_shm_segments()

    def __enter__(self) -> Run:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        (self.dir / "stop").touch()
        self.cluster.close()
        self._tmp.cleanup()
        for name in trainguard_shm_segments() - self.shm_before:  # of launchers we killed
            m = _SHM_OWNER.match(name)
            if m and not psutil.pid_exists(int(m.group(1), 16)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))

    def store_addr(self) -> str:
        return self.cluster[0 if self.standalone else 1].addr

    def start_store(self) -> None:
        log = self.dir / "store.log"
        with open(log, "wb") as fh:
            self.store = self.cluster[0].popen([sys.executable, "-m", "trainguard", "store",
                                                "--port", str(RDZV_PORT)], log=fh)
        if not _wait_for(lambda: b"listening" in log.read_bytes(), 60):
            raise RuntimeError(f"trainguard store did not start: {log.read_text()[-500:]}")

    def start(self, i: int) -> None:
        node = self.cluster[i]
        host = not self.standalone and i == 1
        if self.kind == "torchrun":
            cmd = torchrun_cmd(node.addr, self.store_addr(), self.n, self.nproc, host)
        else:
            cmd = trainguard_cmd(node.addr, self.store_addr(), self.n, self.nproc, i - 1,
                                 self.lease_s, host, str(self.dir / f"logs{i}"))
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1",
                   TG_BENCH_NODE=str(i), GLOO_SOCKET_IFNAME="lo" if self.local else "eth0")
        with open(self.dir / f"agent_{i}.log", "wb") as log:
            self.agents[i] = node.popen([*cmd, str(self.dir / "work.py"), str(self.dir)],
                                        env=env, log=log)

    def start_all(self, timeout_s: float) -> bool:
        if self.standalone:
            self.start_store()
        for i in range(1, self.n + 1):
            self.start(i)
        world = self.n * self.nproc
        return _wait_for(lambda: len({s["rank"] for s in stamps(self.dir)
                                      if s["ev"] == "first_step"}) == world, timeout_s)

    def back_after(self, t: float, want: int, exclude_node: int = -1) -> list[float]:
        after = [s for s in stamps(self.dir)
                 if s["ev"] == "first_step" and s["t"] > t and s["node"] != exclude_node]
        return [s["t"] for s in after] if len({s["rank"] for s in after}) >= want else []

    def victim(self) -> int:
        """A training node that neither hosts the store nor runs global rank 0."""
        first = [s for s in stamps(self.dir) if s["ev"] == "first_step"]
        rank0 = next(s["node"] for s in first if s["rank"] == 0)
        return next(i for i in range(self.n, 1, -1) if i != rank0)

    def wait_exits(self, nodes: Sequence[int], t0: float, timeout_s: float) -> dict[int, tuple]:
        """Exit code and exit time (wall, polled every 20 ms) of the launchers on ``nodes``."""
        out: dict[int, tuple] = {}
        end = time.monotonic() + timeout_s
        while len(out) < len(nodes) and time.monotonic() < end:
            for i in nodes:
                rc = self.agents[i].poll()
                if i not in out and rc is not None:
                    out[i] = (rc, time.time() - t0)
            time.sleep(0.02)
        return out

    def tail(self) -> str:
        return _tail(self.dir)


def node_loss_once(kind: str, n: int, nproc: int, lease_s: float, timeout_s: float) -> dict:
    """Kill a whole node -> every survivor's first step of the next cycle."""
    with Run(kind, n, nproc, lease_s, standalone=False) as run:
        if not run.start_all(timeout_s / 2):
            return {"error": "not all ranks trained", "log": run.tail()}
        victim = run.victim()
        t_kill = kill_node(run.agents[victim])
        want = (n - 1) * nproc
        if not _wait_for(lambda: bool(run.back_after(t_kill, want, victim)), timeout_s, 0.1):
            return {"error": f"survivors not back within {timeout_s:.0f} s", "log": run.tail()}
        return {"value": round(max(run.back_after(t_kill, want, victim)) - t_kill, 3)}


def store_loss_once(n: int, nproc: int, lease_s: float, timeout_s: float) -> dict:
    """The standalone store's link goes down -> every launcher fenced and exited (75)."""
    with Run("trainguard", n, nproc, lease_s, standalone=True) as run:
        if run.local:
            return {"error": "needs network namespaces"}
        if not run.start_all(timeout_s / 2):
            return {"error": "not all ranks trained", "log": run.tail()}
        t0 = time.time()
        run.cluster.link_down(0)  # type: ignore[union-attr]
        nodes = list(range(1, n + 1))
        exits = run.wait_exits(nodes, t0, lease_s * 4 + 10)
        if len(exits) < n or {rc for rc, _ in exits.values()} != {EXIT_STORE_LOST}:
            return {"error": f"exits {exits} (want all {EXIT_STORE_LOST})", "log": run.tail()}
        return {"value": round(max(t for _, t in exits.values()), 3)}


def partition_once(n: int, nproc: int, lease_s: float, timeout_s: float) -> dict:
    """One node can no longer send to the store (blackhole) -> that node fenced and exited."""
    with Run("trainguard", n, nproc, lease_s, standalone=True) as run:
        if run.local:
            return {"error": "needs network namespaces"}
        if not run.start_all(timeout_s / 2):
            return {"error": "not all ranks trained", "log": run.tail()}
        victim = run.victim()
        t0 = time.time()
        run.cluster.partition(victim, 0)  # type: ignore[union-attr]
        exits = run.wait_exits([victim], t0, lease_s * 4 + 10)
        if exits.get(victim, (None,))[0] != EXIT_STORE_LOST:
            return {"error": f"partitioned node: {exits}", "log": run.tail()}
        return {"value": round(exits[victim][1], 3)}


def spare_once(n: int, nproc: int, lease_s: float, timeout_s: float) -> dict:
    """A node asks to be excluded -> every rank (the spare's included) at its first step."""
    with Run("trainguard", n, nproc, lease_s, standalone=True) as run:
        if not run.start_all(timeout_s / 2):
            return {"error": "not all ranks trained", "log": run.tail()}
        run.start(n + 1)  # parks as a hot spare: the round is full
        spare_log = run.dir / f"agent_{n + 1}.log"
        if not _wait_for(lambda: b"hot spare" in spare_log.read_bytes(), timeout_s / 2):
            return {"error": "the spare never parked", "log": run.tail()}
        victim = run.victim()
        (run.dir / f"exclude_{victim}").touch()
        if not _wait_for(lambda: any(s["ev"] == "exclude" for s in stamps(run.dir)), 30):
            return {"error": "exclusion not requested", "log": run.tail()}
        t_ex = next(s["t"] for s in stamps(run.dir) if s["ev"] == "exclude")
        want = n * nproc

        def spare_in() -> list[float]:
            got = run.back_after(t_ex, want, victim)
            nodes = {s["node"] for s in stamps(run.dir)
                     if s["ev"] == "first_step" and s["t"] > t_ex}
            return got if n + 1 in nodes else []

        if not _wait_for(lambda: bool(spare_in()), timeout_s, 0.1):
            return {"error": f"spare not training within {timeout_s:.0f} s", "log": run.tail()}
        return {"value": round(max(spare_in()) - t_ex, 3)}


def _tail(folder: Path, lines: int = 12) -> str:
    out = []
    for f in sorted(folder.glob("agent_*.log")):
        text = f.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {f.name}\n" + "\n".join(text))
    return "\n".join(out)[-3000:]


SCENARIOS = {
    "torchrun_node_loss_to_restart_s": lambda a: node_loss_once("torchrun", *a),
    "node_loss_to_restart_s": lambda a: node_loss_once("trainguard", *a),
    "store_loss_to_exit_s": lambda a: store_loss_once(*a),
    "partition_to_fence_s": lambda a: partition_once(*a),
    "spare_promotion_s": lambda a: spare_once(*a),
}


def run_scenario(key: str, n: int, nproc: int, lease_s: float, repeats: int,
                 timeout_s: float) -> dict:
    """``repeats`` runs of one scenario; min/median/max of the figure plus the failed runs."""
    vals: list[float] = []
    errors: list[str] = []
    for _ in range(repeats):
        res = SCENARIOS[key]((n, nproc, lease_s, timeout_s))
        if "value" in res:
            vals.append(res["value"])
        else:
            errors.append(f"{res['error']}: {res.get('log', '')[-1200:]}")
    return {"values": vals, "errors": errors, **summary(vals)}


def summary(vals: Sequence[float]) -> dict:
    if not vals:
        return {"min": None, "median": None, "max": None}
    return {"min": round(min(vals), 3), "median": round(statistics.median(vals), 3),
            "max": round(max(vals), 3)}
