"""Fault-tolerance callback logic: rank-monitor heartbeats, sections, calculated timeouts.

Namespace-free: :mod:`trainguard.integrations.lightning` and ``.pl`` combine it with their
``Callback``. Hook order (Lightning 2.6, ``Trainer._run``): ``setup`` (process group up) ->
``load_state_dict`` (resume) -> ``on_fit_start`` -> batches -> ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard._core.logging import get_logger
from trainguard.errors import ConfigError
from trainguard.fault_tolerance import MonitorUnavailableError, RankMonitorClient
from trainguard.integrations.lightning._common import (
    check_cluster_environment,
    checkpoint_poller,
    set_active_client,
)

__all__ = ["FIRST_CALCULATION_STEPS", "SECTIONS", "FaultToleranceLogic"]

_log = get_logger("trainguard.integrations.lightning")
#: sections this callback opens; only those given a timeout by the launcher
#: (``--ft-rank-section-timeouts setup:600,step:60,...``) are watched, the rest cost nothing
SECTIONS = ("setup", "step", "data", "validation", "checkpointing")
#: batch ends after which timeouts are first calculated: the first point where every rank has a
#: heartbeat gap and a completed ``step`` and ``data`` section
FIRST_CALCULATION_STEPS = 2


class FaultToleranceLogic:
    """Heartbeats and sections of this rank to ``trainguard launch``'s rank monitor.

    Args:
        calculate_timeouts: learn heartbeat and section timeouts from the run (safety factor x
            the longest observed gap, max over ranks; ``--ft-safety-factor``) and keep them in
            this callback's ``state_dict``, so they travel in every checkpoint and apply from the
            first step of a resumed run.
        calculate_after_steps: recalculation period in training steps (> 0, default 100). The
            first calculation happens at the end of the run's second training batch (the first
            point with a heartbeat gap and a completed ``step`` section on every rank), so a
            checkpoint saved from then on carries calculated timeouts and a restart right after
            the first save keeps them (a run that resumed with calculated timeouts skips it: the
            same on every rank, they come from the same checkpoint); then at every batch end
            whose step count (since ``fit`` started) is a multiple of
            ``calculate_after_steps``, which brings checkpoint pauses and validation into the
            measure (merged with the earlier values). Each calculation is a collective at a
            batch end that every rank reaches at the same step count; the schedule depends on
            nothing rank-local (not on saves: Lightning runs ``on_save_checkpoint`` wherever
            ``dump_checkpoint`` is called, possibly on one rank only). Until a recalculation
            has seen a save, a first save longer than ``min_timeout`` could be taken for a
            hang: keep ``min_timeout`` above the longest blocking save. One calculation costs
            the calling thread ~0.5-1 ms (two all-reduces, up to three monitor requests):
            every 16 steps that was ~50 us per step, half the 1 % budget of a 10 ms step
            (``bench/lightning_overhead.py``); every 100, < 10 us.
        min_timeout: floor in seconds (> 0) of every calculated timeout. A step of 10 ms gives a
            calculated heartbeat timeout of 50 ms at the default safety factor, which one pause
            of the machine (another job, swapping, a slow file system) would exceed; 30 s by
            default still catches a hang 20x sooner than the launcher's 600 s default.
        required: raise when the process was not started by ``trainguard launch`` (default);
            False: log a warning and do nothing.
        client: a :class:`RankMonitorClient` to use (default: a new one).

    Sections (see :data:`SECTIONS`): ``setup`` from ``setup`` to the first batch, ``step`` per
    training batch, ``data`` from a batch end to the next batch start, ``validation`` per
    validation loop, ``checkpointing`` around :class:`TrainguardCheckpointIO`'s blocking save.

    Raises (``setup``):
        ConfigError: ``required`` and no ``trainguard launch`` monitor answered, or Lightning
            picked a cluster environment other than TorchElastic under the launcher.

    Blocking: heartbeats and sections are shared-memory stores (< 1 us); a calculation (at a
    batch end, see ``calculate_after_steps``) is two small all-reduces (all ranks reach it at the
    same step) plus up to three requests to the monitor (<= 5 s each). A save runs nothing of
    this callback but ``state_dict`` (what is already known, no collective, no request): Lightning
    builds a checkpoint wherever ``dump_checkpoint`` is called, possibly on one rank only.

    Follows: NVRx ``FaultToleranceCallback`` + ``FaultToleranceSectionsCallback`` (deprecated);
    differences: public hooks only (no patched strategy methods), any section set, timeouts in
    the callback's checkpoint state instead of a JSON file beside the logs, a loud error when
    the launcher is missing, and active in every ``fit`` (not only with autoresume).
    """

    def __init__(self, *, calculate_timeouts: bool = True, calculate_after_steps: int = 100,
                 min_timeout: float = 30.0, required: bool = True,
                 client: RankMonitorClient | None = None) -> None:
        if not min_timeout > 0:
            raise ConfigError(f"min_timeout must be > 0 seconds, got {min_timeout!r}")
        if isinstance(calculate_after_steps, bool) or not isinstance(calculate_after_steps, int) \
                or calculate_after_steps < 1:
            raise ConfigError(f"calculate_after_steps must be an int >= 1, got "
                              f"{calculate_after_steps!r}")
        self.calculate_timeouts = bool(calculate_timeouts)
        self.calculate_after_steps = calculate_after_steps
        self.required = bool(required)
        self.min_timeout = float(min_timeout)
        self.client = client if client is not None else RankMonitorClient()
        self.active = False
        self.calculations = 0
        self._steps = 0
        self._loaded_state: dict[str, Any] | None = None
        self._poll: Callable[[], None] | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.active:
            return
        self._poll = checkpoint_poller(trainer)
        try:
            self.client.init_workload_monitoring()
        except MonitorUnavailableError as exc:
            if self.required:
                raise ConfigError(
                    f"FaultToleranceCallback is configured but no trainguard launcher is "
                    f"watching this rank ({exc}); start the script with 'trainguard launch "
                    "--nproc-per-node N script.py' or pass FaultToleranceCallback(required=False)"
                ) from exc
            _log.warning("FaultToleranceCallback inactive: %s", exc)
            return
        check_cluster_environment(trainer)
        self.active, self._steps = True, 0
        set_active_client(self.client)
        self.client.start_section("setup")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # what follows (waiting for checkpoint writes, teardown) is no training step: stop the
        # client timeouts here; the launcher keeps watching the process itself
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self.active:
            return
        self.active = False
        set_active_client(None)
        self.client.end_all_sections()
        self.client.send_heartbeat()
        self.client.shutdown_workload_monitoring()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning runs no teardown hook after an exception; no collective here (a peer may be
        # gone); a new fit (e.g. the next in-process restart iteration) connects again
        self.teardown(trainer, pl_module, "fit")

    # -- training ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self.active:
            client = self.client
            client.end_section("setup")
            client.end_section("data")
            client.start_section("step")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._poll is not None:
            self._poll()
        if not self.active:
            return
        client = self.client
        client.end_section("step")
        client.send_heartbeat()
        client.progress(1)
        self._steps += 1
        steps = self._steps
        if self.calculate_timeouts and (
                steps % self.calculate_after_steps == 0 and steps > FIRST_CALCULATION_STEPS
                or steps == FIRST_CALCULATION_STEPS
                and not _heartbeat_calculated(self.client.state_dict())):
            self.calculate()
        client.start_section("data")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.active:
            self.client.end_section("data")
            self.client.start_section("validation")

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.active:
            self.client.send_heartbeat()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.active:
            self.client.end_section("validation")

    # -- timeouts ---------------------------------------------------------------------------
    def calculate(self) -> bool:
        """Collective: calculate heartbeat and section timeouts now (all ranks must call it).

        Returns True when both were set (False: not enough data yet, logged by the client).
        """
        hb = self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        sec = self.client.calculate_and_set_section_timeouts(skip_if_not_ready=True)
        current = self.client.state_dict()
        floored = _floor(current, self.min_timeout)
        if floored != current:
            self.client.load_state_dict(floored)  # pushes the raised values to the monitor
        self.calculations += 1
        _log.info("fault tolerance: calculated timeouts %s", self.client.state_dict())
        return hb and sec

    def state_dict(self) -> dict[str, Any]:
        """Calculated timeouts (identical on every rank), saved in Lightning checkpoints."""
        return self.client.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore calculated timeouts from a checkpoint (applied to the monitor at once)."""
        self._loaded_state = dict(state_dict)
        self.client.load_state_dict(state_dict)

    @property
    def loaded_state(self) -> dict[str, Any] | None:
        """What the last :meth:`load_state_dict` received (None: nothing was restored)."""
        return self._loaded_state


def _heartbeat_calculated(state: dict[str, Any]) -> bool:
    hb = state.get("current_timeouts", {}).get("heartbeat")
    return isinstance(hb, dict) and bool(hb.get("were_calculated"))


def _floor(state: dict[str, Any], minimum: float) -> dict[str, Any]:
    """``state`` (``RankMonitorClient.state_dict()``) with every timeout raised to ``minimum``."""
    current = {k: dict(v) if isinstance(v, dict) else v
               for k, v in state.get("current_timeouts", {}).items()}
    hb = current.get("heartbeat")
    if isinstance(hb, dict):
        for key in ("initial", "subsequent"):
            if isinstance(hb.get(key), (int, float)):
                hb[key] = max(float(hb[key]), minimum)
    sec = current.get("section")
    if isinstance(sec, dict):
        sec["section"] = {k: max(float(v), minimum) for k, v in sec.get("section", {}).items()}
        if isinstance(sec.get("out_of_section"), (int, float)):
            sec["out_of_section"] = max(float(sec["out_of_section"]), minimum)
    return {"current_timeouts": current}
