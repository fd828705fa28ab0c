"""Multi-node part of ``bench/ft_launcher.py`` (``--nodes N``): node loss on simulated nodes.

Each simulated node (:class:`trainguard.testing.SimNodes`: a network namespace with its own
address on a bridge; :class:`~trainguard.testing.LocalNodes` on 127.0.0.1 where namespaces are
unavailable) runs one launcher with ``--nproc-per-node`` ranks of a small DDP model over gloo.
Once every rank trains, one node is lost: its launcher and its workers are SIGKILLed together (a
machine that dies). The figure is the time from the kill to the moment every surviving rank has
completed its first step in the next generation, read from the ranks' own wall-clock stamps.

* ``torchrun_node_loss_to_restart_s``: ``torchrun --rdzv-backend c10d --nnodes N-1:N`` (the
  rendezvous store hosted on node 0 with ``--rdzv-conf is_host=1``; defaults otherwise, so its
  keep-alive and last-call timeouts apply). The node lost is neither the store host nor the
  node of global rank 0, so the survivors can continue.
"""

from __future__ import annotations

import contextlib
import json
import os
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

from trainguard.testing import LocalNodes, SimNodes, netns_unavailable

RDZV_PORT = 29411
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
while not os.path.exists(stop) and step < 20000:
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


def node_loss_once(n: int, nproc: int, timeout_s: float) -> dict:
    """One torchrun run across ``n`` nodes with one node lost; returns the figure or an error."""
    reason = netns_unavailable()
    cluster: SimNodes | LocalNodes = LocalNodes(n) if reason else SimNodes(n)
    with tempfile.TemporaryDirectory(prefix="tg_bench_nodes_") as tmp, cluster:
        folder = Path(tmp)
        (folder / "work.py").write_text(NODE_WORKLOAD)
        agents = []
        for node in cluster.nodes:
            env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1",
                       TG_BENCH_NODE=str(node.index), GLOO_SOCKET_IFNAME="lo" if reason else "eth0")
            cmd = torchrun_cmd(node.addr, cluster[0].addr, n, nproc, node.index == 0)
            log = open(folder / f"agent_{node.index}.log", "wb")  # noqa: SIM115
            agents.append(node.popen([*cmd, str(folder / "work.py"), str(folder)], env=env,
                                     log=log))
            log.close()
        world = n * nproc
        ready = _wait_for(lambda: len({s["rank"] for s in stamps(folder)
                                       if s["ev"] == "first_step"}) == world, timeout_s / 2)
        if not ready:
            return {"error": "not all ranks trained", "log": _tail(folder)}
        first = [s for s in stamps(folder) if s["ev"] == "first_step"]
        rank0_node = next(s["node"] for s in first if s["rank"] == 0)
        victim = next(i for i in range(n - 1, 0, -1) if i != rank0_node)
        t_kill = kill_node(agents[victim])
        want = (n - 1) * nproc

        def back() -> list[float]:
            after = [s for s in stamps(folder)
                     if s["ev"] == "first_step" and s["t"] > t_kill and s["node"] != victim]
            return [s["t"] for s in after] if len({s["rank"] for s in after}) >= want else []

        if not _wait_for(lambda: bool(back()), timeout_s, 0.2):
            (folder / "stop").touch()
            return {"error": f"survivors not back within {timeout_s:.0f} s",
                    "log": _tail(folder)}
        (folder / "stop").touch()
        return {"restart_s": round(max(back()) - t_kill, 3), "victim": victim,
                "netns": reason is None}


def _tail(folder: Path, lines: int = 12) -> str:
    out = []
    for f in sorted(folder.glob("agent_*.log")):
        text = f.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {f.name}\n" + "\n".join(text))
    return "\n".join(out)[-3000:]


def run_node_loss(n: int, nproc: int, repeats: int, timeout_s: float) -> dict:
    """``repeats`` node-loss runs of torchrun; min/median/max of the figure plus failures."""
    vals: list[float] = []
    errors: list[str] = []
    for _ in range(repeats):
        res = node_loss_once(n, nproc, timeout_s)
        if "restart_s" in res:
            vals.append(res["restart_s"])
        else:
            errors.append(f"{res['error']}: {res.get('log', '')[-1200:]}")
    return {"values": vals, "errors": errors, **summary(vals)}


def summary(vals: Sequence[float]) -> dict:
    if not vals:
        return {"min": None, "median": None, "max": None}
    return {"min": round(min(vals), 3), "median": round(statistics.median(vals), 3),
            "max": round(max(vals), 3)}
