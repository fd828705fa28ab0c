"""Worker bootstrap: runs in every worker before the training script, cold or forked.

* ``PR_SET_PDEATHSIG`` = SIGKILL: the worker dies with its parent (the launcher or the fork
  server), also when that parent is SIGKILLed (torchrun leaves workers running;
  launcher-research.md A8). Descendants that call ``setsid`` are swept by ``_sweeper``.
* The automatic heartbeat (``auto_heartbeat_timeout``): a daemon thread queues one
  ``Py_AddPendingCall`` callback at a time; the main thread runs it at its next bytecode boundary
  and stamps the slot. A main thread stuck in a C call, or any thread holding the GIL, stops the
  stamps. No code change in the script is needed.
* Python stacks on demand: ``faulthandler`` is registered for :data:`STACKS_SIGNAL` (dumps every
  thread's stack to stderr, i.e. the rank's log, without needing the GIL); the slot records it
  so the monitor only sends that signal to ranks that can handle it.
* ``torch.distributed.destroy_process_group`` is guarded (``_core.pg_guard``; installed when the
  script imports torch.distributed, at once in a forked worker): the groups it destroys are
  freed later, never by the script's last reference to a DDP model, whose gloo group destructor
  can deadlock on the GIL (seen: a forked rank stuck in ``std::thread::join`` after its script
  returned, 1 rank of 6 in the simulated-node tests).
* The process title (``ps``, ``/proc/PID/cmdline``) becomes ``trainguard worker rank R (local
  L) : python script.py ARGS`` through ``_core.proctitle`` (``setproctitle``), instead of the
  fork server's or the bootstrap's command line; without that package the title stays and only
  the 15-byte thread name (``ps -o comm``, ``top``) is set, to ``tg-rank-R``.
* Then the script runs as ``python script.py`` / ``python -m module`` would run it, with
  ``sys.argv`` exactly as given; ``--no-python`` execs the command instead.

Cold spawn: ``python -u -m trainguard.fault_tolerance._bootstrap MODE TARGET [ARGS...]``.
Warm spawn: the fork server calls :func:`run_worker` in the forked child.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import runpy
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping

from trainguard._core import pg_guard
from trainguard._core.proctitle import prepare_title, set_title

__all__ = ["STACKS_SIGNAL", "prepare_title", "run_worker", "set_pdeathsig", "worker_title"]

STACKS_SIGNAL = signal.SIGRTMIN + 2  # type: ignore[attr-defined]
_PR_SET_PDEATHSIG = 1
ENV_SLOT = "TRAINGUARD_FT_SLOT"
ENV_AUTO_HB = "TRAINGUARD_FT_AUTO_HB_INTERVAL"


def set_pdeathsig(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; no-op elsewhere).

    If the parent already exited before the call (``getppid`` changed), exit at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(137)


class _AutoHeartbeat:
    """Stamps ``words[AUTO]`` from the main thread every ``interval_s`` (pending calls)."""

    def __init__(self, words: memoryview, index: int, interval_s: float) -> None:
        self.words, self.index, self.interval_s = words, index, interval_s
        self.pending = False
        from trainguard._core.pending import PendingCallback

        self._cb = PendingCallback(self._stamp)  # kept alive: a queued call may run late
        words[index] = time.monotonic_ns()
        threading.Thread(target=self._run, name="tg-ft-auto-heartbeat", daemon=True).start()

    def _stamp(self, _arg: object) -> int:
        self.words[self.index] = time.monotonic_ns()
        self.pending = False
        return 0

    def _run(self) -> None:
        from trainguard._core.pending import add_pending_call as _add_pending_call

        while True:
            time.sleep(self.interval_s)
            if not self.pending:
                self.pending = True
                if not _add_pending_call(self._cb):
                    self.pending = False  # queue full: try again next tick


def _attach_slot() -> None:
    """Attach this rank's slot (if launched with one): auto heartbeat and stack dumps."""
    name = os.environ.get(ENV_SLOT)
    if not name:
        return
    from trainguard.fault_tolerance._client import shared_slot
    from trainguard.fault_tolerance._slot import W

    slot = shared_slot()
    if slot is None:
        return
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    slot.words[W.STACKS_SIG] = int(STACKS_SIGNAL)
    interval = float(os.environ.get(ENV_AUTO_HB, "0") or 0)
    if interval > 0:
        _AutoHeartbeat(slot.words, W.AUTO, interval)
    del name


def _set_path0(entry: str) -> None:
    if sys.path and sys.path[0] in ("", os.getcwd(), entry):
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def worker_title(mode: str, target: str, args: list[str], env: Mapping[str, str]) -> str:
    """The worker's process title: ``trainguard worker rank R (local L) : python TARGET ARGS``
    (``python -m TARGET`` for a module, the bare command for ``exec``); ``?`` for a rank the
    environment (``RANK``, ``LOCAL_RANK``) does not give."""
    cmd = {"module": ["python", "-m", target], "exec": [target]}.get(mode, ["python", target])
    return (f"trainguard worker rank {env.get('RANK', '?')} (local {env.get('LOCAL_RANK', '?')})"
            f" : {shlex.join([*cmd, *args])}")


def _set_title(title: str, rank: str) -> None:
    """Best effort (``_core.proctitle``): the whole title, else the thread name ``tg-rank-R``."""
    set_title(title, f"tg-rank-{rank}")


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_worker(mode: str, target: str, args: list[str]) -> int:
    """Run the training script in this process; returns its exit code (never raises).

    Args:
        mode: ``script`` (``python target``), ``module`` (``python -m target``), ``run_path``
            or ``exec`` (``--no-python``: replace this process).
        target: script path, module name or command.
        args: the script's arguments, verbatim.
    """
    _attach_slot()
    if mode != "exec":  # an exec'd command gets its own title
        _set_title(worker_title(mode, target, args, os.environ), os.environ.get("RANK", "?"))
    if mode == "exec":
        try:
            os.execvp(target, [target, *args])
        except OSError as exc:
            print(f"trainguard launch: cannot exec {target!r}: {exc}", file=sys.stderr)
            return 127
    pg_guard.install_when_imported()
    try:
        sys.argv = [target, *args]
        if mode == "module":  # as python -m: sys.path[0] is the working directory
            _set_path0(os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:  # as python script.py: sys.path[0] is the script's directory
            _set_path0(os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - the worker's uncaught error is printed like python does
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def finish(code: int) -> None:
    """End a forked worker like an interpreter exit (threads joined, atexit run), no unwinding."""
    import atexit

    for step in (threading._shutdown, atexit._run_exitfuncs):  # type: ignore[attr-defined]
        try:
            step()
        except BaseException:  # noqa: BLE001 - the exit code is already decided
            traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main() -> None:
    if len(sys.argv) < 3:
        print("usage: python -m trainguard.fault_tolerance._bootstrap MODE TARGET [ARGS...]",
              file=sys.stderr)
        sys.exit(2)
    parent = int(os.environ.get("TRAINGUARD_FT_PARENT", "0") or 0) or None
    set_pdeathsig(parent)
    mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.exit(run_worker(mode, target, args))


if __name__ == "__main__":
    main()
