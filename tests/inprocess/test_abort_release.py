"""An abort releases every wait a rank can be blocked in during an iteration (issue 13.1, 13.2).

One test per kind of wait: a gloo group that trainguard did not create (an ``AsyncCheckpointer``
made inside the wrapped function, a user's ``dist.new_group``), process-group creation waiting for
a peer that raised before joining (in ``fn`` or in an ``initialize`` hook), a store wait, and a
plain ``init_process_group('gloo')`` over ``env://``. Gloo's own timeouts are 300 s and the hard
timeout is 20 s, so a restart within a few seconds proves the abort released the wait. Faults are
real (SIGKILL, raise).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from trainguard.inprocess import CallWrapper, Wrapper
from trainguard.inprocess.health_check import FaultCounter
from trainguard.testing.faults import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = "test_abort_release:rank_main"
_GLOO = timedelta(seconds=300)


# -- rank side ---------------------------------------------------------------------------------
def _kind_ckpt(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """AsyncCheckpointer created inside fn (its own gloo group), ``maybe_finalize`` every step.

    ``ckpt_kill``: rank 2 is SIGKILLed while the others are in the checkpointer's all-reduce.
    ``ckpt_raise``: rank 1 raises while ranks 0 and 2 are in that all-reduce (nothing closes
    their sockets but the abort).
    """
    from trainguard.checkpointing import AsyncCheckpointer

    cw.init_process_group(timeout=300)
    ckpt = AsyncCheckpointer(os.path.join(cfg["dir"], f"it{cw.iteration}"), keep_last=1,
                             collective_timeout=300)
    try:
        for step in range(5):
            ckpt.save({"w": torch.full((4,), float(step))}, step)
            if cw.iteration == 0 and step == 2:
                if cfg["kind"] == "ckpt_kill" and rank == 2:
                    time.sleep(0.5)  # the others are waiting for us in maybe_finalize
                    os.kill(os.getpid(), signal.SIGKILL)
                if cfg["kind"] == "ckpt_raise" and rank == 1:
                    time.sleep(0.5)
                    raise RuntimeError("injected fault while the others finalize")
            ckpt.maybe_finalize(blocking=True)
    finally:
        ckpt.close(finalize=False)


def _kind_subgroup(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """A user's ``dist.new_group([0, 1])``. Rank 2 is SIGKILLed while rank 1 waits for it in
    an all-reduce of the default group and rank 0 waits for rank 1 in the subgroup: only the
    abort can release rank 0."""
    import torch.distributed as dist

    cw.init_process_group(timeout=300)
    sub = dist.new_group([0, 1], backend="gloo", timeout=_GLOO)
    for step in range(4):
        if cw.iteration == 0 and step == 2:
            if rank == 2:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0:
                dist.all_reduce(torch.ones(4), group=sub)
        dist.all_reduce(torch.ones(4))
        if rank in (0, 1):
            dist.all_reduce(torch.ones(4), group=sub)


def _kind_pg_init(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """Rank 1 raises before joining; the others wait inside ``cw.init_process_group``."""
    if rank == 1 and cw.iteration == 0:
        time.sleep(0.5)
        raise RuntimeError("injected fault before joining the process group")
    cw.init_process_group(timeout=300)
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4))


def _kind_store_wait(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """Rank 0 waits on ``cw.store`` for a key nobody sets; rank 1 raises."""
    if cw.iteration == 0:
        if rank == 1:
            time.sleep(0.5)
            raise RuntimeError("injected fault while rank 0 waits on the store")
        if rank == 0:
            cw.store.wait(["never-set-key"], timedelta(seconds=300))


def _kind_plain_env(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """A plain ``init_process_group('gloo')`` over env:// (the user's own TCPStore at
    MASTER_PORT); rank 1 raises before joining in iteration 0. Each iteration's keys must be
    fresh: ``add`` on the default store returns 1 in every iteration (issue 15.4)."""
    import torch.distributed as dist

    if rank == 1 and cw.iteration == 0:
        time.sleep(0.5)
        raise RuntimeError("injected fault before joining the env:// process group")
    dist.init_process_group("gloo", timeout=_GLOO)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    store = dist.distributed_c10d._get_default_store()
    cfg["counts"].append(store.add(f"user-counter-{rank}", 1))
    if rank == 1 and cw.iteration == 1:
        raise RuntimeError("second injected fault, after the group was created")
    dist.destroy_process_group()


def _kind_ddp_teardown(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """Free a DDP model right after destroying its group, just after the last all-reduce
    (issue 13.8; deadlocks on the GIL within a few tries with torch alone)."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    for attempt in range(8):
        store = dist.PrefixStore(f"ddp{cw.iteration}-{attempt}", cw.store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_GLOO)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
        dist.destroy_process_group()
        del model


def _kind_double_fault(cw: CallWrapper, rank: int, cfg: dict) -> None:
    """Rank 1 raises in iterations 0 and 1 while the others are blocked in an all-reduce that
    the abort breaks ("Connection closed by peer" on the healthy ranks)."""
    import torch.distributed as dist

    cw.init_process_group(timeout=300)
    for step in range(4):
        if rank == 1 and cw.iteration < 2 and step == 2:
            time.sleep(0.3)
            raise RuntimeError(f"injected fault {cw.iteration} on rank 1")
        dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()


_KINDS = {"double_fault": _kind_double_fault, "ddp_teardown": _kind_ddp_teardown,
          "ckpt_kill": _kind_ckpt, "ckpt_raise": _kind_ckpt, "subgroup": _kind_subgroup,
          "pg_init": _kind_pg_init, "store_wait": _kind_store_wait, "plain_env": _kind_plain_env}


def rank_main() -> dict:
    cfg = json.loads(os.environ["TG_TEST_CFG"])
    rank = int(os.environ["RANK"])
    holder: dict = {}
    cfg["counts"] = []
    kind = _KINDS.get(cfg["kind"])
    counter = FaultCounter(max_rank_faults=cfg.get("max_rank_faults"))

    def initialize(state):
        if cfg["kind"] == "hook" and rank == 1 and state.iteration == 0:
            time.sleep(0.5)
            raise RuntimeError("injected fault in the initialize hook")
        return state

    @Wrapper(soft_timeout=15.0, hard_timeout=20.0, barrier_timeout=60.0, heartbeat_timeout=10.0,
             heartbeat_interval=0.2, monitor_process_interval=0.05, monitor_thread_interval=0.1,
             progress_watchdog_interval=0.05, last_call_wait=0.05, termination_grace_time=0.5,
             initialize=initialize, health_check=counter)
    def train(cw: CallWrapper):
        holder["cw"] = cw
        if kind is None:  # "hook": the others wait in cw.init_process_group
            _kind_pg_init_after_hook(cw)
        else:
            kind(cw, rank, cfg)
        return cw.iteration

    ret = train()
    cw = holder["cw"]
    recs = [{"cause": r.cause, "ranks": list(r.fault_ranks), "restart_s": r.restart_s,
             "message": r.message} for r in cw.restart_records]
    return {"ret": ret, "records": recs, "counts": cfg["counts"], "faults": counter.faults,
            "world": cw.state.active_world_size}


def _kind_pg_init_after_hook(cw: CallWrapper) -> None:
    import torch.distributed as dist

    cw.init_process_group(timeout=300)
    dist.all_reduce(torch.ones(4))
    dist.destroy_process_group()


# -- test side ---------------------------------------------------------------------------------
def _launch(kind: str, world: int, **cfg) -> list:
    res = run_ranks(TARGET, world, timeout_s=120, pythonpath=[HERE],
                    env={"TG_TEST_CFG": json.dumps({"kind": kind, **cfg})})
    for r in res:
        print(f"rank {r.rank}: rc={r.returncode} result={r.result}")
    return res


def _assert_restarted(res: list, faulty: set[int], fault_ranks: list[int], cause: str,
                      world_after: int) -> None:
    for r in res:
        if r.rank in faulty:
            continue
        assert r.returncode == 0, r.stderr[-4000:]
        assert r.result["ret"] == 1 and r.result["world"] == world_after, r.result
        [rec] = r.result["records"]
        assert rec["cause"] == cause and rec["ranks"] == fault_ranks, rec
        assert rec["restart_s"] < 10.0, rec  # hard timeout 20 s, gloo timeout 300 s
        # only a rank's own fault counts (issue 13.2): errors the abort caused do not
        own = 1 if cause == "exception" and r.rank in fault_ranks else 0
        assert r.result["faults"] == own, r.result


@pytest.mark.timeout(160)
@pytest.mark.parametrize("kind", ["ckpt_kill", "subgroup"])
def test_sigkill_releases_groups_created_inside_fn(kind, tmp_path):
    res = _launch(kind, 3, dir=str(tmp_path))
    assert res[2].returncode == -signal.SIGKILL
    _assert_restarted(res, {2}, [2], "terminated", world_after=2)


@pytest.mark.timeout(160)
def test_exception_releases_checkpointer_group_created_inside_fn(tmp_path):
    res = _launch("ckpt_raise", 3, dir=str(tmp_path))
    _assert_restarted(res, set(), [1], "exception", world_after=3)


@pytest.mark.timeout(160)
@pytest.mark.parametrize("kind", ["pg_init", "hook"])
def test_peer_raising_before_joining_releases_process_group_creation(kind):
    res = _launch(kind, 3)
    _assert_restarted(res, set(), [1], "exception", world_after=3)


@pytest.mark.timeout(160)
def test_store_wait_is_released():
    res = _launch("store_wait", 2)
    _assert_restarted(res, set(), [1], "exception", world_after=2)


@pytest.mark.timeout(160)
def test_plain_env_process_group_released_and_keys_fresh_per_iteration():
    res = _launch("plain_env", 2)
    for r in res:
        assert r.returncode == 0, r.stderr[-4000:]
        assert r.result["ret"] == 2, r.result
        assert [x["ranks"] for x in r.result["records"]] == [[1], [1]], r.result
        assert all(x["restart_s"] < 10.0 for x in r.result["records"]), r.result
        # each rank adds once in iterations 1 and 2: every iteration's keys start fresh
        assert r.result["counts"] == [1, 1], r.result


@pytest.mark.timeout(160)
def test_freeing_ddp_after_destroying_its_group_does_not_deadlock():
    res = _launch("ddp_teardown", 2)
    for r in res:
        assert r.returncode == 0, r.stderr[-4000:]
        assert r.result["ret"] == 0 and r.result["records"] == [], r.result


@pytest.mark.timeout(160)
def test_fault_counter_counts_only_own_faults():
    """FaultCounter(max_rank_faults=1): the rank that faulted twice leaves; the healthy ranks,
    released from their all-reduce by the abort, are not blamed and finish (issue 13.2)."""
    res = _launch("double_fault", 3, max_rank_faults=1)
    assert res[1].returncode != 0 and "FaultCounterExceeded" in res[1].stderr, res[1].stderr[-3000:]
    for r in (res[0], res[2]):
        assert r.returncode == 0, r.stderr[-4000:]
        assert r.result["faults"] == 0 and r.result["ret"] == 2, r.result
        assert r.result["world"] == 2, r.result
        assert [x["ranks"] for x in r.result["records"]] == [[1], [1]], r.result
