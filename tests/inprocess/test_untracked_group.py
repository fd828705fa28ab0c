"""A gloo group created with a plain ``dist.init_process_group`` (not through
``CallWrapper.init_process_group``) is still released by the default abort: users migrating from
NVRx create their groups themselves, and gloo's own timeout must not set the restart latency."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from trainguard.inprocess import CallWrapper, Wrapper
from trainguard.testing.faults import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def plain_group_rank_main():
    """Rank 1 raises while rank 0 is blocked in an all_reduce of a plainly created gloo group."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    holder: dict = {}

    @Wrapper(soft_timeout=20.0, hard_timeout=30.0, barrier_timeout=40.0, heartbeat_timeout=10.0,
             heartbeat_interval=0.2, monitor_process_interval=0.05, monitor_thread_interval=0.1,
             progress_watchdog_interval=0.05, last_call_wait=0.05, termination_grace_time=0.5)
    def train(cw: CallWrapper):
        holder["cw"] = cw
        if os.environ.get("TG_TEST_TRACKED") == "1":
            cw.init_process_group(timeout=300)
        else:
            store = dist.PrefixStore(
                f"user_pg_{cw.iteration}", cw.store
            )  # fresh prefix per attempt
            dist.init_process_group(
                "gloo",
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timedelta(seconds=300),
            )
        for step in range(4):
            if rank == 1 and cw.iteration == 0 and step == 2:
                time.sleep(0.3)  # rank 0 is inside the all_reduce by now
                raise RuntimeError("injected fault on rank 1")
            dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
        return cw.iteration

    ret = train()
    recs = [
        (r.cause, list(r.fault_ranks), round(r.restart_s, 3)) for r in holder["cw"].restart_records
    ]
    return {"ret": ret, "records": recs}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tracked", [False, True])
def test_untracked_gloo_group_is_released_by_the_default_abort(tracked):
    res = run_ranks(
        "test_untracked_group:plain_group_rank_main",
        2,
        timeout_s=60,
        pythonpath=[HERE],
        env={"TG_TEST_TRACKED": "1" if tracked else "0"},
    )
    for r in res:
        print(f"rank {r.rank}: rc={r.returncode} result={r.result}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.result["ret"] == 1
        [(cause, ranks, restart_s)] = r.result["records"]
        assert cause == "exception" and ranks == [1]
        assert restart_s < 10.0  # far below gloo's 300 s timeout
    assert "injected fault on rank 1" in res[1].stderr  # the fault is logged with its traceback
