"""The simulated-node harness itself: real namespaces, real packets, real cleanup.

Namespace tests are skipped where network namespaces are unavailable (not root, no ``ip``); the
localhost fallback (:class:`LocalNodes`, the ``sim_nodes`` fixture) is tested everywhere.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trainguard.testing import (
    LocalNodes,
    SimNodes,
    free_port,
    harness_netns,
    netns_unavailable,
    sweep_leftovers,
)
from trainguard.testing.netns import ConfigError, list_netns

needs_netns = pytest.mark.skipif(netns_unavailable() is not None,
                                 reason=f"simulated nodes: {netns_unavailable()}")

PORT = 7077
# A TCP server that answers each connection with what it read (until EOF), uppercased.
SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print("ready", flush=True)
    while True:
        c, _ = s.accept(); data = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
        c.sendall(data.upper()[:16]); c.close()
""")
# Connect, send argv[2] bytes, read the answer: prints the answer or the error name, and the
# seconds taken.
CLIENT = textwrap.dedent("""
    import socket, sys, time
    t = time.monotonic()
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[4])), timeout=float(sys.argv[3]))
        c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
        print(c.recv(16).decode(), round(time.monotonic() - t, 3))
    except OSError as e:
        print(type(e).__name__, round(time.monotonic() - t, 3))
""")


def _serve(cluster: SimNodes | LocalNodes, i: int, port: int = PORT) -> subprocess.Popen:
    proc = cluster[i].popen([sys.executable, "-u", "-c", SERVER, cluster[i].addr, str(port)],
                            log=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def _talk(cluster: SimNodes | LocalNodes, src: int, dst: int, size: int = 4,
          timeout_s: float = 1.5, port: int = PORT) -> str:
    res = cluster[src].run([sys.executable, "-c", CLIENT, cluster[dst].addr, str(size),
                            str(timeout_s), str(port)], timeout_s=30)
    return res.stdout.strip() or res.stderr.strip()


@pytest.fixture(scope="module")
def trio():
    with SimNodes(3) as cluster:
        _serve(cluster, 1)
        _serve(cluster, 2)
        yield cluster


@needs_netns
def test_nodes_have_their_own_addresses_and_reach_each_other(trio):
    assert [n.addr for n in trio.nodes] == ["10.231.0.1", "10.231.0.2", "10.231.0.3"]
    assert len({n.netns for n in trio.nodes}) == 3
    assert all(n.netns.startswith(f"tg{trio.run_id}-n") for n in trio.nodes)
    got = trio[0].run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert "10.231.0.1/24" in got, got
    assert _talk(trio, 0, 1).startswith("XXXX"), "node 0 -> node 1 over the bridge"
    assert _talk(trio, 2, 1).startswith("XXXX")


@needs_netns
def test_node_cannot_reach_the_host_network(trio):
    routes = trio[0].run(["ip", "route"]).stdout
    assert "default" not in routes, routes  # only the cluster's /24: nothing leaves it


@needs_netns
def test_link_down_blocks_traffic_and_link_up_restores_it(trio):
    trio.link_down(1)
    try:
        out = _talk(trio, 0, 1, timeout_s=1.0)
        assert not out.startswith("XXXX"), out
        assert _talk(trio, 0, 2).startswith("XXXX"), "other nodes unaffected"
    finally:
        trio.link_up(1)
    assert _wait_talk(trio, 0, 1), "link up again"


def _wait_talk(cluster: SimNodes, src: int, dst: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _talk(cluster, src, dst).startswith("XXXX"):
            return True
    return False


@needs_netns
def test_flap_in_background_brings_the_link_back(trio):
    thread = trio.flap(2, 1.0, wait=False)
    assert thread is not None and thread.name.startswith("tg-netns-flap-")
    assert not _talk(trio, 0, 2, timeout_s=0.3).startswith("XXXX")
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert _wait_talk(trio, 0, 2)


@needs_netns
def test_blackhole_partition_is_one_way(trio):
    udp = textwrap.dedent("""
        import socket, sys
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.sendto(b"hi", (sys.argv[1], 9)); print("sent")
        except OSError as e:
            print(type(e).__name__, e.errno)
    """)
    trio.partition(0, 1)
    try:
        assert not _talk(trio, 0, 1).startswith("XXXX")
        forward = trio[0].run([sys.executable, "-c", udp, trio[1].addr]).stdout.strip()
        backward = trio[1].run([sys.executable, "-c", udp, trio[0].addr]).stdout.strip()
        assert forward.startswith("OSError 22"), forward  # EINVAL: the blackhole route
        assert backward == "sent", backward  # the other direction still leaves its node
        assert _talk(trio, 0, 2).startswith("XXXX"), "only the pair is cut"
    finally:
        trio.heal(0, 1)
    assert _talk(trio, 0, 1).startswith("XXXX")


@needs_netns
def test_slow_link_rate_limits_and_unslow_removes_it(trio):
    trio.slow(2, rate_kbit=256)
    try:
        shown = trio[2].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in shown and "256Kbit" in shown, shown
        out = _talk(trio, 0, 2, size=96 * 1024, timeout_s=20).split()
        # 768 kbit through a 256 kbit/s bucket of 32 kbit: at least ~2.9 s; assert a safe 1.5 s
        assert out[0].startswith("XXXX") and float(out[1]) >= 1.5, out
    finally:
        trio.unslow(2)
    assert "tbf" not in trio[2].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigError, match="between 1 and 250"):
        SimNodes(0)
    with pytest.raises(ConfigError, match="three octets"):
        SimNodes(2, subnet="10.1")


@needs_netns
def test_close_removes_namespaces_links_and_processes():
    links_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                                 check=False).stdout
    cluster = SimNodes(2)
    names = cluster.namespaces()
    assert set(names) <= set(list_netns())
    sleeper = cluster[0].popen(["sleep", "300"])
    cluster.close()
    cluster.close()  # idempotent
    assert sleeper.poll() == -signal.SIGTERM
    assert not set(names) & set(list_netns())
    links_after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                                 check=False).stdout
    assert len(links_after.splitlines()) == len(links_before.splitlines()), "no veth/bridge left"


@needs_netns
def test_sweeper_removes_a_crashed_runs_namespaces_only():
    crash = textwrap.dedent("""
        import os
        from trainguard.testing import SimNodes
        c = SimNodes(2, sweep=False)
        print(" ".join(c.namespaces()), flush=True)
        os._exit(9)  # no close(), no atexit: what a SIGKILLed test run leaves behind
    """)
    with SimNodes(1) as live:
        res = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True,
                             timeout=60, check=False)
        left = res.stdout.split()
        assert len(left) == 3 and set(left) <= harness_netns(), res.stderr
        swept = sweep_leftovers()
        assert set(left) <= set(swept)
        assert not set(left) & set(list_netns())
        assert set(live.namespaces()) <= set(list_netns()), "a live cluster is never swept"


def _serve_and_talk(cluster: SimNodes | LocalNodes) -> str:
    port = free_port()  # on 127.0.0.1 the port is shared with everything else on the machine
    _serve(cluster, 1, port)
    return _talk(cluster, 0, 1, port=port)


def test_sim_nodes_fixture_gives_working_nodes_here(sim_nodes):
    cluster = sim_nodes(2)
    assert len(cluster) == 2
    assert _serve_and_talk(cluster).startswith("XXXX")
    assert cluster.network_faults is (netns_unavailable() is None)


def test_localhost_fallback_runs_nodes_and_stops_their_processes():
    with LocalNodes(2) as cluster:
        assert {n.addr for n in cluster.nodes} == {"127.0.0.1"}
        assert not cluster.network_faults and not hasattr(cluster, "link_down")
        port = free_port()
        server = _serve(cluster, 1, port)
        assert _talk(cluster, 0, 1, port=port).startswith("XXXX")
    assert server.poll() is not None, "close() stopped the node's process"
