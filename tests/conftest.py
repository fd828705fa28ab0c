"""Suite-wide fixtures: every test must leave no child process, shared-memory segment or simulated
node namespace; simulated nodes (or launchers on localhost where namespaces are unavailable)."""

from __future__ import annotations

import os

import pytest

from trainguard.testing import LeakChecker, LocalNodes, SimNodes, free_port, netns_unavailable

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.pop("LOCAL_RANK", None)  # tests must not inherit a launcher's environment


@pytest.fixture(autouse=True)
def no_leaks(request):
    checker = LeakChecker()
    yield
    if request.node.get_closest_marker("allow_children"):
        return
    problems = checker.check()
    if problems:
        pytest.fail("resource leak after test:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def sim_nodes():
    """Factory ``sim_nodes(n, network_faults=False)``: ``n`` simulated nodes, closed after the test.

    Network namespaces on a bridge (:class:`SimNodes`) where root and ``ip`` allow; otherwise
    ``n`` "nodes" on 127.0.0.1 (:class:`LocalNodes`), or a skip when the test needs
    ``network_faults`` (link down, partitions, slow links).
    """
    made: list = []

    def make(n: int, network_faults: bool = False):
        reason = netns_unavailable()
        if reason and network_faults:
            pytest.skip(f"simulated nodes unavailable: {reason}")
        cluster = LocalNodes(n) if reason else SimNodes(n)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
