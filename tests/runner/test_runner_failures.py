"""Failure outcomes with real faults: crashes, hangs, grandchildren, shared-memory limits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from runner_workers import EchoWorker

from trainguard._core.clock import wait_until
from trainguard._core.procs import pid_alive
from trainguard._core.shm import SHM_DIR, shm_space
from trainguard.runner import (
    DistributedRunner,
    SharedSlotAllocationFailed,
    WorkerCrashed,
    WorkerTimeout,
)
from trainguard.testing import live_children

HERE = os.path.dirname(os.path.abspath(__file__))


def _runner(**kwargs) -> DistributedRunner:
    kwargs.setdefault("world_size", 2)
    r = DistributedRunner(EchoWorker, init_process_group=False, **kwargs)
    r.start()
    return r


@pytest.mark.timeout(60)
def test_dead_rank_surfaces_in_milliseconds_despite_long_call_timeout_then_new_runner_starts():
    r = _runner(call_timeout=600)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashed) as info:
            r.generate(("exit_on", (1, 3)))
        took = time.monotonic() - t0
        print(f"crash noticed after {took * 1e3:.1f} ms (call_timeout 600 s)")
        assert took < 10.0
        assert info.value.rank == 1 and info.value.exitcode == 3
        assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)
        assert not r.healthy
        with pytest.raises(RuntimeError, match="construct a new"):
            r.generate(1)
    finally:
        t0 = time.monotonic()
        r.shutdown()  # rank 0 is still sleeping in generate: it is killed, not awaited
        print(f"shutdown of the surviving rank took {time.monotonic() - t0:.2f} s")
    assert live_children() == []
    r2 = _runner()  # partial crash, then a new runner on the same machine
    try:
        assert r2.generate("again") == "again" and r2.healthy
    finally:
        r2.shutdown()


@pytest.mark.timeout(60)
def test_sigkill_of_rank0_after_result_block_grew_leaves_no_shared_memory():
    r = _runner(shm_bytes=0)
    try:
        big = np.ones(3 << 20, np.float32)  # 12 MiB: rank 0's result slot grows
        assert r.generate(("scale", big))[0] == 2.0
        assert any(n.startswith(r._prefix + "o") for n in os.listdir(SHM_DIR))
        with pytest.raises(WorkerCrashed, match="SIGKILL") as info:
            r.generate(("kill_on", 0))
        assert info.value.rank == 0 and info.value.exitcode == -9
    finally:
        r.shutdown()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(r._prefix)]


@pytest.mark.timeout(60)
def test_sentinel_seen_before_the_reply_pipe_eof_is_still_a_crash():
    """CI flake, kind fixed: a dying rank's pipes close one by one, so its sentinel can wake the
    runner while its reply pipe shows EOF only a moment later. The reply pipe must stay watched:
    the EOF is then read as a crash at once, not left to the call timeout."""
    import signal

    from trainguard._core.clock import Deadline

    r = _runner(call_timeout=30.0)
    try:
        pid = r._procs[0].pid
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(pid), 10.0)
        time.sleep(0.2)  # both pipes now at EOF: replay the order in which the race hurt
        pending = {0}
        r._on_exit(0, pending, "generate")  # the sentinel first; the reply pipe is readable
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashed, match="SIGKILL"):
            list(r._frames(pending, Deadline(5.0), "generate"))
        assert time.monotonic() - t0 < 2.0
    finally:
        r.shutdown()


@pytest.mark.timeout(60)
def test_wedged_rank_times_out_within_call_timeout_and_is_killed_at_shutdown():
    r = _runner(call_timeout=1.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            r.generate(("hang_on", 1))
        took = time.monotonic() - t0
        print(f"WorkerTimeout after {took:.2f} s (call_timeout 1.5 s)")
        assert 1.4 <= took < 6.0
        assert isinstance(info.value, TimeoutError) and info.value.ranks == [1]
        assert not r.healthy
    finally:
        t0 = time.monotonic()
        r.shutdown()
        took = time.monotonic() - t0
        print(f"shutdown of the wedged runner: {took:.2f} s")
    assert took < 8.0
    assert live_children() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poisoned", [False, True])
def test_grandchildren_die_with_their_rank(poisoned):
    r = _runner(call_timeout=1.0)
    try:
        grandchild = r.generate(("spawn_child", None))
        assert pid_alive(grandchild)
        if poisoned:
            with pytest.raises(WorkerTimeout):
                r.generate(("hang_on", 0))
    finally:
        r.shutdown()
    assert wait_until(lambda: not pid_alive(grandchild), 10.0), "grandchild survived shutdown"


@pytest.mark.timeout(60)
def test_view_transfer_hands_out_read_only_views():
    r = _runner(transfer="view")
    try:
        arr = np.arange(500_000, dtype=np.float32)
        total, writeable = r.generate(("sum", arr))
        assert total == pytest.approx(float(arr.sum(dtype=np.float64))) and not writeable
        out = r.generate(("scale", arr))
        np.testing.assert_array_equal(out, arr * 2)
        assert not out.flags.writeable
        out = out.copy()  # views are valid until the next call only
        r.generate(("scale", arr + 1))
        np.testing.assert_array_equal(out, arr * 2)
    finally:
        r.shutdown()


@pytest.mark.timeout(60)
def test_input_larger_than_free_shared_memory_is_refused_cleanly(tmp_path):
    free, _ = shm_space()
    size = free + (256 << 20)
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:  # sparse: costs no disk or memory
        f.truncate(size)
    huge = np.asarray(np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)))  # plain ndarray
    r = _runner()
    try:
        with pytest.raises(SharedSlotAllocationFailed) as info:
            r.generate(("sum", huge))
        err = info.value
        print(err)
        assert isinstance(err, MemoryError)
        assert err.requested_bytes >= size and 0 <= err.free_bytes < size
        assert "--shm-size" in str(err) and "MiB" in str(err)
        assert r.healthy and r.generate(5) == 5  # raised inside the call; still usable
    finally:
        r.shutdown()
        del huge


@pytest.mark.timeout(120)
def test_small_dev_shm_tmpfs_raises_instead_of_sigbus():
    """A 16 MiB /dev/shm (private mount namespace) and a 64 MiB input: no SIGBUS, a clear error."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) not available")
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            "mount -t tmpfs -o size=16m tmpfs /dev/shm"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.decode().strip()}")
    cmd = (
        f"mount -t tmpfs -o size=16m tmpfs /dev/shm && "
        f"exec {sys.executable} {os.path.join(HERE, 'runner_script.py')} small_shm"
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=100, check=False
    )
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Bus error" not in out.stderr
    assert '"event": "refused"' in out.stdout
    assert '"healthy": true' in out.stdout and '"after": 1048576.0' in out.stdout
    assert '"shm": []' in out.stdout  # nothing left in the small tmpfs


@pytest.mark.timeout(60)
def test_stale_segments_of_dead_owners_are_swept_at_start():
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    stale = f"tg_r{int(dead_pid):x}_beef_i0"
    path = os.path.join(SHM_DIR, stale)
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    r = _runner(world_size=1)
    try:
        assert not os.path.exists(path)
    finally:
        r.shutdown()


@pytest.mark.timeout(60)
def test_result_larger_than_free_shared_memory_is_refused_and_runner_stays_usable(tmp_path):
    free, _ = shm_space()
    size = free + (256 << 20)
    path = tmp_path / "sparse_result.bin"
    with open(path, "wb") as f:
        f.truncate(size)
    r = _runner()
    try:
        with pytest.raises(SharedSlotAllocationFailed, match="--shm-size") as info:
            r.generate(("huge_result", (str(path), size)))
        assert info.value.requested_bytes >= size
        assert r.healthy and r.generate("ok") == "ok"
    finally:
        r.shutdown()


@pytest.mark.timeout(60)
def test_rank_dying_during_load_is_worker_crashed_and_slow_load_is_worker_timeout():
    r = DistributedRunner(
        EchoWorker, world_size=2, init_process_group=False, load_kwargs={"exit_load_rank": 1}
    )
    with pytest.raises(WorkerCrashed, match="exit code 5") as info:
        r.start()
    assert info.value.rank == 1 and not r.healthy
    r = DistributedRunner(
        EchoWorker,
        world_size=2,
        init_process_group=False,
        load_kwargs={"sleep": 60},
        start_timeout=1.5,
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout, match="start_timeout") as info:
        r.start()
    took = time.monotonic() - t0
    print(f"start() gave up after {took:.2f} s (start_timeout 1.5 s), ranks killed")
    assert info.value.ranks == [0, 1] and took < 10.0
    assert live_children() == []
