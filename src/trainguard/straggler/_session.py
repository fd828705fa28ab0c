"""One detector session: the recorder (training thread) and the reporter thread.

The training thread only appends to lists and, every ``window_steps`` steps, puts the closed
window on a queue (no I/O, no lock). A named daemon thread (``tg-straggler``) summarises each
window, publishes it through the transport and, on aggregating ranks, scores every window for
which all ranks reported, or a majority of ranks reported and all of them are already two
windows further, or ``stale_s`` passed since its first summary arrived (then the silent ranks
are listed in ``Report.missing_ranks``). So a hung or dead rank never blocks training or
reporting on the other ranks.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

from trainguard._core.clock import Deadline
from trainguard._core.logging import get_logger
from trainguard.straggler import _actions, _collectives
from trainguard.straggler._recorder import Recorder, WindowData
from trainguard.straggler._stats import median, summarize
from trainguard.straggler._transport import SummaryTransport
from trainguard.straggler.report import Report
from trainguard.straggler.scores import Scorer, ScoringConfig

__all__ = ["Session"]

_STOP = object()
_KEEP_WINDOWS = 16
_HISTORY = 10_000
_FINAL_S = 2.0  # at shutdown: how long to wait for the last windows of the other ranks

log = get_logger("trainguard.straggler")


class Session:
    """State of one ``Detector.initialize`` .. ``Detector.shutdown`` span (see ``Detector``)."""

    def __init__(self, *, rank: int, world_size: int, node: str, window_steps: int,
                 transport: SummaryTransport, scoring: ScoringConfig, aggregate: bool,
                 gather_on_rank0: bool, actions: _actions.Actions, time_collectives: bool,
                 stale_s: float | None, poll_s: float) -> None:
        self.rank, self.world_size, self.node = rank, world_size, node
        self.recorder = Recorder(window_steps)
        self.transport = transport
        self.actions = actions
        self.aggregate = aggregate
        self.gather_on_rank0 = gather_on_rank0
        self.scorer = Scorer(scoring, world_size) if aggregate else None
        self.stale_s = stale_s
        self.poll_s = poll_s
        self.reports: collections.deque[Report] = collections.deque(maxlen=_HISTORY)
        self.reports_made = 0
        self.reports_taken = 0
        self.publish_errors = 0
        self._next_window = 0
        self._first_seen: dict[int, float] = {}
        self._stopping = False
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.wrapped = _collectives.install(self.recorder) if time_collectives else []
        self._thread = threading.Thread(target=self._run, name="tg-straggler", daemon=True)
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------
    def step(self) -> None:
        data = self.recorder.step()
        if data is not None:
            self._queue.put(data)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread: publish queued windows, score what arrives within ``timeout_s``."""
        _collectives.uninstall()
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("straggler: reporter thread still busy after %.1f s; left as daemon",
                        timeout_s)
        self.transport.close()

    # -- reporter thread ---------------------------------------------------------------------
    def _run(self) -> None:
        final = Deadline(0.0)
        stopping = False
        while True:
            try:
                item = self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                stopping, final = True, Deadline(_FINAL_S)
                self._stopping = True
            elif item is not None:
                self._publish(item)
            if self.aggregate:
                self._aggregate()
            if stopping and (not self.aggregate or self._idle() or final.expired()):
                self._cleanup()
                return
            if stopping:
                time.sleep(self.poll_s)

    def _cleanup(self) -> None:
        if self.rank == 0 and self.aggregate:
            for w in range(max(0, self._next_window - _KEEP_WINDOWS), self._next_window):
                self._discard(w)

    def _idle(self) -> bool:
        return self._next_window >= self.recorder.window

    def _publish(self, data: WindowData) -> None:
        m = data["metrics"]
        m["compute"] = [s - w - d for s, w, d in zip(m["step"], m["wait"], m["data"])]
        summary = {
            "rank": self.rank, "node": self.node, "window": data["window"],
            "steps": len(data["metrics"]["step"]), "t_end": time.time(),
            "metrics": {k: list(summarize(v)) for k, v in data["metrics"].items()},
            "sections": {k: list(summarize(v)) for k, v in data["sections"].items() if v},
        }
        try:
            self.transport.publish(summary)
        except Exception as exc:  # noqa: BLE001 - a broken store must not stop training
            self.publish_errors += 1
            if self.publish_errors == 1:
                log.warning("straggler: cannot publish window %s: %s", data["window"], exc)

    def _ready(self, window: int, got: dict[int, Any]) -> bool:
        if len(got) >= self.world_size:
            return True
        now = time.monotonic()
        first = self._first_seen.setdefault(window, now)
        stale_s = self.stale_s
        if stale_s is None:
            steps = [s.get("steps", 0) * (s["metrics"]["step"][0] or 0.0) for s in got.values()]
            stale_s = max(1.0, 3e-3 * median(steps)) if steps else 1.0
        if self._stopping:
            stale_s = min(stale_s, _FINAL_S / 4)
        if now - first > stale_s:
            return True
        ahead = self._collect(window + 2)
        return len(got) > self.world_size // 2 and set(got) <= set(ahead)

    def _collect(self, window: int) -> dict[int, Any]:
        try:
            return self.transport.collect(window)
        except Exception as exc:  # noqa: BLE001 - retried at the next poll
            log.debug("straggler: collect window %s failed: %s", window, exc)
            return {}

    def _aggregate(self) -> None:
        if self.scorer is None:
            return
        while True:
            w = self._next_window
            got = self._collect(w)
            if not got or not self._ready(w, got):
                return
            t0 = time.perf_counter()
            report = self.scorer.score(w, got, rank=self.rank, gather_on_rank0=self.gather_on_rank0)
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            report = _with_elapsed(report, elapsed_ms)
            self._first_seen.pop(w, None)
            self._next_window += 1
            if self.rank == 0 and w >= _KEEP_WINDOWS:
                self._discard(w - _KEEP_WINDOWS)
            with self._lock:
                self.reports.append(report)
                self.reports_made += 1
            _actions.apply(self.actions, report, log)

    def _discard(self, window: int) -> None:
        try:
            self.transport.discard(window)
        except Exception:  # noqa: BLE001, S110 - cleanup is best effort
            pass

    # -- any thread --------------------------------------------------------------------------
    def take_report(self, only_new: bool) -> Report | None:
        if only_new and self.reports_taken == self.reports_made:
            return None  # the per-step case: no lock (two int reads; a racing report waits a step)
        with self._lock:
            if not self.reports or (only_new and self.reports_taken == self.reports_made):
                return None
            self.reports_taken = self.reports_made
            return self.reports[-1]

    def history(self) -> list[Report]:
        with self._lock:
            return list(self.reports)


def _with_elapsed(report: Report, elapsed_ms: float) -> Report:
    import dataclasses

    return dataclasses.replace(report, generate_report_elapsed_time=elapsed_ms)
