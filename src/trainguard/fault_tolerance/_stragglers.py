"""Straggler reports in the launcher, from the summaries ranks leave in their slots.

A worker that runs ``trainguard.straggler.Detector`` under ``trainguard launch`` writes its newest
window summary into the extension area of its shared-memory slot (``SlotTransport``). The
launcher maps every local rank's slot already; a daemon thread (``tg-straggler-watch``) reads
those records every ``poll_s`` seconds, scores each window once every local rank published it
(or ``stale_s`` after the first one did, naming the silent ranks) with the detector's own
``Scorer``, logs flagged ranks and keeps them for the launcher's summary table. No collective,
no store and no socket is involved, so a hung rank cannot hold the report up, and nothing
happens when no rank runs a detector (the scorer, which needs no torch, is imported on the
first record).

On one node the local ranks are the job; with several nodes each launcher scores its own node's
ranks against their median.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.fault_tolerance._slot import EXT_BYTES, Slot

__all__ = ["StragglerWatch"]

_log = logging.getLogger("trainguard.fault_tolerance")
_KIND = 1  # straggler window summary (trainguard.straggler._transport.RECORD_KIND)
_RECORDS = 2  # summaries per slot (trainguard.straggler._transport.RECORD_SLOTS)
_IDLE_POLL_S = 0.5


class StragglerWatch:
    """Reads the local slots' straggler records while a cycle runs (see module docstring).

    Args:
        slots: the local ranks' slots, by local rank. rank_of: local rank -> global rank.
        cycle: the cycle number (log lines). poll_s: seconds between reads once records flow
            (0.5 s before the first). stale_s: seconds after which a window is scored without
            the ranks that did not publish it.
    """

    def __init__(self, slots: list[Slot], rank_of: Callable[[int], int], cycle: int,
                 poll_s: float = 0.05, stale_s: float = 5.0) -> None:
        self.slots, self.rank_of, self.cycle = slots, rank_of, cycle
        self.poll_s, self.stale_s = poll_s, stale_s
        self.windows: dict[int, dict[int, dict[str, Any]]] = {}
        self.first_seen: dict[int, float] = {}
        self.scored = 0
        self.last_scored = -1
        self.newest: dict[int, int] = {}  # local rank -> newest window it published
        self.flagged: dict[int, str] = {}  # global rank -> last description, while flagged
        self.ever_flagged: dict[int, str] = {}
        self._scorer: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tg-straggler-watch",
                                        daemon=True)

    def start(self) -> StragglerWatch:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> str:
        """Stop the thread (bounded by ``timeout_s``); returns the summary-table text."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            # one last read: a short cycle (a rank killed within a second) can end between two
            # idle polls, and the records its ranks published are still in the slots
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a bad record must never stop the launcher
                _log.exception("straggler watch: cannot read or score a window")
        if self.scored or self.windows:
            none = ""
            if self.scored and not self.ever_flagged and self._scorer is not None:
                # a callback with its own, tighter thresholds may still report a straggler
                none = (f"; no straggler at the launcher's thresholds (ratio_threshold "
                        f"{self._scorer.config.ratio_threshold:g})")
            _log.info("cycle %d: straggler watch scored %d window(s) from the slots%s%s",
                      self.cycle, self.scored,
                      f", {len(self.windows)} incomplete" if self.windows else "", none)
        return self.table_text()

    def table_text(self) -> str:
        """``"rank 1 (compute, 23 % slower)"``-style text of every rank flagged this cycle."""
        return "; ".join(f"rank {r} ({d})" for r, d in sorted(self.ever_flagged.items()))

    # -- thread --------------------------------------------------------------------------
    def _run(self) -> None:
        # idle (no rank runs a detector) -> look twice a second; once records flow -> poll_s
        while not self._stop.wait(self.poll_s if self.newest else _IDLE_POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a bad record must never stop the launcher
                _log.exception("straggler watch: cannot read or score a window")

    def poll(self) -> None:
        """Read every slot once and score the windows that are complete (any thread, one at a
        time)."""
        for lr, slot in enumerate(self.slots):
            for half in range(_RECORDS):
                rec = slot.read_ext(half * (EXT_BYTES // _RECORDS))
                if rec is None or rec[0] != _KIND:
                    continue
                summary = self._decode(rec[1])
                if summary is None:
                    continue
                window = int(summary["window"])
                self.newest[lr] = max(window, self.newest.get(lr, -1))
                if window <= self.last_scored or lr in self.windows.get(window, {}):
                    continue  # scored already, or already read
                self.windows.setdefault(window, {})[lr] = summary
                self.first_seen.setdefault(window, time.monotonic())
        self._score_ready()

    @staticmethod
    def _decode(body: bytes) -> dict[str, Any] | None:
        try:
            out = json.loads(body)
        except ValueError:
            return None
        ok = isinstance(out, dict) and "window" in out and "metrics" in out
        return out if ok else None

    def _score_ready(self) -> None:
        n = len(self.slots)
        for window in sorted(self.windows):
            got = self.windows[window]
            stale = time.monotonic() - self.first_seen[window] > self.stale_s
            # a missing rank that already published a later window will never send this one
            passed = all(self.newest.get(lr, -1) > window for lr in range(n) if lr not in got)
            if len(got) < n and not stale and not passed:
                return  # windows are scored in order
            self._score(window, got)
            self.last_scored = window
            del self.windows[window]
            self.first_seen.pop(window, None)

    def _score(self, window: int, got: dict[int, dict[str, Any]]) -> None:
        if self._scorer is None:
            from trainguard.straggler.scores import Scorer, ScoringConfig

            self._scorer = Scorer(ScoringConfig(), len(self.slots))
        report = self._scorer.score(window, got)
        self.scored += 1
        now_flagged: dict[int, str] = {}
        for info in report.stragglers:
            rank = self.rank_of(int(info.rank))
            text = f"{info.kind}, {100.0 * (info.ratio - 1.0):.0f} % slower"
            now_flagged[rank] = text
            if rank not in self.flagged:
                _log.warning("cycle %d: straggler rank %d (node %s): %s, costs ~%.0f %% of "
                             "throughput (window %d)", self.cycle, rank, info.node, info.kind,
                             info.est_loss_pct, window)
        for rank in set(self.flagged) - set(now_flagged):
            _log.info("cycle %d: rank %d no longer a straggler (window %d)", self.cycle, rank,
                      window)
        self.flagged = now_flagged
        self.ever_flagged.update(now_flagged)
        for warning in report.warnings:
            _log.debug("straggler watch: %s", warning)
