"""``_core.store.DeadlineStore``: every call bounded, a wedged connection replaced."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from trainguard._core.store import DeadlineStore, StoreCallTimeout


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store
    del store


def test_a_wedged_call_times_out_and_the_next_call_reconnects(server):
    made: list[dist.Store] = []
    release = threading.Event()

    def factory() -> dist.Store:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        made.append(client)
        return client

    ds = DeadlineStore(factory, 5.0, "t")
    try:
        ds.call(lambda s: s.set("k", "v"))
        t0 = time.monotonic()
        with pytest.raises(StoreCallTimeout, match="did not return within 0.3 s"):
            ds.call(lambda s: release.wait(30), 0.3)  # stands in for a client on a dead link
        assert time.monotonic() - t0 < 2.0
        assert ds.call(lambda s: s.get("k")) == b"v"
        assert len(made) == 2  # the wedged connection was dropped, not reused
    finally:
        release.set()
        ds.close()


def test_errors_of_the_call_reach_the_caller(server):
    ds = DeadlineStore(lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False), 5.0)
    try:
        with pytest.raises(ZeroDivisionError):
            ds.call(lambda s: 1 / 0)
        assert ds.call(lambda s: s.add("n", 2)) == 2
    finally:
        ds.close()
    with pytest.raises(RuntimeError, match="closed"):
        ds.call(lambda s: s.add("n", 1))


def test_a_store_error_drops_the_connection(server):
    made: list[int] = []

    def factory() -> dist.Store:
        made.append(1)
        return dist.TCPStore("127.0.0.1", server.port, is_master=False)

    ds = DeadlineStore(factory, 5.0)
    try:
        ds.call(lambda s: s.set("a", "1"))

        def broken(s: dist.Store) -> None:
            raise RuntimeError("Broken pipe")

        with pytest.raises(RuntimeError, match="Broken pipe"):
            ds.call(broken)
        assert ds.call(lambda s: s.get("a")) == b"1"
        assert len(made) == 2
    finally:
        ds.close()
