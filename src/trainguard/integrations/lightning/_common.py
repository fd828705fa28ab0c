"""Helpers shared by the Lightning callbacks and plugins (no Lightning import here).

The callbacks and the checkpoint plugin of this package meet only through this module: the
fault-tolerance callback registers its rank-monitor client as the current one (the plugin brackets
its blocking save in the ``checkpointing`` section with it), and every callback lets the
trainguard checkpoint plugin commit finished saves at batch ends (:func:`poll_checkpoint_io`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from trainguard._core.logging import get_logger

__all__ = ["active_client", "check_cluster_environment", "checkpoint_poller",
           "checkpoint_section", "poll_checkpoint_io", "set_active_client"]

_log = get_logger("trainguard.integrations.lightning")
_client: Any = None


def set_active_client(client: Any) -> None:
    """Make ``client`` (a ``RankMonitorClient`` or None) the one the plugin reports to."""
    global _client
    _client = client


def active_client() -> Any:
    return _client


@contextlib.contextmanager
def checkpoint_section() -> Iterator[None]:
    """Bracket a checkpoint write in the ``checkpointing`` section of the active client (if any)."""
    client = _client
    if client is None:
        yield
        return
    client.start_section("checkpointing")
    try:
        yield
    finally:
        client.end_section("checkpointing")


def poll_checkpoint_io(trainer: Any) -> None:
    """Commit the trainguard checkpoint plugin's finished saves (non-blocking; no collective)."""
    poll = checkpoint_poller(trainer)
    if poll is not None:
        poll()


def checkpoint_poller(trainer: Any) -> Callable[[], None] | None:
    """The trainguard checkpoint plugin's ``trainguard_poll`` (None: another plugin). The
    callbacks resolve it once per ``fit`` (the plugin is fixed when the Trainer is built) instead
    of walking ``trainer.strategy.checkpoint_io`` at every batch end."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    return getattr(io, "trainguard_poll", None)


def check_cluster_environment(trainer: Any) -> None:
    """Call under ``trainguard launch`` (the rank monitor answered): with several ranks
    Lightning must have chosen its torchrun (TorchElastic) environment, whatever ``SLURM_*``
    variables say.

    Raises:
        ConfigError: another cluster environment was chosen (ranks would come from elsewhere).
    """
    from trainguard.errors import ConfigError

    env = getattr(trainer.strategy, "cluster_environment", None)
    if env is None or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    if type(env).__name__ != "TorchElasticEnvironment":
        raise ConfigError(
            f"Lightning chose {type(env).__name__} under 'trainguard launch'; ranks must come from "
            "the launcher. Keep TORCHELASTIC_RUN_ID exported (the launcher sets it) or pass "
            "plugins=[TorchElasticEnvironment()] to the Trainer")
