"""Whole-program behaviour: killed parent, Ctrl-C, exit without shutdown (subprocess programs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainguard._core.clock import wait_until
from trainguard._core.procs import pid_alive, terminate_processes
from trainguard._core.shm import SHM_DIR

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner_script.py")


class Program:
    """runner_script.py in its own session (= its own foreground process group, like a shell)."""

    def __init__(self, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, SCRIPT, mode], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.events: list[dict] = []

    def wait_event(self, name: str, timeout_s: float = 60.0) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            line = self.proc.stdout.readline()  # the program flushes every event line
            if not line:
                break
            self.events.append(json.loads(line))
            if self.events[-1]["event"] == name:
                return self.events[-1]
        self.proc.kill()
        raise AssertionError(f"no {name!r} event; got {self.events}; "
                             f"stderr: {self.proc.stderr.read()[-3000:]}")

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        finally:
            terminate_processes([self.proc], grace_s=1.0)
        for line in out.splitlines():
            self.events.append(json.loads(line))
        return self.proc.returncode, err


def _rank_pids(prefix_event: dict) -> list[int]:
    return [prefix_event["rank0"], prefix_event["grandchild"]]


def _shm_of(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_parent_takes_ranks_grandchildren_and_shared_memory_with_it(sig):
    prog = Program("hang_call")
    ev = prog.wait_event("started")
    prog.wait_event("calling")
    rank_pids = [c for c in _children_of(prog.proc.pid)]
    assert len(rank_pids) >= 2
    time.sleep(0.3)  # the ranks are inside generate()
    assert _shm_of(ev["prefix"]), "the in-flight input generation should still be named"
    os.kill(prog.proc.pid, sig)
    prog.finish()
    watched = rank_pids + [ev["grandchild"]]
    t0 = time.monotonic()
    gone = wait_until(lambda: not any(pid_alive(p) for p in watched), 15.0)
    print(f"{signal.Signals(sig).name}: ranks and grandchild gone after "
          f"{time.monotonic() - t0:.2f} s")
    assert gone, [p for p in watched if pid_alive(p)]
    assert wait_until(lambda: not _shm_of(ev["prefix"]), 5.0), _shm_of(ev["prefix"])


@pytest.mark.timeout(90)
def test_ctrl_c_mid_call_interrupts_caller_only_and_poisons_the_runner():
    prog = Program("hang_call")
    ev = prog.wait_event("started")
    prog.wait_event("calling")
    time.sleep(0.3)
    os.killpg(prog.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    t0 = time.monotonic()
    intr = prog.wait_event("interrupted")
    assert intr["healthy"] is False  # in-flight answers must not be read by the next call
    assert intr["ranks_alive"] == [True, True]  # ranks are in their own groups: not hit
    prog.wait_event("shut down")
    print(f"interrupt -> shut down in {time.monotonic() - t0:.2f} s")
    code, err = prog.finish()
    assert code == 0, err[-3000:]
    assert not pid_alive(ev["rank0"]) and not pid_alive(ev["grandchild"])
    assert not _shm_of(ev["prefix"])


@pytest.mark.timeout(90)
def test_exit_without_shutdown_is_prompt_and_clean():
    prog = Program("no_shutdown")
    ev = prog.wait_event("started")
    prog.wait_event("exiting")
    t0 = time.monotonic()
    code, err = prog.finish(timeout_s=40)
    took = time.monotonic() - t0
    print(f"interpreter exit with live ranks took {took:.2f} s")
    assert code == 0, err[-3000:]
    assert took < 20.0
    assert "leaked" not in err and "Traceback" not in err and "Warning" not in err, err[-3000:]
    assert not pid_alive(ev["rank0"]) and not pid_alive(ev["grandchild"])
    assert not _shm_of(ev["prefix"])


@pytest.mark.timeout(90)
def test_ctrl_c_during_start_leaves_no_process():
    prog = Program("interrupt_start")
    prog.wait_event("starting")
    assert wait_until(lambda: len(_children_of(prog.proc.pid)) >= 2, 30.0)
    ranks = _children_of(prog.proc.pid)
    time.sleep(0.3)
    os.killpg(prog.proc.pid, signal.SIGINT)
    prog.wait_event("interrupted")
    code, err = prog.finish()
    assert code == 0, err[-3000:]
    assert wait_until(lambda: not any(pid_alive(p) for p in ranks), 5.0)


def _children_of(pid: int) -> list[int]:
    import psutil

    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [k.pid for k in kids if "resource_tracker" not in " ".join(k.cmdline())]


@pytest.mark.timeout(120)
def test_example_program_runs():
    example = os.path.join(os.path.dirname(SCRIPT), "..", "..", "examples", "runner_echo.py")
    out = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=110,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "x6.0 after 1 call(s)" in out.stdout and "healthy=True" in out.stdout
    assert "after reset: calls=1" in out.stdout
