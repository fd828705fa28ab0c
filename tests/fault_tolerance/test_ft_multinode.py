"""Multi-node launcher on one machine: several launchers on localhost, each a "node" with its own
``--node-rank``, gloo workers all-reducing across them. Short leases keep every test bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard._core.net import free_port
from trainguard.fault_tolerance._args import parse_launch_args
from trainguard.fault_tolerance.errors import LaunchConfigError

HERE = Path(__file__).parent
LEASE = "3"  # seconds; short, yet no false lapse when the machine is loaded
WORKER = str(HERE / "mn_worker.py")
FAST = ["--monitor-interval", "0.05",
        "--ft-workers-stop-timeout", "2", "--ft-rank-termination-grace", "0.5",
        "--ft-lease-s", LEASE, "--ft-lease-interval-s", "0.25", "--ft-attribution", "false"]


class Node:
    def __init__(self, proc: subprocess.Popen[str], out: Path, rank: int) -> None:
        self.proc, self.out, self.rank = proc, out, rank

    @property
    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


class Cluster:
    """Starts launchers (one per node rank) and always stops every one of them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.nodes: list[Node] = []
        self.extra: list[subprocess.Popen[str]] = []

    def launch(self, rank: int, *args: str, nnodes: str = "2", endpoint: str,
               conf: str = "", script_args: tuple[str, ...] = (), run_id: str = "mn") -> Node:
        out = self.tmp / f"node{rank}_{len(self.nodes)}.txt"
        cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--nnodes", nnodes,
               "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--node-rank", str(rank),
               "--log-dir", str(self.tmp / f"logs{rank}"), *FAST, *args]
        if conf:
            cmd += ["--rdzv-conf", conf]
        cmd += [WORKER, *script_args]
        with open(out, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                    cwd=self.tmp, stdin=subprocess.DEVNULL)
        node = Node(proc, out, rank)
        self.nodes.append(node)
        return node

    def store(self) -> tuple[subprocess.Popen[str], int]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "trainguard", "store", "--port", str(port),
                                 "--host", "127.0.0.1"], stdout=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        self.extra.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        return proc, port

    def wait_for(self, node: Node, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, node.text)
            if m:
                return m
            if node.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not seen from node {node.rank}:\n{node.text[-4000:]}")

    def close(self) -> None:
        for p in [n.proc for n in self.nodes] + self.extra:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [n.proc for n in self.nodes] + self.extra:
            try:
                p.wait(45)  # a launcher still preloading torch finishes that first
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def _results(text: str) -> list[dict[str, int]]:
    return [{k: int(float(v)) for k, v in re.findall(r"(\w+)=([\d.]+)", line)}
            for line in text.splitlines() if "result rank=" in line]


def _finish(nodes: list[Node], timeout: float = 120.0) -> list[int]:
    return [n.wait(timeout) for n in nodes]


def test_round_forms_and_a_worker_failure_restarts_every_node(cluster):
    """2 nodes x 2 ranks: right RANK/WORLD_SIZE; a failure on node 1 restarts both nodes."""
    ep = f"127.0.0.1:{free_port()}"
    nodes = [cluster.launch(r, "--nproc-per-node", "2", "--max-restarts", "2", endpoint=ep,
                            conf="is_host=1" if r == 0 else "is_host=0",
                            script_args=("--fail-node", "1")) for r in (0, 1)]
    codes = _finish(nodes)
    assert codes == [0, 0], "\n".join(n.text[-3000:] for n in nodes)
    results = [r for n in nodes for r in _results(n.text)]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == 6 and r["cycle"] == 1 for r in results)
    for n in nodes:
        assert "rank-0 host 127.0.0.1:" in n.text
        assert re.search(r"start rank=\d world=4 group=\d cycle=0", n.text)
    assert "injected failure on node 1" in nodes[0].text + nodes[1].text


def test_sigkilled_launcher_is_replaced_by_a_parked_spare(cluster):
    """File store (no store host): 2 members + 1 spare; SIGKILL a member's launcher: the
    survivor sees its lease lapse, the spare is promoted, the job completes; the spare never
    interrupted round 0."""
    ep = str(cluster.tmp / "rdzv.store")
    args = ("--steps", "20", "--steps0", "3000")
    nodes = [cluster.launch(r, "--max-restarts", "2", endpoint=ep, conf="store_type=file",
                            script_args=args) for r in (0, 1)]
    for n in nodes:
        cluster.wait_for(n, r"start rank=\d world=2 group=\d cycle=0")
    spare = cluster.launch(2, "--max-restarts", "2", endpoint=ep, conf="store_type=file",
                           script_args=args)
    cluster.wait_for(spare, "parks as a hot spare")
    time.sleep(1.0)
    victim, survivor = nodes[1], nodes[0]
    victim.proc.kill()
    cluster.wait_for(survivor, r"round 1: node node0 is group rank 0 of 2 \(node0, node2\)", 60)
    assert survivor.wait(60) == 0, survivor.text[-4000:]
    assert spare.wait(30) == 0, spare.text[-4000:]
    res = _results(survivor.text) + _results(spare.text)
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert all(r["world"] == 2 and r["cycle"] == 1 for r in res)
    assert "cycle=0" not in spare.text  # parked through round 0


def test_elastic_min_nodes_survivor_continues_alone_on_file_store(cluster):
    """--nnodes 1:2 on a file store: one node's launcher dies, the other re-forms alone."""
    ep = str(cluster.tmp / "rdzv.store")
    nodes = [cluster.launch(r, "--max-restarts", "1", nnodes="1:2", endpoint=ep,
                            conf="store_type=file,last_call_timeout=90",
                            script_args=("--steps", "10", "--steps0", "3000"))
             for r in (0, 1)]
    for n in nodes:
        cluster.wait_for(n, r"start rank=\d world=2")
    nodes[0].proc.kill()
    assert nodes[1].wait(60) == 0, nodes[1].text[-4000:]
    res = _results(nodes[1].text)
    assert res == [{"rank": 0, "world": 1, "group": 0, "cycle": 1, "sum": 0}]


def test_tcp_store_lost_every_node_exits_store_lost_within_lease(cluster):
    """The standalone store dies: every launcher stops its workers (self-fence) and exits 75
    within lease + 2 s; nothing keeps training alone."""
    store, port = cluster.store()
    nodes = [cluster.launch(r, endpoint=f"127.0.0.1:{port}", script_args=("--steps", "3000"))
             for r in (0, 1)]
    for n in nodes:
        cluster.wait_for(n, r"start rank=\d world=2")
    store.kill()
    killed, t0 = time.time(), time.monotonic()
    codes = _finish(nodes, 30)
    assert codes == [75, 75], "\n".join(n.text[-3000:] for n in nodes)
    assert time.monotonic() - t0 < 20  # bounded, never hung
    for n in nodes:
        assert "store lost" in n.text
        events = [json.loads(line) for line in
                  (cluster.tmp / f"logs{n.rank}" / "mn" / "launcher_events.jsonl").open()]
        fenced = next(e["wall"] for e in events if e["event"] == "fenced")
        assert fenced - killed < float(LEASE) + 2.0, fenced - killed  # stopped within lease+2


def test_duplicate_identity_is_refused_and_a_dead_ones_replacement_accepted(cluster):
    _, port = cluster.store()
    ep = f"127.0.0.1:{port}"
    first = cluster.launch(0, nnodes="3", endpoint=ep, conf="join_timeout=60")
    peer = cluster.launch(1, nnodes="3", endpoint=ep, conf="join_timeout=60")
    cluster.wait_for(first, "joined rendezvous generation")
    second = cluster.launch(0, nnodes="3", endpoint=ep, conf="join_timeout=60")
    assert second.wait(60) == 2
    assert "already owned by a live launcher" in second.text
    assert first.proc.poll() is None
    first.proc.kill()  # a restarted pod / requeued task comes back under the same identity
    first.proc.wait(10)
    cluster.wait_for(peer, "joined rendezvous generation 0")
    third = cluster.launch(0, nnodes="3", endpoint=ep, conf="join_timeout=60")
    cluster.wait_for(third, "the previous launcher .* is gone; this launcher replaces it")
    cluster.wait_for(third, "joined rendezvous generation 0")


def test_mismatched_nnodes_and_too_few_nodes(cluster):
    ep = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    first = cluster.launch(0, endpoint=ep, conf="is_host=1,join_timeout=12")
    cluster.wait_for(first, "joined rendezvous generation")
    other = cluster.launch(1, nnodes="3", endpoint=ep, conf="is_host=0")
    assert other.wait(60) == 2
    assert "give every launcher the same --nnodes" in other.text
    assert first.wait(60) == 1
    assert time.monotonic() - t0 < 90  # join timeout + start-ups on a loaded machine
    assert "only 1 of at least 2 node(s) joined round 0" in first.text


def test_excluded_node_leaves_and_a_spare_takes_its_place(cluster):
    _, port = cluster.store()
    ep = f"127.0.0.1:{port}"
    args = ("--steps", "12", "--fail-node", "1", "--exclude")
    nodes = [cluster.launch(r, "--max-restarts", "2", endpoint=ep, script_args=args)
             for r in (0, 1)]
    for n in nodes:
        cluster.wait_for(n, r"start rank=\d world=2 group=\d cycle=0")
    spare = cluster.launch(2, "--max-restarts", "2", endpoint=ep, script_args=args)
    codes = _finish(nodes + [spare])
    by_group = {}
    for n in nodes:
        m = re.search(r"group=(\d) cycle=0", n.text)
        assert m
        by_group[int(m.group(1))] = n
    excluded, kept = by_group[1], by_group[0]
    assert excluded.proc.returncode == 1 and "leaves the job" in excluded.text
    assert kept.proc.returncode == 0 and spare.proc.returncode == 0, codes
    assert {r["cycle"] for r in _results(kept.text) + _results(spare.text)} == {1}


def test_stale_file_store_of_an_earlier_job_gets_a_new_generation(cluster):
    ep = str(cluster.tmp / "reused.store")
    runs = []
    for _ in range(2):
        n = cluster.launch(0, "--rdzv-backend", "trainguard", nnodes="1", endpoint=ep,
                           conf="store_type=file", script_args=("--steps", "2"))
        assert n.wait(60) == 0, n.text[-3000:]
        runs.append(n)
    assert "generation 0" in runs[0].text
    assert "is stale (its job is done): using generation 1" in runs[1].text


@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "h:1"], "MIN <= MAX"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--ft-lease-s", "1",
      "--ft-lease-interval-s", "2"], "must be > 0 and below"),
    (["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1"], "trainguard/c10d"),
])
def test_bad_multinode_flags(args, needle):
    with pytest.raises(LaunchConfigError, match=needle):
        parse_launch_args([*args, WORKER])


@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "2", "--rdzv-endpoint", "/proc/nope/x.store", "--rdzv-conf",
      "store_type=file"], "file store is not writable"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:PORT", "--rdzv-conf",
      "is_host=0,connect_timeout=2"], "unreachable"),
    (["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:5"], "cannot resolve"),
])
def test_bad_multinode_input_is_one_line_and_bounded(tmp_path, args, needle):
    args = [a.replace("PORT", str(free_port())) for a in args]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainguard.fault_tolerance.launcher", *args,
                           WORKER], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                          check=False,
                          env={**os.environ, "TORCH_CPP_LOG_LEVEL": "FATAL"})
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("trainguard launch: error")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 20


def test_node_failure_budget_counts_each_launcher_once_and_ends_the_job():
    """Survivors that each see the same lapsed lease count it once; one failure past
    --ft-max-node-failures sets the job's done key to the do-not-requeue code."""
    import torch.distributed as dist

    from trainguard.fault_tolerance._rdzv import NodeFailureBudget, _Keys

    store, keys = dist.HashStore(), _Keys("budget", 0)
    budget = NodeFailureBudget(1, 93)
    assert budget.record(store, keys, "node1-tok", "node node1 lease lapsed") is False
    assert budget.record(store, keys, "node1-tok", "node node1 lease lapsed") is False  # again
    assert int(store.add(keys("nodefail/count"), 0)) == 1 and not store.check([keys("done")])
    assert budget.record(store, keys, "node2-tok", "node node2 excluded") is True
    done = store.get(keys("done")).decode()
    assert done.startswith("fail:93:2 node failure(s), more than --ft-max-node-failures 1"), done
    unlimited, other = NodeFailureBudget(None, 93), _Keys("budget", 1)
    assert not any(unlimited.record(store, other, f"t{i}", "x") for i in range(5))


def test_node_failure_is_not_lost_to_a_store_error():
    """A store call that fails while this node counts its own failure (an exclusion, a failed
    health check) is logged, and the node still leaves: node_failed answers "not exhausted"."""
    from trainguard._core.store import StoreCallTimeout
    from trainguard.fault_tolerance._rdzv import NodeFailureBudget, Rendezvous, _Keys

    def fenced(fn):
        raise StoreCallTimeout("this node is fenced (lease lost): no more store calls")

    rdzv = Rendezvous.__new__(Rendezvous)
    rdzv.call, rdzv.keys, rdzv.token = fenced, _Keys("budget", 2), "node1-tok"
    rdzv.budget = NodeFailureBudget(0, 93)
    assert rdzv.node_failed("node node1 excluded") is False


def test_exclusion_past_the_node_failure_budget_ends_every_launcher(cluster):
    """--ft-max-node-failures 0: a node asking for its exclusion is one failure too many; every
    launcher exits with the do-not-requeue code instead of waiting for a replacement."""
    ep = str(cluster.tmp / "rdzv.store")
    args = ("--steps", "12", "--fail-node", "1", "--exclude")
    nodes = [cluster.launch(r, "--max-restarts", "2", "--ft-max-node-failures", "0",
                            endpoint=ep, conf="store_type=file", script_args=args)
             for r in (0, 1)]
    codes = _finish(nodes, 90)
    assert codes == [93, 93], "\n".join(n.text[-3000:] for n in nodes)
    text = nodes[0].text + nodes[1].text
    assert "more than --ft-max-node-failures 0" in text


def test_lease_keeper_wakes_when_a_members_lease_is_due():
    """The next tick comes when a watched member would lapse, not a whole renewal interval
    later; members already lapsed (handled) or gone never make it spin."""
    import torch.distributed as dist

    from trainguard.fault_tolerance._rdzv import LeaseKeeper, _Keys

    store = dist.HashStore()
    r, w = os.pipe()
    try:
        keeper = LeaseKeeper(lambda: store, _Keys("wake", 0), "me", lease_s=2.0, interval_s=0.5,
                             max_restarts=1, wake_fd=w)
        t0 = now = time.monotonic()
        assert keeper._next_wait(t0) == pytest.approx(0.5, abs=0.05)  # nothing watched
        keeper.watch_round(0, {"a": "node0", "b": "node1", "c": "node2"})
        keeper.seen = {"a": ("7", now - 1.8), "b": ("3", now - 5.0), "c": ("left", now - 1.9)}
        wait = keeper._next_wait(t0)
        print(f"next tick in {wait:.3f} s (member a due in ~0.2 s)")
        assert 0.1 < wait < 0.3
        keeper.seen = {"b": ("3", now - 5.0)}  # lapsed already: back to the interval
        assert keeper._next_wait(t0) == pytest.approx(0.5, abs=0.05)
        keeper.ds.close()
    finally:
        os.close(r)
        os.close(w)
