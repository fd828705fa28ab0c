"""Per-rank timing on the training thread: steps, named sections, collectives, data-loader wait.

Everything here runs on the caller's thread and only appends integers to lists; summaries are
computed later, off the training thread. One mark (section entry + exit) costs two
``perf_counter_ns`` calls and a list append (measured by ``bench/straggler.py``, ``mark_us``).

Per step the recorder derives (all in ns, summarised in ms per window):

* ``step``: time between two step marks;
* ``wait``: time inside the wrapped ``torch.distributed`` collectives during the step;
* ``data``: time inside :meth:`Recorder.data_wait` / :func:`wrap_dataloader` during the step;
* ``compute``: ``step - wait - data``, the work the rank itself controls.

Named sections record their duration *minus* the collective time spent inside them, so a
section that contains an all-reduce still measures this rank's own work (NVRx's section time
includes the wait, which makes the straggler look fastest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter_ns
from typing import Any, TypeVar

__all__ = ["DataWait", "Recorder", "Section", "WindowData"]

T = TypeVar("T")

# One closed window of raw per-step and per-call values (ns), handed to the publisher thread.
WindowData = dict[str, Any]


class Section:
    """A named, reusable timing section: a context manager and a decorator.

    Entry and exit are cheap (two clock reads, one append); a section may be nested and re-entered.
    If the body raises, nothing is recorded (as NVRx does).
    """

    __slots__ = ("_durations", "_rec", "_starts", "name")

    def __init__(self, rec: Recorder, name: str) -> None:
        self._rec = rec
        self.name = name
        self._starts: list[tuple[int, int]] = []
        self._durations: list[int] = []

    def __enter__(self) -> Section:  # noqa: PYI034 - final class in practice
        self._starts.append((perf_counter_ns(), self._rec.coll_ns))
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        t0, c0 = self._starts.pop()
        if exc_type is None:
            self._durations.append(perf_counter_ns() - t0 - (self._rec.coll_ns - c0))

    def __call__(self, fn: Callable[..., T]) -> Callable[..., T]:
        section = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            with section:
                return fn(*args, **kwargs)

        return wrapper

    def take(self) -> list[int]:
        """Durations recorded since the last call (ns), and start a new list."""
        out, self._durations = self._durations, []
        return out


class DataWait:
    """Context manager adding its body's duration to the current step's data-loader wait."""

    __slots__ = ("_rec", "_t0")

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec
        self._t0 = 0

    def __enter__(self) -> DataWait:  # noqa: PYI034
        self._t0 = perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._rec.data_ns += perf_counter_ns() - self._t0


class Recorder:
    """Counters and per-window lists of one rank; owned by the training thread.

    ``window_steps`` steps make one window; :meth:`step` returns the closed window's data every
    ``window_steps`` steps (else None). The first :meth:`step` call only starts the clock.
    """

    def __init__(self, window_steps: int) -> None:
        self.window_steps = window_steps
        self.coll_ns = 0  # cumulative time inside wrapped collectives
        self.data_ns = 0  # cumulative data-loader wait
        self.in_collective = False
        self.cuda: Any = None  # a _cuda.CudaEventTimer when collectives run on CUDA tensors
        self.sections: dict[str, Section] = {}
        self.steps_total = 0
        self.window = 0
        self._t0 = 0
        self._coll0 = 0
        self._data0 = 0
        self._step: list[int] = []
        self._wait: list[int] = []
        self._data: list[int] = []

    def section(self, name: str) -> Section:
        sec = self.sections.get(name)
        if sec is None:
            sec = self.sections[name] = Section(self, name)
        return sec

    def data_wait(self) -> DataWait:
        return DataWait(self)

    def step(self) -> WindowData | None:
        """Mark a step boundary; returns a closed window every ``window_steps`` steps."""
        now = perf_counter_ns()
        if self.cuda is not None and self.cuda.pending:
            self.coll_ns += self.cuda.resolve()
        coll, data = self.coll_ns, self.data_ns
        if self._t0:
            self._step.append(now - self._t0)
            self._wait.append(coll - self._coll0)
            self._data.append(data - self._data0)
        self._t0, self._coll0, self._data0 = now, coll, data
        if len(self._step) < self.window_steps:
            return None
        return self._close()

    def _close(self) -> WindowData:
        step, wait, data = self._step, self._wait, self._data
        self._step, self._wait, self._data = [], [], []
        out: WindowData = {  # compute (= step - wait - data) is derived off this thread
            "window": self.window,
            "metrics": {"step": step, "wait": wait, "data": data},
            "sections": {name: sec.take() for name, sec in self.sections.items()},
        }
        self.window += 1
        self.steps_total += len(step)
        return out


def wrap_dataloader(rec: Recorder, iterable: Iterable[T]) -> Iterator[T]:
    """Yield from ``iterable``, adding the time each ``next()`` takes to the data-loader wait."""
    it = iter(iterable)
    while True:
        t0 = perf_counter_ns()
        try:
            item = next(it)
        except StopIteration:
            return
        rec.data_ns += perf_counter_ns() - t0
        yield item
