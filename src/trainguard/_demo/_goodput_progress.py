"""Live status of ``trainguard demo --duration`` (the goodput run), read from the ranks' events.

One compact line: seconds into training, the job's step, faults injected / recovered of those
planned, the newest committed checkpoint and the goodput so far (the definitions of
``_goodput.figures``, over the steps logged until now). On a terminal it is a rich ``Live``
line refreshed in place; elsewhere (a pipe, a CI log) a plain line is printed every
``interval_s`` seconds and whenever a fault is injected or recovered.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text
from typing_extensions import Self

from trainguard._demo._events import EventTail
from trainguard._demo._goodput import figures

__all__ = ["GoodputProgress"]


class GoodputProgress:
    """Feeds on :data:`trainguard._demo._goodput.OnTick` calls; use as a context manager.

    Args:
        console: where to show the line (a ``Live`` display when it is a terminal).
        duration_s: the run's training seconds (shown as ``t 12/30 s``).
        interval_s: seconds between plain lines when ``console`` is not a terminal.

    Called from the parent's main thread only; a call reads the new event lines (never blocks
    on the ranks) and costs a few milliseconds.
    """

    def __init__(self, console: Console, duration_s: float, interval_s: float = 5.0) -> None:
        self.console = console
        self.duration_s = duration_s
        self.interval_s = interval_s
        self.live: Live | None = None
        self._tail: EventTail | None = None
        self._out = ""
        self._events: list[dict[str, Any]] = []
        self._t_train: float | None = None
        self._line = Text("starting the rank processes (imports, checkpoint writer warm-up)")
        self._printed_at = -1e9
        self._printed_counts: tuple[int, int] = (0, 0)

    def __enter__(self) -> Self:
        if self.console.is_terminal:
            self.live = Live(self._line, console=self.console, refresh_per_second=4)
            self.live.start()
        else:
            self.console.print(self._line, highlight=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def __call__(self, mode: str, out: str, plan: list[dict[str, Any]],
                 disk_fired: list[tuple[int, float, float]]) -> None:
        """Read the new events of ``out`` and update or print the status line."""
        if self._tail is None or out != self._out:  # the first call, or a new mode
            self._out, self._events, self._t_train = out, [], None
            self._tail = EventTail(out, "ev_*.jsonl")
        self._events.extend(self._tail.poll())
        if self._t_train is None:
            self._t_train = _read_t_train(out)
        status = self.status(plan, disk_fired)
        if status is None:
            return
        line, counts = status
        if self.live is not None:
            self.live.update(Text(line))
            return
        now = time.monotonic()
        if now - self._printed_at >= self.interval_s or counts != self._printed_counts:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
            self._printed_at, self._printed_counts = now, counts

    def status(self, plan: list[dict[str, Any]], disk_fired: list[tuple[int, float, float]]
               ) -> tuple[str, tuple[int, int]] | None:
        """The status line and (faults injected, recovered); None before the first step."""
        if self._t_train is None or not any(e.get("ev") == "step" for e in self._events):
            return None
        self._events.sort(key=lambda e: e["t"])
        fig = figures(self._events, plan, disk_fired, self._t_train)
        injected = sum(r["fired"] for r in fig["faults"])
        recovered = sum(bool(r["recovered"]) for r in fig["faults"])
        commits = [e["step"] for e in self._events if e.get("ev") == "commit"]
        elapsed = min(time.time() - self._t_train, self.duration_s)
        line = (f"[{elapsed:4.0f}/{self.duration_s:.0f} s] step {fig['kept_steps']} · faults "
                f"{injected}/{len(plan)} injected, {recovered} recovered · checkpoint "
                + (f"step {max(commits)}" if commits else "none yet")
                + f" · goodput so far {fig['goodput']:.3f}")
        return line, (injected, recovered)


def _read_t_train(out: str) -> float | None:
    try:
        with open(os.path.join(out, "t_train")) as fh:
            text = fh.read()
        return float(text) if text else None
    except (OSError, ValueError):
        return None
