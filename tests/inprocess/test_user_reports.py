"""User reports (spec inprocess.md §13) and NVRx defects (§14) not covered elsewhere.

Each test is named after the report it reproduces and links it in its docstring. The coverage
map of every §13 row and §14 defect (including the ones tested in the other files of this
directory):

| report / defect | test |
|---|---|
| Megatron-LM#2774 | test_megatron_2774_previous_attempt_memory_released (+ test_wrap) |
| NVRx#143 | test_nvrx_143_survivor_blocked_on_a_peer_that_exited_restarts, test_faults::test_fault_kinds[sigkill] |
| NVRx#142 | test_wrap::test_initial_barrier_timeout_names_missing_ranks_and_runs_terminate, test_nvrx_142_rank_starting_late_within_barrier_timeout_is_not_discarded |
| NVRx PR#103 | n/a on CPU (device binding needs CUDA); test_health_check on a GPU host |
| NVRx PR#112 | test_wrap::test_previous_iteration_objects_are_collected |
| NVRx PR#99 | test_nvrx_defect3_and_pr99_barrier_timeout_runs_terminate_daemon_outlives, test_faults::test_store_outlives_rank0_leaving_early |
| NVRx PR#129 | test_wrap::test_disable_hang_protection |
| NVRx PR#154 | test_nvrx_pr154_restart_kills_checkpoint_writer_next_save_respawns |
| NVRx PR#118 | test_wrap::test_restart_records_and_hooks_see_frozen_state, ::test_second_call_on_the_same_persistent_store |
| NVRx PR#139 | test_wrap::test_second_call_on_the_same_persistent_store (process fallback: runner) |
| Megatron-Bridge#805 | test_wrap::test_process_group_already_initialized_is_an_error |
| Megatron-Bridge#5187 | test_megatron_bridge_5187_call_wrapper_reaches_fn_through_adapters |
| Megatron-Bridge#4944 | test_policies::test_retry_controller_is_none_safe |
| Megatron-Bridge#5755 | test_wrap::test_retry_controller_limit_raises_restart_abort |
| Megatron-Bridge#4889/#4839/#5761 | test_megatron_bridge_4889_reset_hooks_run_before_the_next_attempt |
| §14.1 FillGaps | test_rank_assignment::test_fill_gaps_correct_semantics |
| §14.2 annotations | test_wrap::test_injection_annotations |
| §14.3 barrier timeout skips terminate | test_nvrx_defect3_and_pr99_barrier_timeout_runs_terminate_daemon_outlives |
| §14.4 RANK="None", shared hooks | test_state::test_set_distributed_vars_never_writes_none, test_rank_assignment::test_tree_rebuilds_per_call_and_never_exports_none, test_wrap::test_default_hooks_are_per_wrapper |
| §14.5 death before the first iteration | test_nvrx_defect5_trainer_killed_before_first_iteration_daemon_exits_cleanly |
| §14.6 endless re-raise | test_nvrx_defect6_interrupt_is_not_reraised_into_user_cleanup, test_wrap::test_atomic_defers_the_interrupt |
| §14.7 no NVML = unhealthy | test_health_check::test_default_chain_on_cpu_passes |
| §14.8 single-use barriers | test_wrap::test_second_call_on_the_same_persistent_store |
| §14.9 starved timeout checks | test_wrap::test_manual_ping_catches_python_livelock |
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from trainguard._core.hooks import register_reset_callback, unregister_reset_callback
from trainguard.inprocess import CallWrapper, RestartAbort, Wrapper
from trainguard.inprocess.initialize import RetryController
from trainguard.testing import free_port, wait_gone
from trainguard.testing.faults import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = {
    "soft_timeout": 3.0,
    "hard_timeout": 6.0,
    "barrier_timeout": 10.0,
    "heartbeat_timeout": 5.0,
    "heartbeat_interval": 0.2,
    "monitor_process_interval": 0.05,
    "monitor_thread_interval": 0.1,
    "progress_watchdog_interval": 0.05,
    "termination_grace_time": 0.5,
}


@pytest.fixture
def single_rank_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        monkeypatch.delenv(var, raising=False)




def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def _kill_if_alive(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- single process ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_megatron_2774_previous_attempt_memory_released(single_rank_env):
    """https://github.com/NVIDIA/Megatron-LM/issues/2774: the failed attempt's memory stayed
    allocated across the restart (fear of an OOM loop), and the loop must stay bounded.

    Each attempt allocates a 32 MiB tensor that is held by a reference cycle *and* by the frames
    of the raised exception's traceback; by the next attempt it must be freed. A run that always
    fails ends after exactly ``max_iterations`` attempts with ``RestartAbort``.
    """
    refs: list[weakref.ref] = []
    alive_at_entry: list[int] = []

    class Model:
        def __init__(self) -> None:
            self.weight = torch.empty(8 << 20)  # 32 MiB
            self.cycle = self

    def forward(model: Model) -> None:
        activations = model.weight * 2  # noqa: F841 - held by this frame in the traceback
        raise RuntimeError("CUDA out of memory (simulated)")

    @Wrapper(**FAST, initialize=RetryController(max_iterations=4))
    def train(cw: CallWrapper):
        alive_at_entry.append(sum(r() is not None for r in refs))
        model = Model()
        refs.append(weakref.ref(model.weight))
        if cw.iteration < 3:
            forward(model)
        return cw.iteration

    assert train() == 3
    assert alive_at_entry == [0, 0, 0, 0], alive_at_entry  # nothing of earlier attempts alive
    attempts = []

    @Wrapper(**FAST, initialize=RetryController(max_iterations=3))
    def always_fails(cw: CallWrapper):
        attempts.append(cw.iteration)
        forward(Model())

    with pytest.raises(RestartAbort, match="max_iterations=3"):
        always_fails()
    assert attempts == [0, 1, 2]


@pytest.mark.timeout(60)
def test_nvrx_pr154_restart_kills_checkpoint_writer_next_save_respawns(single_rank_env, tmp_path):
    """https://github.com/NVIDIA/nvidia-resiliency-ext/pull/154: async-checkpoint workers must be
    killed on restart; the next save starts a fresh one.

    A real ``AsyncCheckpointer`` writer process has a save in flight when the attempt fails; the
    restart (through the reset-callback registry, no import between the capabilities) kills it,
    and the save of the next attempt commits through a new writer.
    """
    from trainguard.checkpointing import AsyncCheckpointer

    ck = AsyncCheckpointer(tmp_path / "ck", write_timeout=30.0)
    pids: list[int] = []
    try:

        @Wrapper(**FAST)
        def train(cw: CallWrapper):
            state = {"w": torch.full((1 << 18,), float(cw.iteration))}
            if cw.iteration == 0:
                ck.save(state, 1)
                ck.wait()
                ck.save(state, 2)  # in flight when the fault hits
                pids.append(ck.writer.pid)
                raise RuntimeError("fault during a checkpoint write")
            pids.append(ck.writer.pid)  # None: the restart's abort took the (killed) writer
            ck.save(state, 3)
            pids.append(ck.writer.pid)  # its replacement, started (in the pool) by the abort
            return ck.wait()

        assert train() == [3]
        print("writer pids (attempt 0, after restart, after next save):", pids)
        assert pids[1] is None and pids[2] not in (None, pids[0])
        assert wait_gone(pids[0], 5.0), "writer of the failed attempt still alive"
        assert ck.writer.starts == 1 and ck.writer.taken == 1 and ck.num_unfinalized == 0
        obj, step = ck.load()
        assert step == 3 and obj["w"][0].item() == 1.0
        assert ck.manager.committed_steps() == [1, 3]  # the aborted step 2 never committed
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(60)
def test_megatron_bridge_4889_reset_hooks_run_before_the_next_attempt(single_rank_env):
    """https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/4889 (also /4839, /5761): global
    singletons (callbacks bound to the old model, a straggler-detector thread) survived the
    restart. A reset callback registered by such a singleton runs once per restart, before the
    next attempt starts, and its background thread is gone by then.
    """

    class Detector:  # a process-global singleton with a background thread
        instance: Detector | None = None

        def __init__(self) -> None:
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self.stop.wait, args=(60,), daemon=True)
            self.thread.start()

        @classmethod
        def get(cls) -> Detector:
            if cls.instance is None:
                cls.instance = cls()
            return cls.instance

        @classmethod
        def reset(cls) -> None:
            if cls.instance is not None:
                cls.instance.stop.set()
                cls.instance.thread.join(5)
                cls.instance = None
            events.append("reset")

    events: list = []
    register_reset_callback("test.bridge4889.detector", Detector.reset)
    threads: list[threading.Thread] = []
    try:

        @Wrapper(**FAST)
        def train(cw: CallWrapper):
            events.append(("enter", cw.iteration, Detector.instance is None))
            threads.append(Detector.get().thread)
            if cw.iteration < 2:
                raise RuntimeError("fault")
            return cw.iteration

        assert train() == 2
    finally:
        unregister_reset_callback("test.bridge4889.detector")
        Detector.reset()
    assert events[:5] == [
        ("enter", 0, True),
        "reset",
        ("enter", 1, True),
        "reset",
        ("enter", 2, True),
    ], events
    assert not threads[0].is_alive() and not threads[1].is_alive()
    assert len({id(t) for t in threads}) == 3  # a fresh singleton per attempt


@pytest.mark.timeout(60)
def test_megatron_bridge_5187_call_wrapper_reaches_fn_through_adapters(single_rank_env):
    """https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/5187: no CallWrapper injection through
    a ``*args/**kwargs`` adapter. Through a ``functools.wraps`` adapter and through a
    ``**kwargs: CallWrapper`` adapter the live CallWrapper reaches the inner function, in every
    attempt (a fresh iteration number after a restart).
    """
    seen: list = []

    def inner(config: dict, cw: CallWrapper = None):
        seen.append((config["name"], type(cw).__name__, cw.iteration))
        if cw.iteration == 0:
            raise RuntimeError("restart once")
        return cw.iteration

    def decorator(fn):
        @functools.wraps(fn)
        def adapter(*args, **kwargs):
            return fn(*args, **kwargs)

        return adapter

    def kw_adapter(*args, **kwargs: CallWrapper):
        return inner(*args, cw=kwargs["call_wrapper"])

    assert Wrapper(**FAST)(decorator(inner))({"name": "wraps"}) == 1
    assert Wrapper(**FAST)(kw_adapter)({"name": "kwargs"}) == 1
    assert seen == [
        ("wraps", "CallWrapper", 0),
        ("wraps", "CallWrapper", 1),
        ("kwargs", "CallWrapper", 0),
        ("kwargs", "CallWrapper", 1),
    ]


@pytest.mark.timeout(60)
def test_nvrx_defect6_interrupt_is_not_reraised_into_user_cleanup(single_rank_env):
    """Spec §14 defect 6 (NVRx monitor thread re-raises endlessly after soft_timeout and can
    interrupt user cleanup). Once the restart interrupt is delivered, a ``finally`` block that
    runs for many re-send intervals (soft_timeout / 4) completes undisturbed.
    """
    events: list = []
    holder: dict = {}

    @Wrapper(**{**FAST, "soft_timeout": 0.5, "hard_timeout": 8.0})
    def train(cw: CallWrapper):
        holder["cw"] = cw
        if cw.iteration == 0:
            try:
                time.sleep(60)  # hang: the soft timeout interrupts it
            finally:
                t0 = time.monotonic()
                for _ in range(12):  # 1.2 s of cleanup, in Python and in C
                    time.sleep(0.1)
                    sum(range(10_000))
                events.append(("cleanup finished", round(time.monotonic() - t0, 2)))
        return cw.iteration

    assert train() == 1
    print(events)
    assert [e[0] for e in events] == ["cleanup finished"] and events[0][1] >= 1.2
    assert len(holder["cw"].restart_records) == 1


def _defect5_child(port: int, pidfile: str, logfile: str) -> str:
    return f"""
import os
os.environ.update(RANK="0", WORLD_SIZE="2", TRAINGUARD_STORE_PORT="{port}")
from trainguard.inprocess import Wrapper
w = Wrapper(soft_timeout=3, hard_timeout=6, barrier_timeout=30, heartbeat_timeout=1.0,
            heartbeat_interval=0.1, monitor_process_interval=0.05,
            monitor_process_pidfile={pidfile!r}, monitor_process_logfile={logfile!r})
w(lambda: None)()  # rank 1 never comes: blocks in the initial barrier
"""


@pytest.mark.timeout(60)
def test_nvrx_defect5_trainer_killed_before_first_iteration_daemon_exits_cleanly(tmp_path):
    """Spec §14 defect 5: when the main process dies before the first iteration started, NVRx's
    daemon error path referenced a store and sibling monitor that did not exist yet.

    The trainer is SIGKILLed while it waits in the initial barrier; its monitor process must
    notice, exit on its own within a few seconds, and log no internal failure.
    """
    pidfile, logfile = str(tmp_path / "mon.pid"), str(tmp_path / "mon.log")
    child = subprocess.Popen(
        [sys.executable, "-c", _defect5_child(free_port(), pidfile, logfile)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    mon_pid = None
    try:
        end = time.monotonic() + 30
        while mon_pid is None and time.monotonic() < end and child.poll() is None:
            text = _read(pidfile).strip()
            if text:
                mon_pid = int(text)
            time.sleep(0.05)
        assert mon_pid is not None, child.communicate(timeout=5)[0].decode()[-2000:]
        time.sleep(1.0)  # the trainer is now inside the initial barrier
        assert child.poll() is None
        child.kill()
        child.wait(10)
        t0 = time.monotonic()
        gone = wait_gone(mon_pid, 15.0)
        print(f"monitor exited {time.monotonic() - t0:.2f} s after the trainer was killed")
        log = _read(logfile)
        print(log[-2000:])
        assert gone, "monitor process outlived its killed trainer"
        assert "Traceback" not in log and "monitor failed" not in log
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if mon_pid is not None:
            _kill_if_alive(mon_pid)


# -- multi-process -------------------------------------------------------------------------------
def barrier_timeout_rank_main():
    """Rank program for the §14.3 / PR#99 test (run by ``run_ranks``)."""
    cfg = json.loads(os.environ["TG_TEST_CFG"])
    rank = int(os.environ["RANK"])

    def finalize(state):
        if rank == 1 and state.iteration == 0:  # keeps running bytecode: no hang detected
            end = time.monotonic() + cfg["slow_finalize_s"]
            while time.monotonic() < end:
                time.sleep(0.01)
        return state

    def terminate(state):
        with open(os.path.join(cfg["dir"], f"terminate{rank}"), "w") as fh:
            fh.write(str(state.iteration))
        return state

    @Wrapper(
        soft_timeout=1.0,
        hard_timeout=2.0,
        barrier_timeout=3.0,
        heartbeat_timeout=2.5,
        heartbeat_interval=0.2,
        monitor_process_interval=0.05,
        monitor_thread_interval=0.1,
        progress_watchdog_interval=0.05,
        last_call_wait=0.05,
        termination_grace_time=0.5,
        finalize=finalize,
        terminate=terminate,
        monitor_process_pidfile=os.path.join(cfg["dir"], "mon{rank}.pid"),
        monitor_process_logfile=os.path.join(cfg["dir"], "mon{rank}.log"),
    )
    def train(cw: CallWrapper):
        if rank == 0 and cw.iteration == 0:
            raise RuntimeError("fault on rank 0")
        return {"iteration": cw.iteration, "world": cw.state.active_world_size}

    return {"ret": train(), "t": time.time()}


@pytest.mark.timeout(90)
def test_nvrx_defect3_and_pr99_barrier_timeout_runs_terminate_daemon_outlives(tmp_path):
    """Spec §14 defect 3 (an iteration-barrier timeout skipped ``terminate``) and
    https://github.com/NVIDIA/nvidia-resiliency-ext/pull/99 (the daemon must outlive its main
    process and finish the termination protocol).

    Rank 0 faults; rank 1's finalize runs longer than ``barrier_timeout``, so rank 0 times out
    in the iteration barrier: it must run ``terminate`` and leave with ``BarrierTimeout``. Rank
    0's monitor process (which hosts the store) must outlive it so rank 1 finishes alone, and
    both monitors must be gone afterwards.
    """
    cfg = {"dir": str(tmp_path), "slow_finalize_s": 5.0}
    t0 = time.time()
    res = run_ranks(
        "test_user_reports:barrier_timeout_rank_main",
        2,
        timeout_s=60,
        pythonpath=[HERE],
        env={"TG_TEST_CFG": json.dumps(cfg)},
    )
    for r in res:
        print(f"rank {r.rank}: rc={r.returncode} result={r.result} wall={r.wall_s:.2f}s")
    mon = {r: int((tmp_path / f"mon{r}.pid").read_text()) for r in (0, 1)}
    try:
        assert res[0].returncode != 0 and "BarrierTimeout" in res[0].stderr, res[0].stderr[-3000:]
        assert (tmp_path / "terminate0").read_text() == "0"  # terminate ran despite the timeout
        assert res[1].returncode == 0, res[1].stderr[-3000:]
        assert res[1].result["ret"]["world"] == 1 and res[1].result["ret"]["iteration"] >= 1
        assert not (tmp_path / "terminate1").exists()
        # rank 1 finished after rank 0 had left: only the daemon kept the store alive
        assert res[1].result["t"] - t0 > res[0].wall_s
        for r, pid in mon.items():
            assert wait_gone(pid, 10.0), f"monitor of rank {r} (pid {pid}) left running"
    finally:
        for pid in mon.values():
            _kill_if_alive(pid)


def late_rank_main():
    """Rank program for the NVRx#142 late-start test: rank 1 enters the wrapper late."""
    cfg = json.loads(os.environ["TG_TEST_CFG"])
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(cfg["late_s"])
    holder: dict = {}

    @Wrapper(
        soft_timeout=2.0,
        hard_timeout=4.0,
        barrier_timeout=15.0,
        heartbeat_timeout=1.0,
        heartbeat_interval=0.1,
        monitor_process_interval=0.05,
        monitor_thread_interval=0.1,
        progress_watchdog_interval=0.05,
        last_call_wait=0.05,
    )
    def train(cw: CallWrapper):
        holder["cw"] = cw
        time.sleep(0.3)
        return {"iteration": cw.iteration, "world": cw.state.active_world_size}

    ret = train()
    recs = [(r.cause, list(r.fault_ranks)) for r in holder["cw"].restart_records]
    return {"ret": ret, "records": recs}


@pytest.mark.timeout(90)
def test_nvrx_142_rank_starting_late_within_barrier_timeout_is_not_discarded():
    """https://github.com/NVIDIA/nvidia-resiliency-ext/issues/142: on multi-node launches ranks
    start at different times. A rank that reaches the initial barrier later than
    ``heartbeat_timeout`` but within ``barrier_timeout`` is a normal member: no restart, no rank
    declared unresponsive, full world size.
    """
    res = run_ranks(
        "test_user_reports:late_rank_main",
        2,
        timeout_s=60,
        pythonpath=[HERE],
        env={"TG_TEST_CFG": json.dumps({"late_s": 2.0})},
    )
    for r in res:
        print(f"rank {r.rank}: rc={r.returncode} result={r.result}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.result["records"] == [] and r.result["ret"] == {"iteration": 0, "world": 2}


def peer_exit_rank_main():
    """Rank program for the NVRx#143 test: rank 1 exits with code 0 in the middle of training
    while rank 0 is blocked in an all_reduce waiting for it."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    holder: dict = {}

    @Wrapper(
        soft_timeout=5.0,
        hard_timeout=8.0,
        barrier_timeout=20.0,
        heartbeat_timeout=10.0,
        heartbeat_interval=0.2,
        monitor_process_interval=0.05,
        monitor_thread_interval=0.1,
        progress_watchdog_interval=0.05,
        last_call_wait=0.05,
        termination_grace_time=0.5,
    )
    def train(cw: CallWrapper):
        holder["cw"] = cw
        cw.init_process_group(timeout=300)  # gloo's own timeout is far away
        for step in range(4):
            if rank == 1 and cw.iteration == 0 and step == 2:
                time.sleep(0.3)  # rank 0 is inside the all_reduce by now
                os._exit(0)  # a "clean" exit code, no cleanup, mid-training
            dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
        return {"iteration": cw.iteration, "world": cw.state.active_world_size}

    t0 = time.monotonic()
    ret = train()
    recs = [
        (r.cause, list(r.fault_ranks), round(r.restart_s, 3)) for r in holder["cw"].restart_records
    ]
    return {"ret": ret, "records": recs, "wall": time.monotonic() - t0}


@pytest.mark.timeout(90)
def test_nvrx_143_survivor_blocked_on_a_peer_that_exited_restarts():
    """https://github.com/NVIDIA/nvidia-resiliency-ext/issues/143: can survivors blocked in a
    collective on a peer that exited escape? Rank 1 leaves with ``os._exit(0)`` (exit code 0,
    no cleanup) while rank 0 waits in a gloo all_reduce with a 300 s timeout: rank 0 must be
    interrupted long before that and finish alone in the next iteration.
    """
    res = run_ranks("test_user_reports:peer_exit_rank_main", 2, timeout_s=60, pythonpath=[HERE])
    for r in res:
        print(f"rank {r.rank}: rc={r.returncode} result={r.result}")
    assert res[1].returncode == 0 and res[1].result is None  # it vanished mid-call
    assert res[0].returncode == 0, res[0].stderr[-3000:]
    out = res[0].result
    assert out["ret"] == {"iteration": 1, "world": 1}
    assert [(c, f) for c, f, _ in out["records"]] == [("terminated", [1])], out["records"]
    assert out["records"][0][2] < 10.0  # far below gloo's 300 s
