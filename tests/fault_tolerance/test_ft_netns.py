"""Multi-node faults on simulated nodes: 3 nodes x 2 ranks (+1 spare), DDP over gloo.

Namespace ``n0`` plays a service node running ``trainguard store``; ``n1``..``n4`` are training
nodes, each with one ``trainguard launch --nnodes 2:3`` (node ranks 0..3; the fourth launcher,
started once the others train, parks as a hot spare). Every fault is real: processes SIGKILLed,
switch ports down, blackhole routes, ``tc tbf`` rate limits. A job that continues must finish
with the weights a single process computes (:func:`netns_worker.reference_checksum`); a node
cut off from the store must fence itself (stop its workers, exit 75) within lease + 2 s.

Skipped without root or ``ip`` (the localhost multi-launcher tests of the launcher still run).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.testing import NetnsError, SimNodes, netns_unavailable

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from netns_worker import STEPS, reference_checksum

pytestmark = pytest.mark.skipif(netns_unavailable() is not None,
                                reason=f"simulated nodes: {netns_unavailable()}")

LEASE_S = 2.0
NPROC = 2
EXIT_STORE_LOST = 75
SLACK_S = 3.0  # scheduling slack on a loaded 2-core CI machine, added to every bound
FAST = ["--monitor-interval", "0.05", "--ft-workload-check-interval", "0.05",
        "--ft-workers-stop-timeout", "2", "--ft-rank-termination-grace", "0.5",
        "--ft-attribution", "false"]
_PORTS = iter(range(29610, 29700))


@pytest.fixture(scope="module")
def cluster():
    with SimNodes(5) as nodes:
        yield nodes


class Job:
    """One multi-node job on the shared cluster: a store on n0 and launchers on n1..n4."""

    def __init__(self, cluster: SimNodes, folder: Path, nnodes: str = "2:3",
                 lease_s: float = LEASE_S) -> None:
        self.c, self.dir, self.nnodes, self.lease_s = cluster, folder, nnodes, lease_s
        self.port = next(_PORTS)
        self.store: subprocess.Popen | None = None
        self.launchers: dict[int, subprocess.Popen] = {}  # node index (1..4) -> launcher

    def start_store(self) -> None:
        log = self.dir / "store.log"
        with open(log, "wb") as fh:
            self.store = self.c[0].popen([sys.executable, "-m", "trainguard", "store", "--port",
                                          str(self.port)], log=fh)
        _wait(lambda: b"listening" in log.read_bytes(), 60, f"store up: {log.read_text()}")

    def start(self, i: int, node_rank: int | None = None, tag: str = "",
              extra: tuple[str, ...] = ()) -> subprocess.Popen:
        rank = i - 1 if node_rank is None else node_rank
        cmd = [sys.executable, "-m", "trainguard.fault_tolerance.launcher", "--nnodes",
               self.nnodes, "--nproc-per-node", str(NPROC), "--rdzv-endpoint",
               f"{self.c[0].addr}:{self.port}", "--rdzv-id", "netns", "--node-rank", str(rank),
               "--local-addr", self.c[i].addr, "--ft-lease-s", str(self.lease_s), "--max-restarts",
               "3", "--log-dir", str(self.dir / f"logs{i}{tag}"), *FAST, *extra,
               str(HERE / "netns_worker.py"), str(self.dir)]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        with open(self.dir / f"launcher{i}{tag}.log", "wb") as fh:
            proc = self.c[i].popen(cmd, env=env, log=fh)
        if not tag:
            self.launchers[i] = proc
        return proc

    def start_all(self, spare: bool = True) -> None:
        self.start_store()
        for i in (1, 2, 3):
            self.start(i)
        self.wait_training(cycle=0)
        if spare:
            self.start(4)
            log = self.dir / "launcher4.log"
            _wait(lambda: b"hot spare" in log.read_bytes(), 60, f"spare parked\n{self.logs()}")

    def wait_training(self, cycle: int, world: int = 3 * NPROC, timeout_s: float = 90) -> None:
        def stepping() -> bool:
            return all(_step(self.dir, cycle, r) >= 2 for r in range(world))

        _wait(stepping, timeout_s, f"all {world} ranks training in cycle {cycle}\n{self.logs()}")

    def release(self) -> None:
        (self.dir / "release").touch()

    def wait_exit(self, procs: dict[int, subprocess.Popen], timeout_s: float) -> dict[int, int]:
        end = time.monotonic() + timeout_s
        codes = {}
        for i, p in procs.items():
            try:
                codes[i] = p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"launcher on n{i} still running after {timeout_s} s\n{self.logs()}")
        return codes

    def results(self) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted(self.dir.glob("result_*.json"))]

    def final_results(self) -> list[dict]:
        """Results of the last cycle that wrote any: one per rank of that cycle's world."""
        res = self.results()
        last = max(r["cycle"] for r in res)
        return [r for r in res if r["cycle"] == last]

    def assert_right_result(self, world: int = 3 * NPROC, max_cycle: int | None = None) -> None:
        final = self.final_results()
        want = reference_checksum(STEPS)
        assert sorted(r["rank"] for r in final) == list(range(world)), (final, self.logs())
        assert all(r["world"] == world for r in final), final
        for r in final:
            assert abs(r["checksum"] - want) < 1e-4, (r, want)
        if max_cycle is not None:
            assert final[0]["cycle"] <= max_cycle, (final[0]["cycle"], self.logs())

    def logs(self, lines: int = 15) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)[-8000:]

    def close(self) -> None:
        from trainguard._core.procs import terminate_processes

        procs = [p for node in self.c.nodes for p in node.procs if p.poll() is None]
        terminate_processes(procs, grace_s=2.0, groups=True)
        for node in self.c.nodes:
            node.procs.clear()


@pytest.fixture
def job(cluster, tmp_path):
    j = Job(cluster, tmp_path)
    try:
        yield j
    finally:
        j.close()
        for i in range(len(cluster)):  # undo any fault left by a failed test
            cluster.link_up(i)
            cluster.unslow(i)
            for k in range(len(cluster)):
                if k != i:
                    _heal(cluster, i, k)


def _heal(cluster: SimNodes, src: int, dst: int) -> None:
    with contextlib.suppress(NetnsError):  # no such route: nothing to undo
        cluster.heal(src, dst)


def _step(folder: Path, cycle: int, rank: int) -> int:
    try:
        return int((folder / f"progress_{cycle}_{rank}").read_text() or -1)
    except (OSError, ValueError):
        return -1


def _wait(pred, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def _kill_node(proc: subprocess.Popen) -> None:
    """A machine dies: SIGKILL its launcher's process group and every descendant at once."""
    import psutil

    pids = [proc.pid]
    try:
        pids += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)
    # a dead machine's /dev/shm dies with it; here it is shared, and the launcher's own orphan
    # sweeper (which removes the slots after a launcher SIGKILL) was killed with the machine
    from trainguard._core.shm import sweep_prefix

    sweep_prefix(f"tg_ft{proc.pid:x}_")


def _fence_bound() -> float:
    return LEASE_S + 2.0 + SLACK_S


# --------------------------------------------------------------------------- store faults
def test_store_process_killed_fences_every_node(job):
    job.start_all(spare=False)
    t = time.monotonic()
    job.store.kill()  # type: ignore[union-attr]
    codes = job.wait_exit(job.launchers, _fence_bound())
    took = time.monotonic() - t
    print(f"store killed -> all launchers exited in {took:.2f} s (lease {LEASE_S} s)")
    assert set(codes.values()) == {EXIT_STORE_LOST}, (codes, job.logs())


def test_store_host_link_down_fences_every_node_without_hanging(job, cluster):
    job.start_all(spare=False)
    t = time.monotonic()
    cluster.link_down(0)
    codes = job.wait_exit(job.launchers, _fence_bound())
    print(f"store link down -> all launchers exited in {time.monotonic() - t:.2f} s")
    assert set(codes.values()) == {EXIT_STORE_LOST}, (codes, job.logs())


# --------------------------------------------------------------------------- node faults
def test_non_store_node_link_down_fences_it_and_the_rest_finish(job, cluster):
    job.start_all(spare=True)
    t = time.monotonic()
    cluster.link_down(3)
    codes = job.wait_exit({3: job.launchers[3]}, _fence_bound())
    print(f"node link down -> it fenced in {time.monotonic() - t:.2f} s")
    assert codes[3] == EXIT_STORE_LOST, job.logs()
    job.wait_training(cycle=1)  # the spare took the lost node's place: 3 nodes again
    job.release()
    rest = job.wait_exit({i: job.launchers[i] for i in (1, 2, 4)}, 60)
    assert set(rest.values()) == {0}, (rest, job.logs())
    job.assert_right_result()


def test_one_way_partition_has_no_split_brain(job, cluster):
    job.start_all(spare=False)
    cluster.partition(2, 0)  # node rank 1 can no longer send to the store
    t = time.monotonic()
    codes = job.wait_exit({2: job.launchers[2]}, _fence_bound())
    print(f"partitioned node fenced in {time.monotonic() - t:.2f} s")
    assert codes[2] == EXIT_STORE_LOST, job.logs()
    job.wait_training(cycle=1, world=2 * NPROC)
    job.release()
    rest = job.wait_exit({1: job.launchers[1], 3: job.launchers[3]}, 60)
    assert set(rest.values()) == {0}, (rest, job.logs())
    job.assert_right_result(world=2 * NPROC)
    groups = {r["group"] for r in job.final_results()}
    assert len(groups) == 2, "the cut-off node finished no cycle of its own"


def test_flapping_link_restarts_at_most_once(job, cluster):
    job.lease_s = 5.0  # the link is down for less than a lease: the node must not fence
    job.start_all(spare=False)
    cluster.flap(3, 2.0)
    job.release()
    codes = job.wait_exit(job.launchers, 60)
    assert set(codes.values()) == {0}, (codes, job.logs())
    job.assert_right_result(max_cycle=1)


def test_slow_link_is_not_a_failure(job, cluster):
    job.start_all(spare=False)
    cluster.slow(2, rate_kbit=2000)
    time.sleep(LEASE_S * 2)  # longer than a lease: a false lapse would show up here
    job.release()
    codes = job.wait_exit(job.launchers, 60)
    assert set(codes.values()) == {0}, (codes, job.logs())
    job.assert_right_result(max_cycle=0)


def test_launcher_sigkilled_and_replaced_under_the_same_node_rank(job):
    job.nnodes = "3:3"  # the survivors wait for a third node: the replacement
    job.start_all(spare=False)
    job.launchers[2].kill()  # the launcher only: its workers are orphaned, not killed by us
    job.launchers[2].wait(timeout=10)
    again = job.start(2, tag="b")  # same node, same --node-rank 1
    job.wait_training(cycle=1)
    job.release()
    codes = job.wait_exit({1: job.launchers[1], 2: again, 3: job.launchers[3]}, 60)
    assert set(codes.values()) == {0}, (codes, job.logs())
    job.assert_right_result()
    left = subprocess.run(["ip", "netns", "pids", job.c[2].netns], capture_output=True,
                          text=True, check=False).stdout.split()
    assert not left, f"the killed launcher's workers outlived the job: {left}"


def test_rank0_node_lost_a_new_rank0_is_chosen(job):
    job.start_all(spare=True)
    _kill_node(job.launchers[1])  # node rank 0: group rank 0, publishes MASTER_ADDR
    job.wait_training(cycle=1)
    job.release()
    codes = job.wait_exit({i: job.launchers[i] for i in (2, 3, 4)}, 60)
    assert set(codes.values()) == {0}, (codes, job.logs())
    job.assert_right_result()
    rank0 = {r["node"] for r in job.final_results() if r["group"] == 0}
    assert rank0 and "node0" not in rank0, rank0  # a surviving node took group rank 0


def test_excluded_node_is_replaced_by_the_spare(job):
    job.start_all(spare=True)
    _exclude_request(job.dir, group=1)
    codes = job.wait_exit({2: job.launchers[2]}, 60)
    assert codes[2] != 0, "the excluded node leaves with a failure code"
    job.wait_training(cycle=1)
    job.release()
    rest = job.wait_exit({i: job.launchers[i] for i in (1, 3, 4)}, 60)
    assert set(rest.values()) == {0}, (rest, job.logs())
    job.assert_right_result()


def _exclude_request(folder: Path, group: int) -> None:
    (folder / f"exclude_{group}").touch()


def test_two_launchers_with_one_identity_second_is_refused(job):
    job.start_all(spare=False)
    dup = job.start(4, node_rank=1, tag="dup")
    try:
        rc = dup.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"duplicate launcher neither refused nor exited\n{job.logs()}")
    assert rc == 2, job.logs()
    assert "node1" in (job.dir / "launcher4dup.log").read_text()
    job.release()
    codes = job.wait_exit(job.launchers, 60)
    assert set(codes.values()) == {0}, (codes, job.logs())
    job.assert_right_result(max_cycle=0)
