"""Fault injection inside a demo rank: each scheduled fault fires once, at the start of its step.

A fault is claimed by creating its marker file with ``O_CREAT | O_EXCL`` before it fires, so it
fires once per run even though restarts re-execute the steps after the last checkpoint, and
even though a SIGKILL leaves no chance to record anything afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import time

from trainguard._demo._config import DemoConfig
from trainguard._demo._events import EventLog

__all__ = ["DemoFault", "FaultInjector"]

HANG_S = 3600.0  # a "hang": far longer than any timeout; the wrapper must interrupt it


class DemoFault(RuntimeError):
    """The injected Python exception (an ``Exception``, so every rank restarts in-process)."""


class FaultInjector:
    """Fires this rank's scheduled faults.

    Args:
        config: the run configuration (schedule and marker paths).
        rank: this process's initial rank.
        log: the rank's event log; a ``fault`` event is written (and flushed) before firing.
    """

    def __init__(self, config: DemoConfig, rank: int, log: EventLog) -> None:
        self.config = config
        self.log = log
        self.mine = {i: f for i, f in enumerate(config.faults) if f.rank == rank}

    def _claim(self, index: int, record: dict) -> bool:
        try:
            fd = os.open(
                self.config.marker_path(index), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
            )
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        return True

    def maybe_fire(self, step: int, iteration: int) -> None:
        """Fire the fault scheduled for ``step`` on this rank, unless it already fired.

        Raises:
            DemoFault: the scheduled fault is an ``exception``.
        """
        for index, fault in self.mine.items():
            if fault.step != step:
                continue
            record = {"kind": fault.kind, "step": step, "index": index, "iteration": iteration}
            if not self._claim(index, {**record, "t": time.time()}):
                continue  # fired before this restart
            self.log.emit("fault", **record)
            self._fire(fault.kind, step)

    def _fire(self, kind: str, step: int) -> None:
        if kind == "exception":
            raise DemoFault(f"injected exception at step {step}")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(HANG_S)  # not reached: SIGKILL cannot be caught
        if kind == "hang":
            time.sleep(HANG_S)  # a C call that releases the GIL; only the wrapper gets us out
