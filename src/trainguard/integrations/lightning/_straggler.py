"""Straggler-detection callback logic on Lightning's public hooks (no wrapped ``training_step``).

Sections per training batch, in Lightning's automatic-optimization order::

    on_train_batch_start -> "forward" -> on_before_backward -> "backward"
    -> on_before_optimizer_step -> "optimizer" -> on_train_batch_end   (step marked here)

The "backward" section excludes the exposed wait for DDP's gradient all-reduce (see
``_ddp_hook``), counted as collective wait instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainguard._core.logging import get_logger
from trainguard.errors import ConfigError
from trainguard.integrations.lightning._common import checkpoint_poller
from trainguard.straggler import Detector, Report, ScoringConfig

if TYPE_CHECKING:
    from trainguard.integrations.lightning._ddp_hook import BackwardWaitTimer

__all__ = ["StragglerLogic"]

_log = get_logger("trainguard.integrations.lightning")
_SECTIONS = ("forward", "backward", "optimizer")


class StragglerLogic:
    """Straggler detection for a Lightning ``fit``; reports on global rank 0.

    Args:
        window_steps: training steps per scored window (>= 1).
        report_time_interval: seconds between reports (0: every scored window).
        scoring: thresholds (:class:`~trainguard.straggler.ScoringConfig`).
        log_metrics: where the ``straggler/...`` metrics (step time, worst ratio, straggler
            count) go on rank 0 at each report. ``True`` or ``"loggers"`` (default): the
            Trainer's loggers (``Logger.log_metrics``, at the trainer's global step); they are
            then not in ``trainer.callback_metrics``. ``"log_dict"``: through
            ``pl_module.log_dict(on_step=True, on_epoch=False, rank_zero_only=True)``, so they
            are in ``trainer.callback_metrics`` too (for ``ModelCheckpoint(monitor=...)`` or
            ``EarlyStopping``); one ``log_dict`` costs ~1 ms of Lightning bookkeeping, about
            75 % of this callback's per-step cost at a 20-step window, which is why it is not
            the default. ``False``: no metrics.
        stop_if_detected: stop training gracefully when a straggler is reported: every
            ``stop_check_interval`` steps all ranks agree (one boolean all-reduce through
            ``strategy.reduce_boolean_decision``) and then set ``trainer.should_stop`` at that
            same step; Lightning's own end-of-fit (checkpoint callbacks, teardown) follows.
        stop_check_interval: steps between stop decisions (default: ``window_steps``).
        on_report: called on rank 0 with each new :class:`~trainguard.straggler.Report`.
        detector_kwargs: more :meth:`Detector.initialize` arguments (``actions``, ``store``, ...).
        time_ddp_allreduce: DDP's gradient all-reduce runs in C++ inside ``backward``, so a fast
            rank's wait for a slow one would count as its own compute and every rank would look
            equally slow. ``"auto"`` (default: on with gloo, off with NCCL), True or False. On
            gloo no communication hook is registered (DDP keeps its own bucketed asynchronous
            all-reduce, and a hook of the user's still works): autograd final callbacks, queued
            from a hook on the model's last parameter, stamp the end of this rank's gradient
            compute and the end of DDP's wait for the all-reduce; that span counts as collective
            wait (three Python calls per ``backward``, none in a Lightning hook). On other
            backends (True only) a DDP communication hook sends each bucket through a blocking
            ``torch.distributed.all_reduce``, which the detector times with CUDA events (on NCCL
            the blocking call only enqueues); DDP takes one communication hook per model, so
            when one is registered already (e.g. ``DDPStrategy(ddp_comm_hook=...)``) a warning
            says so and the all-reduce stays untimed.

    If :class:`Detector` is already initialized (by the user), it is used and left running.

    Raises:
        ConfigError: a bad argument (constructor).
        StragglerConfigError: an invalid detector argument (``setup``).

    Blocking: section marks and the step mark are clock reads (< 1 us); reports are scored on a
    background thread (never a collective); the optional stop decision is one all-reduce.

    Follows: NVRx ``StragglerDetectionCallback`` (deprecated); differences: runs on CPU, no
    wrapped ``training_step``, no private checkpoint calls and no ``sys.exit``: the stop is a
    collective decision at a step boundary that ends ``fit`` normally.
    """

    def __init__(self, *, window_steps: int = 20, report_time_interval: float = 0.0,
                 scoring: ScoringConfig | None = None, log_metrics: bool | str = True,
                 stop_if_detected: bool = False, stop_check_interval: int | None = None,
                 on_report: Callable[[Report], None] | None = None,
                 detector_kwargs: dict[str, Any] | None = None,
                 time_ddp_allreduce: bool | str = "auto") -> None:
        if time_ddp_allreduce not in (True, False, "auto"):
            raise ConfigError(f"time_ddp_allreduce must be True, False or 'auto', got "
                              f"{time_ddp_allreduce!r}")
        interval = window_steps if stop_check_interval is None else stop_check_interval
        for name, value in (("window_steps", window_steps), ("stop_check_interval", interval)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if not report_time_interval >= 0:
            raise ConfigError(f"report_time_interval must be >= 0 seconds, got "
                              f"{report_time_interval!r}")
        self.window_steps = window_steps
        self.report_time_interval = float(report_time_interval)
        self.scoring = scoring
        if log_metrics not in (True, False, "loggers", "log_dict"):
            raise ConfigError(f"log_metrics must be True, False, 'loggers' or 'log_dict', got "
                              f"{log_metrics!r}")
        self.log_metrics: bool | str = "loggers" if log_metrics is True else log_metrics
        self.stop_if_detected = bool(stop_if_detected)
        self.stop_check_interval = interval
        self.on_report = on_report
        self.detector_kwargs = dict(detector_kwargs or {})
        self.time_ddp_allreduce = time_ddp_allreduce
        self.ddp_hooked = False  # DDP's gradient all-reduce is timed (either way, see above)
        self.reports: list[Report] = []
        self.stopped_at_step: int | None = None
        self._owned = False
        self._active = False
        # per section: its bound __enter__/__exit__ (resolved once: the marks run every step)
        self._marks: dict[str, tuple[Callable[[], Any], Callable[..., Any]]] = {}
        self._exit: Callable[..., Any] | None = None  # __exit__ of the open section
        self._poll: Callable[[], None] | None = None
        self._bwait: BackwardWaitTimer | None = None  # gloo's timer (None: not timed that way)
        self._flagged = False
        self._steps = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._active:
            return
        if not Detector.is_initialized():
            Detector.initialize(window_steps=self.window_steps,
                                report_time_interval=self.report_time_interval,
                                scoring=self.scoring, **self.detector_kwargs)
            self._owned = True
        sections = [Detector.detection_section(n) for n in _SECTIONS]
        self._marks = {n: (sec.__enter__, sec.__exit__) for n, sec in zip(_SECTIONS, sections)}
        self._poll = checkpoint_poller(trainer)
        self._active, self._flagged, self._steps = True, False, 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._detach_timer()
        if self._active and self.time_ddp_allreduce is not False:
            self.ddp_hooked, self._bwait = _time_ddp(trainer.strategy.model,
                                                     self.time_ddp_allreduce)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._detach_timer()
        if not self._active:
            return
        self._drop_open()
        self._active = False
        if self._owned:
            Detector.shutdown()
            self._owned = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning runs no teardown hook after an exception: stop what this callback started
        self.teardown(trainer, pl_module, "fit")

    def _detach_timer(self) -> None:
        bwait, self._bwait = self._bwait, None
        if bwait is not None:
            bwait.detach()

    def _drop_open(self) -> None:
        ex, self._exit = self._exit, None
        if ex is not None:  # an interrupted batch records nothing
            ex(RuntimeError, None, None)

    def _enter(self, name: str) -> None:
        if self._exit is not None:
            self._drop_open()
        enter, self._exit = self._marks[name]
        enter()

    def _close(self) -> None:
        ex, self._exit = self._exit, None
        if ex is not None:
            ex(None, None, None)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._active:
            self._enter("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._active:
            self._close()
            self._enter("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._active:
            self._take_wait()  # before "backward" closes: the section excludes the wait
            self._close()
            self._enter("optimizer")

    def _take_wait(self) -> None:
        bwait = self._bwait
        if bwait is not None and bwait.exposed_ns:
            Detector.add_collective_wait(bwait.take_exposed_s())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._poll is not None:
            self._poll()
        if not self._active:
            return
        self._take_wait()  # no optimizer step this batch (gradient accumulation, a skip)
        self._close()
        self._steps += 1
        report = Detector.generate_report_if_interval_elapsed()
        if report is not None:
            self._on_new_report(report, trainer)
        if self.stop_if_detected and self._steps % self.stop_check_interval == 0:
            stop = bool(trainer.strategy.reduce_boolean_decision(self._flagged, all=False))
            if stop and not trainer.should_stop:
                self.stopped_at_step = int(trainer.global_step)
                _log.warning("straggler detected: stopping at step %d on every rank",
                             self.stopped_at_step)
                trainer.should_stop = True

    def _on_new_report(self, report: Report, trainer: Any) -> None:
        self.reports.append(report)
        if report.stragglers:
            self._flagged = True
            _log.warning("straggler report: %s", report.summary_line())
        if self.on_report is not None:
            self.on_report(report)
        if not self.log_metrics or report.warmup:  # reports exist on global rank 0 only
            return
        ratios = [s.ratio for s in report.stragglers]
        metrics = {"straggler/step_ms_median": float(report.step_ms_median),
                   "straggler/count": float(len(report.stragglers)),
                   "straggler/worst_ratio": float(max(ratios, default=1.0))}
        if self.log_metrics == "log_dict":
            trainer.lightning_module.log_dict(metrics, on_step=True, on_epoch=False,
                                              rank_zero_only=True, batch_size=1)
            return
        step = int(trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _time_ddp(model: Any, mode: bool | str) -> tuple[bool, BackwardWaitTimer | None]:
    """Time a DDP-wrapped model's gradient all-reduce: on gloo with a :class:`BackwardWaitTimer`
    (no communication hook), elsewhere (``mode`` True only) with the blocking hook. Returns
    (timed, the gloo timer or None)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False, None
    from trainguard.integrations.lightning import _ddp_hook

    group = model.process_group
    if dist.get_backend(group) == "gloo":
        timer = _ddp_hook.BackwardWaitTimer()
        return (True, timer) if timer.attach(model) else (False, None)
    if mode == "auto":
        return False, None
    try:
        model.register_comm_hook(group, _ddp_hook.timed_allreduce)
    except RuntimeError as exc:  # DDP allows one hook per model (the user's came first)
        _log.warning("StragglerCallback: DDP gradient all-reduce not timed (%s); pass "
                     "time_ddp_allreduce=False when the model has a communication hook", exc)
        return False, None
    return True, None
