"""Contract of DistributedRunner on one shared, healthy world_size=2 runner (no process group)."""

from __future__ import annotations

import time

import numpy as np
import psutil
import pytest
from runner_workers import EchoWorker, NoReset, PlainWorker

from trainguard.runner import DistributedRunner, DistributedWorker, RankDesync
from trainguard.testing import live_children


def _child_pids() -> set[int]:
    return {p.pid for p in live_children()}


@pytest.fixture(scope="module")
def runner():
    r = DistributedRunner(EchoWorker, world_size=2, init_process_group=False,
                          load_kwargs={"path": "/models/x", "n": 3}, call_timeout=60,
                          shm_bytes=32 << 20)  # reserved up front: no growth during tests
    r.start()
    yield r
    r.shutdown()


def test_rank_world_size_device_and_load_kwargs_reach_every_rank(runner):
    info = runner.generate(("info", None))
    assert info["rank"] == 0 and info["leader"] is True  # rank 0's result only
    assert info["world_size"] == 2 and runner.world_size == 2
    assert info["device"] == "cpu" and info["env_rank"] == "0"
    assert info["kwargs"] == {"path": "/models/x", "n": 3}
    assert info["torch"] is False  # a torch-free worker does not pay for importing torch
    assert runner.healthy


def test_plain_values_and_arrays_round_trip(runner):
    assert runner.generate({"a": [1, 2], "b": "x"}) == {"a": [1, 2], "b": "x"}
    big = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)
    total, writeable = runner.generate(("sum", big))
    assert total == pytest.approx(float(big.astype(np.float64).sum()))
    assert writeable  # transfer="copy": workers own a writable copy
    out = runner.generate(("scale", big))
    np.testing.assert_array_equal(out, big * 2)
    assert out.flags.writeable and out.flags.c_contiguous
    strided = big[::3]  # non-contiguous: travels inline, still correct
    assert runner.generate(("sum", strided))[0] == pytest.approx(
        float(strided.sum(dtype=np.float64))
    )


def test_received_arrays_are_never_overwritten_by_later_calls(runner):
    first = runner.generate(("scale", np.full(300_000, 1.0, np.float32)))
    second = runner.generate(("scale", np.full(300_000, 5.0, np.float32)))
    assert first[0] == 2.0 and first[-1] == 2.0, "an earlier result was overwritten"
    assert second[0] == 10.0
    # A worker that keeps its input array across calls must keep seeing the old values.
    kept = runner.generate(("keep", np.full(200_000, 1.0, np.float32)))
    again = runner.generate(("keep", np.full(200_000, 9.0, np.float32)))
    assert kept == again == 200_000.0


def test_reset_reaches_every_rank_and_keeps_state(runner):
    before = runner.generate(("info", None))["resets"]
    runner.reset()
    runner.reset()
    assert runner.generate(("info", None))["resets"] == before + 2
    assert runner.healthy


def test_same_exception_type_on_all_ranks_reaches_caller_and_runner_stays_healthy(runner):
    with pytest.raises(ValueError, match="bad input on rank 0"):
        runner.generate(("raise_all", None))
    assert runner.healthy
    assert runner.generate("still works") == "still works"


def test_unpicklable_exception_becomes_runtime_error_with_type_and_message(runner):
    with pytest.raises(RuntimeError) as info:
        runner.generate(("raise_unpicklable", None))
    assert type(info.value) is RuntimeError
    assert "runner_workers.NeedsCode: custom failure on rank 0" in str(info.value)
    assert runner.healthy


def test_unpicklable_input_raises_in_caller_and_keeps_runner(runner):
    with pytest.raises((TypeError, AttributeError, Exception)) as info:
        runner.generate(lambda: 1)
    assert "pickle" in str(info.value).lower()
    assert runner.healthy and runner.generate(1) == 1


def test_rank_processes_are_titled_with_their_rank(runner):
    titles = sorted(" ".join(c.cmdline()).strip() for c in live_children())
    ranks = [t for t in titles if t.startswith("trainguard: rank")]
    assert ranks == ["trainguard: rank 0 runner worker", "trainguard: rank 1 runner worker"], titles


def test_idle_ranks_use_almost_no_cpu_and_answer_after_idle(runner):
    pids = [c.pid for c in live_children() if "runner worker" in " ".join(c.cmdline())]
    procs = [psutil.Process(p) for p in pids]
    assert len(procs) >= 2
    before = [sum(p.cpu_times()[:2]) for p in procs]
    idle_s = 3.0
    time.sleep(idle_s)
    used = [(sum(p.cpu_times()[:2]) - b) / idle_s * 100 for p, b in zip(procs, before)]
    print(f"idle CPU per rank over {idle_s} s: {[f'{u:.2f}%' for u in used]}")
    assert all(u < 2.0 for u in used), used
    t0 = time.perf_counter()
    assert runner.generate(7) == 7
    first_call_s = time.perf_counter() - t0
    print(f"first call after idle: {first_call_s * 1e3:.2f} ms")
    assert first_call_s < 1.0


def test_second_start_is_refused(runner):
    with pytest.raises(RuntimeError, match="starts once"):
        runner.start()


# -- constructor validation: no process is ever started -----------------------------------------
@pytest.mark.parametrize("world_size", [0, -1, 1.0, "2", True, None])
def test_bad_world_size_is_a_value_error(world_size):
    with pytest.raises(ValueError, match="world_size"):
        DistributedRunner(EchoWorker, world_size=world_size)


def test_missing_methods_are_named():
    with pytest.raises(TypeError, match="reset"):
        DistributedRunner(NoReset)
    with pytest.raises(TypeError, match="class"):
        DistributedRunner(EchoWorker())


def test_worker_class_defined_in_a_function_is_refused_before_spawning():
    class LocalWorker(DistributedWorker):
        def load(self):
            pass

        def generate(self, x):
            return x

    before = _child_pids()
    with pytest.raises(TypeError, match="top level"):
        DistributedRunner(LocalWorker, world_size=2)
    assert _child_pids() == before


def test_unpicklable_load_kwargs_name_the_key():
    with pytest.raises(TypeError, match="'callback'"):
        DistributedRunner(EchoWorker, load_kwargs={"ok": 1, "callback": lambda: 0})
    with pytest.raises(TypeError, match="dict"):
        DistributedRunner(EchoWorker, load_kwargs=[("a", 1)])


@pytest.mark.parametrize(
    "kwargs", [{"call_timeout": 0}, {"start_timeout": -1}, {"transfer": "mmap"}, {"shm_bytes": -5}]
)
def test_bad_options_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        DistributedRunner(EchoWorker, **kwargs)


def test_calls_before_start_and_after_shutdown_are_refused():
    r = DistributedRunner(PlainWorker, init_process_group=False)
    assert not r.healthy
    with pytest.raises(RuntimeError, match="start"):
        r.generate(1)
    r.shutdown()
    r.shutdown()  # idempotent
    with pytest.raises(RuntimeError):
        r.reset()


def test_plain_three_method_class_single_rank_in_a_separate_process():
    with DistributedRunner(PlainWorker, load_kwargs={"offset": 10}) as r:
        # world_size=1 skips process-group initialisation even with init_process_group=True
        assert r.generate(5) == 15 and r.healthy
    assert not r.healthy
    r.shutdown()


def test_mixed_success_is_rank_desync_and_poisons_the_runner():
    r = DistributedRunner(EchoWorker, world_size=2, init_process_group=False)
    r.start()
    try:
        with pytest.raises(RankDesync) as info:
            r.generate(("raise_on", 1))
        assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)
        assert isinstance(info.value, RuntimeError) and not r.healthy
        with pytest.raises(RuntimeError, match="construct a new"):
            r.generate(1)
    finally:
        r.shutdown()


def test_different_exception_types_are_rank_desync():
    r = DistributedRunner(EchoWorker, world_size=2, init_process_group=False)
    r.start()
    try:
        with pytest.raises(RankDesync) as info:
            r.generate(("mixed_types", None))
        assert info.value.rank == 0 and info.value.outcomes[1] == "builtins.KeyError"
        assert not r.healthy
    finally:
        r.shutdown()


def test_load_failure_reaches_caller_unchanged_and_leaves_no_process():
    r = DistributedRunner(
        EchoWorker, world_size=2, init_process_group=False, load_kwargs={"fail_load_rank": 1}
    )
    before = _child_pids()
    with pytest.raises(KeyError, match="load failed on rank 1"):
        r.start()
    assert not r.healthy
    assert _child_pids() == before  # every rank was ended and reaped before the raise
    with pytest.raises(RuntimeError, match="starts once"):
        r.start()
