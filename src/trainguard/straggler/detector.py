"""``Detector``: the NVRx-compatible entry point of straggler detection.

Typical loop (see the README)::

    from trainguard.straggler import Detector

    Detector.initialize(window_steps=20, run_dir="runs/x")   # after init_process_group
    for batch in Detector.wrap_dataloader(loader):
        with Detector.detection_section("fwd_bwd"):
            loss = model(batch).sum(); loss.backward()
        dist.all_reduce(grad)                  # timed as collective wait automatically
        report = Detector.generate_report_if_interval_elapsed()   # marks the step
        if report is not None:
            print(report.summary_line())
    Detector.shutdown()

Follows: NVRx ``attribution.straggler.Detector`` (classmethod singleton; same method names and
``initialize`` arguments). Differences, deliberate:

* runs on CPU (no CUPTI import; GPU kernel scores are empty without a kernel timer);
* reporting is not a collective: summaries go through a transport (the c10d store by default)
  and a background thread scores them, so calling the report methods on some ranks only, or a hung
  rank, never blocks anyone;
* every section entry is measured (``profiling_interval`` is accepted and ignored: a mark costs
  well under 1 µs); section time excludes time in wrapped collectives;
* ``detection_section()`` needs a name as a context manager (NVRx derives ``file:line`` from the
  caller's frame); as a decorator it defaults to the function's qualified name.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from trainguard._core.logging import get_logger
from trainguard.straggler._actions import Actions
from trainguard.straggler._recorder import DataWait, Section, wrap_dataloader
from trainguard.straggler._session import Session
from trainguard.straggler._transport import (
    MemoryTransport,
    SlotTransport,
    StoreTransport,
    SummaryTransport,
)
from trainguard.straggler.errors import StragglerConfigError, StragglerError
from trainguard.straggler.report import Report
from trainguard.straggler.scores import ScoringConfig

__all__ = ["CallableId", "Detector"]

T = TypeVar("T")
_SCORES = ("relative_perf_scores", "individual_perf_scores")
_init_count = itertools.count()
log = get_logger("trainguard.straggler")
_ABSENT = object()  # the wrapped attribute was inherited, not set on the object itself
_NO_WINDOW = ("no window scored yet: fewer than window_steps steps marked, or summaries still in "
              "flight; no verdict")


@dataclasses.dataclass(frozen=True)
class CallableId:
    """A callable to time: attribute ``name`` of ``obj`` (NVRx-compatible).

    ``arg_filter_fn``, ``extra_args_fn`` and ``ignored_args`` are accepted for compatibility and
    unused (as in NVRx).
    """

    obj: Any
    name: str
    arg_filter_fn: Callable[..., Any] | None = None
    extra_args_fn: Callable[..., Any] | None = None
    ignored_args: tuple[str, ...] = ()


class _DecoratorSection:
    """``detection_section()`` used without a name: a decorator named after the function."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def __call__(self, fn: Callable[..., T]) -> Callable[..., T]:
        return self._session.recorder.section(fn.__qualname__)(fn)

    def __enter__(self) -> None:
        raise StragglerConfigError(
            "detection_section() needs a name when used as a context manager, e.g. "
            "`with Detector.detection_section('forward'):`")

    def __exit__(self, *exc: object) -> None:
        return None


def _default_transport(rank: int, world_size: int, store: Any) -> SummaryTransport:
    inner = _in_job_transport(world_size, store)
    if SlotTransport.available():  # under trainguard launch: the launcher reads the slot too
        try:
            return SlotTransport(inner)
        except (OSError, ValueError) as exc:
            log.warning("straggler: launcher slot unusable (%s); summaries go through the "
                        "store only", exc)
    return inner


def _in_job_transport(world_size: int, store: Any) -> SummaryTransport:
    if store is None and dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    if store is None:
        if world_size > 1:
            raise StragglerConfigError(
                f"world_size={world_size} but no store: call init_process_group first, or pass "
                "store= or transport= to Detector.initialize")
        return MemoryTransport()
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("TRAINGUARD_RUN_ID") or "run"
    return StoreTransport(store, f"tg_straggler/{run}/{next(_init_count)}")


class Detector:
    """Process-wide straggler detector; all methods are classmethods.

    Thread: call from the training thread. Nothing here blocks on other ranks.

    Raises:
        StragglerError: instantiating the class; using it before :meth:`initialize`.
    """

    _session: Session | None = None
    _report_interval_s: float = 60.0
    _last_report_t: float = 0.0
    _explicit_steps: bool = False
    _wrapped: list[tuple[Any, str, Any]] = []  # noqa: RUF012 - replaced at initialize
    _last_history: list[Report] = []  # noqa: RUF012 - replaced at shutdown

    def __new__(cls, *args: Any, **kwargs: Any) -> Detector:  # noqa: PYI034
        raise StragglerError("Detector is a singleton of classmethods; call "
                             "Detector.initialize(...) instead of Detector()")

    @classmethod
    def initialize(
        cls,
        scores_to_compute: str | Sequence[str] = "all",
        gather_on_rank0: bool = True,
        profiling_interval: int = 1,
        report_time_interval: float = 60.0,
        node_name: str | None = None,
        *,
        window_steps: int = 20,
        scoring: ScoringConfig | None = None,
        actions: Actions | None = None,
        store: Any = None,
        transport: SummaryTransport | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        time_collectives: bool = True,
        stale_s: float | None = None,
        poll_s: float = 0.05,
    ) -> None:
        """Start detection on this rank (call once per rank, after ``init_process_group``).

        Args:
            scores_to_compute: ``"all"`` or a subset of ``relative_perf_scores`` /
                ``individual_perf_scores`` (both are always computed; kept for NVRx users).
            gather_on_rank0: only rank 0 scores and gets reports; False: every rank does (each
                reads all summaries from the store; still no collective).
            profiling_interval: accepted for NVRx compatibility; every entry is measured.
            report_time_interval: seconds; minimum spacing of reports returned by
                :meth:`generate_report_if_interval_elapsed`.
            node_name: node label in reports; default ``socket.gethostname()``.
            window_steps: steps per summary window (scores are per window).
            scoring: thresholds, see :class:`ScoringConfig`.
            actions: log / metrics / report files / exclusion, all off by default.
            store / transport: where summaries go (default: the default process group's store;
                a process-local transport when running without ``torch.distributed``).
            rank / world_size: default from ``torch.distributed``, else ``RANK``/``WORLD_SIZE``.
            time_collectives: wrap ``torch.distributed`` collectives to time collective wait.
            stale_s: seconds after which a window is scored without the ranks that did not
                report (default: 3 window durations, at least 1 s).
            poll_s: reporter-thread poll period in seconds.

        Raises:
            StragglerError: already initialized (call :meth:`shutdown` first).
            StragglerConfigError: an invalid argument (the message says which and how to fix it).
        """
        if cls._session is not None:
            raise StragglerError("Detector is already initialized; call Detector.shutdown() "
                                 "before initializing again")
        _check_scores(scores_to_compute)
        for name, value in (("profiling_interval", profiling_interval),
                            ("window_steps", window_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StragglerConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not report_time_interval >= 0 or not poll_s > 0:
            raise StragglerConfigError(
                f"report_time_interval must be >= 0 s and poll_s > 0 s, got "
                f"{report_time_interval!r} and {poll_s!r}")
        rank, world_size = _rank_world(rank, world_size)
        cls._session = Session(
            rank=rank, world_size=world_size, node=node_name or socket.gethostname(),
            window_steps=window_steps,
            transport=transport or _default_transport(rank, world_size, store),
            scoring=scoring or ScoringConfig(), aggregate=(rank == 0 or not gather_on_rank0),
            gather_on_rank0=gather_on_rank0, actions=actions or Actions(),
            time_collectives=time_collectives, stale_s=stale_s, poll_s=poll_s)
        cls._report_interval_s = float(report_time_interval)
        cls._last_report_t = _now()
        cls._explicit_steps = False
        cls._wrapped = []

    @classmethod
    def _get(cls) -> Session:
        if cls._session is None:
            raise StragglerError("Detector is not initialized; call Detector.initialize() first")
        return cls._session

    @classmethod
    def is_initialized(cls) -> bool:
        return cls._session is not None

    @classmethod
    def detection_section(cls, name: str | None = None, profile_cuda: bool = True) -> Any:
        """A timing section: ``with Detector.detection_section("fwd"):`` or ``@...("fwd")``.

        The same object is returned for the same name, so it may also be created once and
        reused. ``profile_cuda`` is accepted (no kernel timer on CPU). Cost: see ``mark_us``.

        Raises:
            StragglerError: not initialized.
            StragglerConfigError: ``name`` is None and it is used as a context manager.
        """
        session = cls._get()
        if name is None:
            return _DecoratorSection(session)
        return session.recorder.section(name)

    @classmethod
    def add_collective_wait(cls, seconds: float) -> None:
        """Count ``seconds`` of the current step as collective wait, like the time inside a
        wrapped collective: for waits the wrappers cannot see, such as the part of DDP's
        asynchronous gradient all-reduce that ``backward`` waited for. A section open now
        excludes it from its duration. Training thread only; never blocks.

        Raises:
            StragglerError: not initialized.
        """
        recorder = cls._get().recorder
        if seconds > 0:
            recorder.coll_ns += int(seconds * 1e9)

    @classmethod
    def data_wait(cls) -> DataWait:
        """Context manager whose body counts as data-loader wait for this step."""
        return cls._get().recorder.data_wait()

    @classmethod
    def wrap_dataloader(cls, iterable: Iterable[T]) -> Iterator[T]:
        """Iterate ``iterable``, timing each ``next()`` as data-loader wait."""
        return wrap_dataloader(cls._get().recorder, iterable)

    @classmethod
    def step(cls) -> None:
        """Mark the end of a training step (the first call starts the clock).

        Once called, :meth:`generate_report_if_interval_elapsed` no longer marks steps itself.
        """
        if not cls._explicit_steps:  # writing a class attribute each call would cost ~1 us
            cls._explicit_steps = True
        session = cls._session
        if session is None:
            raise StragglerError("Detector is not initialized; call Detector.initialize() first")
        session.step()

    @classmethod
    def wrap_callables(cls, callable_ids: Iterable[CallableId], profile_cuda: bool = True) -> None:
        """Replace each ``obj.name`` by a wrapper timed as section ``"<Class>.<name>"``."""
        session = cls._get()
        for cid in callable_ids:
            orig = getattr(cid.obj, cid.name)
            owner = cid.obj if isinstance(cid.obj, type) else type(cid.obj)
            section = session.recorder.section(f"{owner.__name__}.{cid.name}")
            own = vars(cid.obj).get(cid.name, _ABSENT) if hasattr(cid.obj, "__dict__") else orig
            cls._wrapped.append((cid.obj, cid.name, own))
            setattr(cid.obj, cid.name, section(orig))

    @classmethod
    def restore_original_callables(cls) -> None:
        """Undo :meth:`wrap_callables` (idempotent)."""
        while cls._wrapped:
            obj, name, orig = cls._wrapped.pop()
            if orig is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, orig)

    @classmethod
    def generate_report(cls) -> Report | None:
        """The newest scored window's :class:`Report`; never blocks, not a collective.

        Returns None on ranks that do not aggregate (``gather_on_rank0=True`` and rank > 0), as
        NVRx does. On an aggregating rank before any window was scored, returns an empty report
        whose ``warnings`` say so (never a silent "no stragglers"). Unlike NVRx it clears
        nothing: windows are scored as they close, whether or not anyone asks for a report.
        """
        session = cls._get()
        if not session.aggregate:
            return None
        cls._last_report_t = _now()
        report = session.take_report(only_new=False)
        return report if report is not None else _empty_report(session)

    @classmethod
    def is_interval_elapsed(cls) -> bool:
        return _now() - cls._last_report_t >= cls._report_interval_s

    @classmethod
    def generate_report_if_interval_elapsed(cls) -> Report | None:
        """Call once per step: marks the step (unless :meth:`step` is used) and returns a new
        report when one was scored and ``report_time_interval`` elapsed since the last; else None.
        """
        session = cls._get()
        if not cls._explicit_steps:
            session.step()
        if not session.aggregate or session.reports_taken == session.reports_made:
            return None  # nothing new (the common case: no clock read, no lock)
        if not cls.is_interval_elapsed():
            return None
        report = session.take_report(only_new=True)
        if report is not None:
            cls._last_report_t = _now()
        return report

    @classmethod
    def reports(cls) -> list[Report]:
        """Every report scored so far on this rank (oldest first; at most 10 000)."""
        return cls._get().history()

    @classmethod
    def shutdown(cls, timeout_s: float = 5.0) -> None:
        """Stop: restore wrapped callables and collectives, score what arrives, join the thread.

        Blocks at most ``timeout_s`` seconds (plus up to 2 s scoring windows still arriving).
        Idempotent. Reports stay readable through :meth:`last_reports` until the next initialize.
        """
        session = cls._session
        if session is None:
            return
        cls.restore_original_callables()
        session.close(timeout_s)
        cls._last_history = session.history()
        cls._session = None

    @classmethod
    def last_reports(cls) -> list[Report]:
        """Reports of the current session, or of the last one after :meth:`shutdown`."""
        if cls._session is not None:
            return cls._session.history()
        return list(cls._last_history)


def _now() -> float:
    import time

    return time.monotonic()


def _check_scores(scores: str | Sequence[str]) -> None:
    if scores == "all":
        return
    items = [scores] if isinstance(scores, str) else list(scores)
    bad = [s for s in items if s not in _SCORES]
    if bad or not items:
        raise StragglerConfigError(f"scores_to_compute must be 'all' or a non-empty subset of "
                                   f"{list(_SCORES)}, got {scores!r}")


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise StragglerConfigError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size


def _empty_report(session: Session) -> Report:
    return Report(
        window=-1, steps=0, step_ms_median=float("nan"), stragglers=(), per_rank={},
        missing_ranks=(), warnings=(_NO_WINDOW,),
        events=(), warmup=True, rank_relative_perf_scores={}, rank_individual_perf_scores={},
        section_relative_perf_scores={}, section_individual_perf_scores={}, rank_to_node={},
        gather_on_rank0=session.gather_on_rank0, rank=session.rank)


# Section is re-exported so users can annotate a created section.
SectionType = Section
