"""Preemption callback logic: SIGTERM -> every rank stops at the same step, saves, exits.

Lightning (>= 2.5.2) registers a SIGTERM handler that runs ``dist.broadcast`` *inside the signal
handler*; when ranks receive SIGTERM at different instants (always across nodes) that collective
pairs with an unrelated one or blocks until the grace ends. This callback replaces it once
training starts with a handler that only sets a flag. The ranks agree on the flags with a
pipelined all-reduce on their own gloo group: at every check step each rank starts a
non-blocking MAX all-reduce of its flag and reads the one it started at the previous check (long
finished, so nothing waits for a slower peer); every rank reads the same result at the same step,
so all of them stop after the same step, one check after the first signal.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainguard._core.logging import get_logger
from trainguard.errors import ConfigError
from trainguard.integrations.lightning._common import checkpoint_poller

__all__ = ["PreemptionLogic"]

_log = get_logger("trainguard.integrations.lightning")


class PreemptionLogic:
    """Graceful stop on SIGTERM (or the given signals) at a common step boundary.

    Args:
        signals: signals that request the stop (default SIGTERM).
        check_every_n_steps: steps between stop checks (>= 1, default 10); each starts one
            non-blocking 4-byte all-reduce (~30-250 us of CPU, so checking every step would cost
            up to 2 % of a 10 ms step). The stop comes n to 2n steps after the signal: lower it
            for steps of seconds.
        group_timeout: seconds; timeout of the callback's gloo group (a check whose peer died
            fails after it instead of hanging).
        dirpath: where the stop checkpoint goes (default: the ``ModelCheckpoint``'s dirpath,
            else ``trainer.default_root_dir/checkpoints``); None with ``save=False`` is fine.
        save: write ``preempted-step=<step>.ckpt`` through ``trainer.save_checkpoint`` (all
            ranks call it; with :class:`TrainguardCheckpointIO` it is committed before ``fit``
            returns) before stopping.

    After the stop ``fit`` returns normally; ``preempted_at_step`` holds the step (same on every
    rank) and ``signal_to_stop_s`` the seconds from this rank's signal to the saved stop.

    Raises:
        ConfigError: a bad argument (constructor).

    Blocking: the handler never blocks; a check waits only for an all-reduce started a check
    earlier (normally complete); the stop pays one checkpoint save. ``on_train_start`` creates the
    gloo group (a collective of all ranks).

    Follows: Lightning's ``_SignalConnector`` SIGTERM handling; differences: no collective in
    the signal handler, a common stop step on every rank agreed without a blocking collective per
    step, a checkpoint saved at that step.
    """

    def __init__(self, *, signals: tuple[int, ...] = (signal.SIGTERM,),
                 check_every_n_steps: int = 10, dirpath: str | None = None,
                 save: bool = True, group_timeout: float = 120.0) -> None:
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) \
                or check_every_n_steps < 1:
            raise ConfigError(f"check_every_n_steps must be an int >= 1, got "
                              f"{check_every_n_steps!r}")
        if not group_timeout > 0:
            raise ConfigError(f"group_timeout must be > 0 seconds, got {group_timeout!r}")
        if not signals:
            raise ConfigError("signals must name at least one signal, e.g. (signal.SIGTERM,)")
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.check_every_n_steps = check_every_n_steps
        self.dirpath = dirpath
        self.save = bool(save)
        self.requested = False
        self.preempted_at_step: int | None = None
        self.checkpoint_path: str | None = None
        self.signal_to_stop_s: float | None = None
        self._t_signal = 0.0
        self._previous: dict[signal.Signals, Any] = {}
        self.group_timeout = float(group_timeout)
        self._steps = 0
        self._group: Any = None
        self._pending: Any = None  # (work, tensor) of the all-reduce started at the last check
        self._poll: Callable[[], None] | None = None
        self._flags: list[Any] = []
        self._turn = 0
        self._opts: Any = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.requested:  # a flag only: no I/O, no collective, no allocation of note
            self.requested, self._t_signal = True, time.monotonic()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after Lightning's own registration (Trainer._run), so its handler is replaced
        import torch.distributed as dist

        self._steps, self._pending, self._group = 0, None, None
        self._poll = checkpoint_poller(trainer)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=self.group_timeout))
            self._flags = [torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)]
            self._opts = dist.AllreduceOptions()
            self._opts.reduceOp = dist.ReduceOp.MAX
        for sig in self.signals:
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._pending is not None:  # every rank started it: it completes
            self._pending[0].wait()
        self._pending, self._group = None, None
        self._restore()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._pending, self._group = None, None  # no wait: a peer may be gone
        self._restore()

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._poll is not None:
            self._poll()
        self._steps += 1
        if self._steps % self.check_every_n_steps or self.preempted_at_step is not None:
            return
        if not self._decide():
            return
        step = int(trainer.global_step)
        self.preempted_at_step = step
        _log.warning("preemption requested (%s): every rank stops after step %d",
                     "this rank" if self.requested else "another rank", step)
        if self.save:
            path = os.path.join(self._dir(trainer), f"preempted-step={step}.ckpt")
            trainer.save_checkpoint(path)
            self.checkpoint_path = path
        if self.requested:
            self.signal_to_stop_s = time.monotonic() - self._t_signal
        trainer.should_stop = True

    def _decide(self) -> bool:
        """True when some rank's flag was set at the previous check (pipelined all-reduce);
        without a process group, this rank's flag now."""
        if self._group is None:
            return self.requested
        decided = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # started a check ago on every rank: normally already complete
            decided = bool(flag.item())
        if not decided:
            # two preallocated flags used in turn (the other may be the one just read); the
            # process group's own allreduce: no c10d Python wrapper, and a straggler detector's
            # collective timing (it wraps torch.distributed.all_reduce) does not count it
            self._turn ^= 1
            flag = self._flags[self._turn]
            flag.fill_(1 if self.requested else 0)
            self._pending = (self._group.allreduce([flag], self._opts), flag)
        else:
            self._pending = None
        return decided

    def _dir(self, trainer: Any) -> str:
        if self.dirpath is not None:
            return self.dirpath
        ckpt = getattr(trainer, "checkpoint_callback", None)
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            return str(ckpt.dirpath)
        return os.path.join(str(trainer.default_root_dir), "checkpoints")
