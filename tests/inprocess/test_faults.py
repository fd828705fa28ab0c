"""Multi-process fault tests of in-process restart (real processes, gloo, real faults).

Each test launches ranks with :func:`trainguard.testing.faults.run_ranks`; the rank program is
:func:`rank_main` below, configured through ``TG_TEST_CFG`` (JSON) and a fault plan. Latencies
are printed (``-s``) and asserted only with generous bounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist

from trainguard.inprocess import CallWrapper, Compose, Wrapper
from trainguard.inprocess.initialize import RetryController
from trainguard.inprocess.rank_assignment import ActivateAllRanks, MaxActiveWorldSize, ShiftRanks
from trainguard.testing.faults import Fault, FaultKind, FaultPlan, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = "test_faults:rank_main"


# -- rank-side helpers (run inside the launched rank processes) --------------------------------
def _assignment(active):
    if active is None:
        return Compose(ActivateAllRanks(), ShiftRanks())
    return Compose(MaxActiveWorldSize(active), ShiftRanks())


def _initialize(cfg: dict):
    limit = cfg.get("max_iterations")
    return None if limit is None else RetryController(max_iterations=limit)


def _wrapper(cfg: dict) -> Wrapper:
    return Wrapper(
        rank_assignment=_assignment(cfg.get("active")),
        initialize=_initialize(cfg),
        soft_timeout=cfg.get("soft", 5.0),
        hard_timeout=cfg.get("hard", 8.0),
        barrier_timeout=cfg.get("barrier", 20.0),
        completion_timeout=cfg.get("completion", 20.0),
        heartbeat_interval=0.2,
        heartbeat_timeout=cfg.get("heartbeat_timeout", 10.0),
        monitor_process_interval=0.05,
        monitor_thread_interval=0.2,
        progress_watchdog_interval=0.05,
        last_call_wait=cfg.get("last_call_wait", 0.05),
        termination_grace_time=0.5,
        finalize=_raising_hook("finalize", cfg),
        monitor_process_logfile=cfg.get("monitor_log"),
        monitor_process_pidfile=cfg.get("monitor_pid"),
        health_check=_raising_hook("health_check", cfg),
    )


def _raising_hook(name: str, cfg: dict):
    """Hook that raises on the rank/iteration given by ``cfg[name]`` = [rank, iteration]."""
    spec = cfg.get(name)
    if spec is None:
        return None
    initial = int(os.environ["RANK"])

    def hook(state):
        if initial == spec[0] and state.iteration == spec[1]:
            raise RuntimeError(f"injected {name} failure")
        return state

    return hook


def _lose_node(cfg: dict) -> None:
    """Simulate losing this rank's host: SIGKILL its monitor process, then itself."""
    with open(cfg["monitor_pid"].replace("{rank}", os.environ["RANK"])) as fh:
        os.kill(int(fh.read()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def rank_main():
    cfg = json.loads(os.environ["TG_TEST_CFG"])
    plan = FaultPlan.from_env()
    initial = int(os.environ["RANK"])
    holder: dict = {"enter": []}

    @_wrapper(cfg)
    def train(cw: CallWrapper):
        holder["cw"] = cw
        holder["enter"].append((cw.iteration, time.time()))
        if cfg.get("pg"):
            cw.init_process_group(timeout=cfg.get("gloo_timeout", 120))
        for step in range(cfg.get("steps", 5)):
            if cfg.get("node_loss") == [initial, cw.iteration, step]:
                _lose_node(cfg)
            plan.check(initial, cw.iteration, step)
            if cfg.get("pg"):
                x = torch.ones(4)
                dist.all_reduce(x)
            time.sleep(cfg.get("step_s", 0.01))
        if cfg.get("pg"):
            dist.destroy_process_group()
        return {"iteration": cw.iteration, "active_world_size": cw.state.active_world_size}

    ret = train()
    t_return = time.time()
    cw = holder["cw"]
    recs = [
        dict(dataclasses.asdict(r), restart_s=r.restart_s, detection_s=r.detection_s)
        for r in cw.restart_records
    ]
    return {"ret": ret, "records": recs, "enter": holder["enter"], "mode": cw.state.mode.name,
            "t_return": t_return}


# -- test-side helpers ---------------------------------------------------------------------------
def launch(world: int, cfg: dict, faults=(), timeout_s: float = 60.0):
    plan = FaultPlan(faults)
    t0 = time.monotonic()
    res = run_ranks(
        TARGET,
        world,
        timeout_s=timeout_s,
        plan=plan,
        pythonpath=[HERE],
        env={"TG_TEST_CFG": json.dumps(cfg)},
    )
    print(
        f"\n[{world} ranks, {time.monotonic() - t0:.2f} s] "
        f"faults={[f.kind.value for f in plan.faults]}"
    )
    for r in res:
        recs = (r.result or {}).get("records", [])
        lat = [
            (
                x["cause"],
                x["fault_ranks"],
                round(x["detection_s"], 3),
                None if x["restart_s"] is None else round(x["restart_s"], 3),
            )
            for x in recs
        ]
        print(
            f"  rank {r.rank}: rc={r.returncode} ret={(r.result or {}).get('ret')} restarts={lat}"
        )
        if r.returncode not in (0, None) and r.stderr:
            print("   stderr tail:", r.stderr[-1500:])
    return res


def survivors(res, faulty: set[int]):
    return [r for r in res if r.rank not in faulty]


def assert_recovered(res, faulty: set[int], world_after: int, iteration: int = 1):
    for r in survivors(res, faulty):
        assert r.returncode == 0, f"rank {r.rank} rc={r.returncode}\n{r.stderr[-3000:]}"
        assert r.result["ret"]["iteration"] == iteration, r.result
        assert r.result["ret"]["active_world_size"] == world_after, r.result


# -- tests ---------------------------------------------------------------------------------------
# Faults on a random non-zero rank and on rank 0 (whose monitor process hosts the store, so
# rank 0 dying must not end the job). Each case is one launch whose restart iterations inject its
# faults in turn: the non-terminal kinds (RAISE, then HANG_SLEEP) fault on both ranks of a 2-rank
# job; SIGKILL and SystemExit take out a non-zero rank and then rank 0 of a 3-rank job; the other
# terminal kinds are paired in a 3-rank job, one on a non-zero rank, the other on rank 0. Faults
# share launches to keep the suite lean; every kind keeps its own latency bound below.
_TERMINAL = {
    FaultKind.EXIT,
    FaultKind.SIGKILL,
    FaultKind.SIGTERM,
    FaultKind.SIGSEGV,
    FaultKind.SIGSTOP,
    FaultKind.HANG_GIL,
}
_K = FaultKind
_CASES = [  # (world size, [(kind, target rank)] in iteration order)
    (2, [(_K.RAISE, "nonzero"), (_K.RAISE, 0), (_K.HANG_SLEEP, "nonzero"), (_K.HANG_SLEEP, 0)]),
    (3, [(_K.SIGKILL, "nonzero"), (_K.SIGKILL, 0)]),
    (3, [(_K.EXIT, "nonzero"), (_K.EXIT, 0)]),
    (3, [(_K.SIGTERM, "nonzero"), (_K.SIGSEGV, 0)]),
    (3, [(_K.SIGSTOP, "nonzero"), (_K.HANG_GIL, 0)]),
]


def _case_id(case) -> str:
    return "-".join(dict.fromkeys(kind.value for kind, _ in case[1]))


def _targets(world: int, plan: list) -> list[int]:
    """The rank of each planned fault: "nonzero" is a random rank other than 0, never one a
    terminal fault already took out."""
    free = list(range(1, world))
    random.shuffle(free)
    ranks = []
    for kind, target in plan:
        ranks.append(free.pop() if target == "nonzero" and kind in _TERMINAL else
                     random.randint(1, world - 1) if target == "nonzero" else target)
    return ranks


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world, plan", _CASES, ids=[_case_id(c) for c in _CASES])
def test_fault_kinds(world, plan, tmp_path):
    ranks = _targets(world, plan)
    kinds = [kind for kind, _ in plan]
    faults = [Fault(r, kind, iteration=i, step=2) for i, (kind, r) in enumerate(zip(kinds, ranks))]
    cfg = {"pg": True, "gloo_timeout": 300, "soft": 1.0, "hard": 2.5, "steps": 4,
           "monitor_log": str(tmp_path / "monitor{rank}.log")}
    res = launch(world, cfg, faults, timeout_s=130)
    faulty = {r for kind, r in zip(kinds, ranks) if kind in _TERMINAL}
    assert_recovered(res, faulty, world - len(faulty), iteration=len(ranks))
    for r in survivors(res, faulty):
        causes = [(x["cause"], x["fault_ranks"]) for x in r.result["records"]]
        assert [c[1] for c in causes] == [[x] for x in ranks], causes
    for r in res:
        if r.rank in faulty:
            assert r.returncode != 0
    records = survivors(res, faulty)[0].result["records"]
    lat = [round(x["restart_s"], 3) for x in records]
    print(f"  {[k.value for k in kinds]} on ranks {ranks}: fault -> re-entry per restart (s): "
          f"{lat}")
    for kind, rank, x, rec in zip(kinds, ranks, lat, records):
        if kind is FaultKind.RAISE:  # gloo timeout is 300 s: the abort broke the blocked collective
            assert x < 5.0, (kind, lat)
        if kind is FaultKind.HANG_SLEEP:  # interrupted at the soft timeout (1 s), not killed
            assert x < 1.0 + 3.0, (kind, lat)
        if kind in (FaultKind.HANG_GIL, FaultKind.SIGSTOP):
            # the interrupt cannot be taken (GIL held / stopped): killed 0.5 s after the soft
            # timeout (1 s) instead of at the hard timeout (2.5 s)
            assert 1.0 < x < 2.5 + 5.0, (kind, lat)
            # the kill by the machinery is in the restart record, with its reason (issue 13.1)
            assert "hard_timeout on ranks" in rec["message"], rec
            # its monitor process knew: the kill did not wait for hard_timeout
            log = (tmp_path / f"monitor{rank}.log").read_text()
            assert "restart interrupt cannot be taken" in log, log[-2000:]


@pytest.mark.timeout(90)
def test_reserve_rank_takes_over_killed_active_rank():
    res = launch(3, {"pg": True, "active": 2}, [Fault(1, FaultKind.SIGKILL, iteration=0, step=2)])
    assert res[1].returncode == -signal.SIGKILL
    assert_recovered(res, {1}, world_after=2)
    reserve = res[2].result
    assert [it for it, _ in reserve["enter"]] == [1]  # idle in iteration 0, active in 1
    assert reserve["mode"] == "ACTIVE"


@pytest.mark.timeout(90)
def test_finalize_and_restart_health_check_failures_take_ranks_out():
    cfg = {"finalize": [1, 0], "health_check": [2, 1]}
    res = launch(3, cfg, [Fault(0, FaultKind.RAISE, iteration=0, step=1)])
    assert res[1].returncode != 0 and "injected finalize failure" in res[1].stderr
    assert res[2].returncode != 0 and "HealthCheckError" in res[2].stderr
    assert_recovered(res, {1, 2}, world_after=1, iteration=2)
    causes = [(r["cause"], r["fault_ranks"]) for r in res[0].result["records"]]
    # rank 1 left during the first restart (its finalize failed): that restart's record names it
    assert causes[0] == ("exception", [0, 1]) and causes[1][1] == [2], causes
    assert "exit on ranks [1]" in res[0].result["records"][0]["message"]


@pytest.mark.timeout(90)
def test_repeated_faults_with_retry_limit():
    faults = [Fault(i % 2, FaultKind.RAISE, iteration=i, step=1) for i in range(6)]
    res = launch(2, {"pg": True, "max_iterations": 10}, faults)
    assert_recovered(res, set(), world_after=2, iteration=6)
    for r in res:
        recs = r.result["records"]
        assert [x["fault_ranks"] for x in recs] == [[i % 2] for i in range(6)]
        print(f"  rank {r.rank} restart_s: {[round(x['restart_s'], 3) for x in recs]}")


@pytest.mark.timeout(90)
def test_unresponsive_rank_detected_by_sibling_heartbeat(tmp_path):
    cfg = {
        "node_loss": [1, 0, 1],
        "monitor_pid": str(tmp_path / "mon{rank}.pid"),
        "heartbeat_timeout": 1.0,
        "steps": 3,
    }
    res = launch(2, cfg)
    assert res[1].returncode == -signal.SIGKILL
    assert_recovered(res, {1}, world_after=1)
    rec = res[0].result["records"][0]
    assert rec["cause"] == "unresponsive" and rec["fault_ranks"] == [1], rec
    assert 0.8 < rec["detection_s"] < 5.0


@pytest.mark.timeout(150)
def test_four_rank_restart_latency():
    """One 4-rank launch: an exception on a random non-zero rank, then a SIGKILL of another one;
    the survivors re-enter within 5 s after each."""
    raising, killed = random.sample(range(1, 4), 2)
    faults = [Fault(raising, FaultKind.RAISE, iteration=0, step=2),
              Fault(killed, FaultKind.SIGKILL, iteration=1, step=2)]
    res = launch(4, {"pg": True, "gloo_timeout": 300}, faults, timeout_s=130)
    assert_recovered(res, {killed}, world_after=3, iteration=2)
    for r in survivors(res, {killed}):
        causes = [x["fault_ranks"] for x in r.result["records"]]
        assert causes == [[raising], [killed]], causes
    for kind, rank, i in ((FaultKind.RAISE, raising, 0), (FaultKind.SIGKILL, killed, 1)):
        lat = max(r.result["records"][i]["restart_s"] for r in survivors(res, {killed}))
        print(f"  4 ranks, {kind.value} on rank {rank} -> survivors re-entered: {lat:.3f} s "
              "(target 1.0 s)")
        assert lat < 5.0, (kind, lat)


@pytest.mark.timeout(90)
def test_store_outlives_rank0_leaving_early():
    # rank 0 (its monitor hosts the store) leaves at once; rank 1 trains on for longer than
    # barrier_timeout, so the store must stay up as long as rank 1 is alive, not a fixed time
    cfg = {
        "soft": 1.0,
        "hard": 2.0,
        "barrier": 3.0,
        "heartbeat_timeout": 2.5,
        "steps": 40,
        "step_s": 0.1,
    }
    res = launch(2, cfg, [Fault(0, FaultKind.EXIT, iteration=0, step=1)])
    assert res[0].returncode != 0
    assert_recovered(res, {0}, world_after=1)
    enter = res[1].result["enter"][-1][1]
    assert res[1].result["t_return"] - enter > 3.0  # ran past barrier_timeout on the store
