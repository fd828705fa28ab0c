"""Progress watchdog: the trainer's liveness stamps, shared with its monitor process.

:class:`ProgressBlock` is an unnamed shared mapping from ``_core.shm.fork_shared`` (created
before the monitor process is forked, so it has no /dev/shm name to leak) holding doubles: the
automatic stamp, the manual stamp, flags and the current iteration. The monitor process reads
it on its own clock, so deadline checks cannot be starved by a message stream (NVRx defect 9).

:class:`ProgressWatchdog` is a thread that, every interval, queues one ``Py_AddPendingCall``
callback (at most one outstanding, so CPython's small pending-call queue never fills). The main
thread runs it at its next bytecode boundary and stamps ``time.monotonic()``; a main thread stuck
in C code (with or without the GIL) stops stamping. A pure-Python livelock keeps stamping, which
is what the manual ``ping()`` stamp covers. The thread also notes whether the main thread is
blocked inside ``torch.distributed``/autograd (waiting on a peer), so the monitor process can let
the truly hung rank report a soft timeout first.

Follows: NVRx ProgressWatchdog; differences: shared memory instead of a queue, one outstanding
pending call, collective-wait classification.
"""

from __future__ import annotations

import enum
import sys
import threading
import time

from trainguard._core.pending import PendingCallback, add_pending_call
from trainguard._core.shm import fork_shared

__all__ = ["Phase", "ProgressBlock", "ProgressWatchdog"]

_FIELDS = (
    "auto",  # monotonic time of the last automatic stamp
    "manual",  # monotonic time of the last ping(); 0 = not armed this iteration
    "disabled",  # > 0 while disable_hang_protection() is active
    "iteration",
    "rank",  # current wrapper-level rank (-1 if none)
    "world_size",  # current wrapper-level world size
    "in_collective",  # 1 when the main thread was last seen inside torch.distributed/autograd
    "phase",  # see Phase
    "soft_fired",  # iteration whose soft timeout the monitor already handled (-1 none)
    "done_ticks",  # pending callbacks executed (diagnostics)
    "sampled_at",  # monotonic time in_collective was last computed (stale: GIL held/stopped)
)
_INDEX = {name: i for i, name in enumerate(_FIELDS)}


class Phase(enum.IntEnum):
    """Values of the shared ``phase`` field (stored as a double); deadlines are enforced only in
    RUNNING.

    Transitions (written by the trainer, read by its monitor process): SETUP -> RUNNING when an
    iteration begins; RUNNING -> RUNNING at each later iteration; RUNNING or SETUP -> DONE when the
    call ends (completed, or the rank leaves through a BaseException) or when the monitor process
    reported the trainer's death or killed it. DONE is final for the call.
    """

    SETUP = 0
    RUNNING = 1
    DONE = 2


class ProgressBlock:
    """Doubles in a ``_core.shm.fork_shared`` mapping; aligned 8-byte stores are atomic.

    Raises (constructor):
        ShmAllocationError: no memory for the block.
    """

    def __init__(self) -> None:
        self._mm = fork_shared("tg_progress", 8 * len(_FIELDS))
        self._v = memoryview(self._mm).cast("d")
        self.set("rank", -1)
        self.set("soft_fired", -1)
        self.touch()

    def get(self, name: str) -> float:
        return self._v[_INDEX[name]]

    def set(self, name: str, value: float) -> None:
        self._v[_INDEX[name]] = float(value)

    def touch(self) -> None:
        """Fresh automatic stamp (called by the main thread between bounded waits, too)."""
        self._v[0] = time.monotonic()

    def waiting_on_peer(self, max_sample_age_s: float) -> bool:
        """Main thread seen inside a collective by a recent sample (a stale sample means the
        watchdog thread could not run: GIL held or process stopped, i.e. a local hang)."""
        fresh = time.monotonic() - self._v[_INDEX["sampled_at"]] <= max_sample_age_s
        return fresh and self._v[_INDEX["in_collective"]] > 0

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the older of the automatic and (armed) manual stamps."""
        now = time.monotonic() if now is None else now
        manual = self._v[1]
        return max(now - self._v[0], now - manual if manual > 0 else 0.0)


# One callback object for the interpreter's lifetime: a queued pending call may run after the
# watchdog that queued it has stopped, so the function pointer must never be freed.
_target: ProgressBlock | None = None


def _stamp(_arg: int | None) -> int:
    block = _target
    if block is not None:
        block.touch()
        block.set("done_ticks", block.get("done_ticks") + 1)
    return 0


_STAMP_CALLBACK = PendingCallback(_stamp)

_COLLECTIVE_PATHS = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")


def _in_collective(frame) -> bool:
    depth = 0
    while frame is not None and depth < 12:
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(p in name for p in _COLLECTIVE_PATHS):
            return True
        frame = frame.f_back
        depth += 1
    return False


class ProgressWatchdog:
    """Automatic heartbeat thread of the trainer (daemon, named ``trainguard-watchdog``).

    Args:
        block: the shared progress block.
        interval_s: seconds between pending-call stamps.
    """

    def __init__(self, block: ProgressBlock, interval_s: float) -> None:
        self.block = block
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._main_ident = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="trainguard-watchdog", daemon=True)

    def start(self) -> None:
        global _target
        _target = self.block
        self._thread.start()

    def _run(self) -> None:
        last_done = -1.0
        while not self._stop.wait(self.interval_s):
            done = self.block.get("done_ticks")
            if done != last_done:  # previous callback ran: queue the next one
                last_done = done
                add_pending_call(_STAMP_CALLBACK)
            frame = sys._current_frames().get(self._main_ident)
            self.block.set("in_collective", 1.0 if _in_collective(frame) else 0.0)
            self.block.set("sampled_at", time.monotonic())
            del frame

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (idempotent); joins at most ``timeout_s`` seconds."""
        global _target
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if _target is self.block:
            _target = None
