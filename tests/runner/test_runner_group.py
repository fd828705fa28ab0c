"""Process-group paths with real torch.distributed (gloo): the few tests that import torch in
ranks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from runner_workers import GroupWorker

from trainguard.runner import DistributedRunner, RankDesync, WorkerTimeout


@pytest.mark.timeout(150)
def test_two_group_runners_at_once_then_a_rank_failing_before_a_collective():
    a = DistributedRunner(GroupWorker, world_size=2, call_timeout=4.0, start_timeout=120)
    b = DistributedRunner(GroupWorker, world_size=2, call_timeout=4.0, start_timeout=120)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:  # started together; rendezvous ports come from the OS
            for fut in [pool.submit(a.start), pool.submit(b.start)]:
                fut.result(timeout=130)
        print(f"two world_size=2 gloo runners started in {time.monotonic() - t0:.1f} s")
        assert a.healthy and b.healthy
        info = a.generate(("info", None))
        assert info == {"initialized": True, "backend": "gloo", "device": "cpu", "rank": 0}
        assert a.generate(("allreduce", 10)) == 21.0  # (0 + 10) + (1 + 10)
        assert b.generate(("allreduce", 1)) == 3.0
        t0 = time.monotonic()
        with pytest.raises((RankDesync, WorkerTimeout)) as err:
            b.generate(("raise_before_collective", None))
        took = time.monotonic() - t0
        print(
            f"rank failing before an all-reduce -> {type(err.value).__name__} after "
            f"{took:.2f} s: {err.value}"
        )
        assert isinstance(err.value, RankDesync) and err.value.rank == 1
        assert took < 4.0 + 5.0
        assert not b.healthy and a.healthy
        assert a.generate(("allreduce", 0)) == 1.0
    finally:
        t0 = time.monotonic()
        b.shutdown()  # unusable: killed without a cooperative exit (rank 0 waits in a collective)
        a.shutdown()
        print(f"shutdown of both runners: {time.monotonic() - t0:.2f} s")


@pytest.mark.timeout(90)
def test_single_rank_skips_process_group_initialisation():
    with DistributedRunner(GroupWorker, world_size=1, init_process_group=True) as r:
        info = r.generate(("info", None))
    assert info["initialized"] is False and info["device"] == "cpu"
