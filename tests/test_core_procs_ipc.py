"""_core mechanisms shared by every capability: tree shutdown and the versioned wire format."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_frame, send_msg
from trainguard._core.procs import terminate_processes

_TREE = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                     start_new_session=True)
print(p.pid, flush=True)
time.sleep(600)
"""


def test_terminate_escalates_to_sigkill_and_sweeps_setsid_descendants():
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    assert psutil.Process(grandchild).ppid() == proc.pid
    t0 = time.monotonic()
    left = terminate_processes([proc], grace_s=0.5)
    took = time.monotonic() - t0
    print(f"terminate took {took:.2f} s")
    assert left == []
    assert proc.returncode == -signal.SIGKILL  # SIGTERM ignored -> SIGKILL after the grace
    assert not psutil.pid_exists(grandchild) or \
        psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert took < 5.5
    proc.stdout.close()


def test_terminate_by_pid_reaps_a_stopped_child_and_spares_the_caller():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    os.kill(proc.pid, signal.SIGSTOP)
    assert terminate_processes([proc.pid, os.getpid()], grace_s=2.0) == []
    assert not psutil.pid_exists(proc.pid)  # reaped through waitpid, not left a zombie
    proc.returncode = 0  # already reaped above; keep Popen's destructor quiet


def test_messages_round_trip_and_reject_other_versions():
    r, w = os.pipe()
    try:
        send_msg(w, 3, {"op": "x", "n": [1, 2]}, b"\x00payload")
        kind, body = FrameReader(r).recv()
        assert kind == 3
        assert decode_msg(body) == ({"op": "x", "n": [1, 2]}, b"\x00payload")
        os.write(w, b"\x09\x01\x00\x00\x00\x00")  # version 9
        with pytest.raises(FrameError, match="version 9"):
            FrameReader(r).recv()
        send_frame(w, 1, b"\x05\x00\x00\x00{}")  # header length past the body
        with pytest.raises(FrameError):
            decode_msg(FrameReader(r).recv()[1])
    finally:
        os.close(r)
        os.close(w)


def test_exit_watch_reports_a_kill_at_once_without_reaping_and_cancel_silences_it():
    import threading

    from trainguard._core.procs import ExitWatch

    got: list[tuple[int, str, float]] = []
    fired = threading.Event()

    def on_exit(pid: int, how: str) -> None:
        got.append((pid, how, time.monotonic()))
        fired.set()

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watch, muted = ExitWatch(killed.pid, on_exit, "t-watch"), ExitWatch(quiet.pid, on_exit, "t-m")
    try:
        time.sleep(0.1)
        assert got == []  # nothing while both run
        muted.cancel()
        t0 = time.monotonic()
        killed.kill()
        quiet.kill()
        assert fired.wait(5.0)
        print(f"on_exit {got[0][2] - t0:.3f} s after the kill: {got}")
        assert [(pid, how) for pid, how, _ in got] == [(killed.pid, "killed by signal SIGKILL")]
        assert killed.wait(5.0) == -signal.SIGKILL  # the owner still reaps its own status
        time.sleep(0.1)
        assert len(got) == 1
        watch.cancel()  # joins the (finished) thread
        assert not any(t.name in ("t-watch", "t-m") for t in threading.enumerate())
    finally:
        watch.cancel()
        muted.cancel()
        for p in (killed, quiet):
            p.kill()
            p.wait(5.0)
