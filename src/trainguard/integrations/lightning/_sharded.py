"""Per-rank and sharded (DCP) checkpoints from a callback, where Lightning calls no CheckpointIO.

``FSDPStrategy`` and ``ModelParallelStrategy`` save without ``CheckpointIO`` (and reject
``storage_options``); DDP calls it on rank 0 only. This callback makes every rank save its part
through :class:`~trainguard.checkpointing.AsyncCheckpointer` (collective commit: a step is
committed only when every rank's files are durable), using torch's
``torch.distributed.checkpoint.state_dict`` helpers, so DTensor/FSDP2 parameters and their
optimizer state are saved shard by shard and can be reloaded on another world size (DCP).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from trainguard._core.logging import get_logger
from trainguard.checkpointing import AsyncCheckpointer, CheckpointNotFoundError
from trainguard.errors import ConfigError

__all__ = ["ShardedCheckpointLogic"]

_log = get_logger("trainguard.integrations.lightning")
_LOOPS = "lightning_fit_loop"


class ShardedCheckpointLogic:
    """Every rank saves model and optimizer state every ``every_n_train_steps`` steps.

    Args:
        dirpath: checkpoint directory (local path or fsspec URL), step directories with a
            manifest (:class:`~trainguard.checkpointing.CheckpointManager` layout).
        every_n_train_steps: save period in optimizer steps (>= 1).
        format: ``"dcp"`` (sharded, reshardable; default) or ``"torch"`` (one file per rank,
            node-local style; same world size to load).
        keep_last: committed checkpoints kept (>= 1).
        resume: load the newest committed step (``resumed_step`` holds it). Without
            ``Trainer.fit(ckpt_path=...)``: at ``on_fit_start`` the module, its optimizers and
            Lightning's loop counters (global step, epoch, batch index: the ``fit_loop`` state
            saved with the shard, restored through ``trainer.fit_loop.load_state_dict`` as
            Lightning restores its own checkpoints), so training continues at the saved step.
            With ``ckpt_path``: that checkpoint gives the loop counters and this callback loads
            only the module and optimizers, at ``on_train_start``.
        write_timeout: see :class:`~trainguard.checkpointing.AsyncCheckpointer`.

    Raises:
        ConfigError: a bad argument (constructor).
        CheckpointWriteError: a save failed on some rank (raised on every rank at a later
            batch end or at teardown).

    Blocking: a save blocks for staging (memcpy) on every rank; committing costs one scalar
    all-reduce per finished save at a later batch end; teardown waits for pending saves.

    Follows: NVRx ``LocalCheckpointCallback`` (deprecated); differences: every rank saves (NVRx
    went through ``trainer.save_checkpoint``, which DDP runs on rank 0 only), collective commit,
    DCP for sharded models.
    """

    def __init__(self, dirpath: str, *, every_n_train_steps: int, format: str = "dcp",
                 keep_last: int = 2, resume: bool = True,
                 write_timeout: float | timedelta = 600.0) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) \
                or every_n_train_steps < 1:
            raise ConfigError(f"every_n_train_steps must be an int >= 1, got "
                              f"{every_n_train_steps!r}")
        if format not in ("dcp", "torch"):
            raise ConfigError(f"format must be 'dcp' or 'torch', got {format!r}")
        self.dirpath, self.every_n_train_steps, self.format = dirpath, every_n_train_steps, format
        self.keep_last, self.resume, self.write_timeout = keep_last, bool(resume), write_timeout
        self.checkpointer: AsyncCheckpointer | None = None
        self.resumed_step: int | None = None
        self.saved_steps: list[int] = []
        self._done_resume = False
        self._warned = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(self.dirpath, format=self.format,
                                                  keep_last=self.keep_last,
                                                  write_timeout=self.write_timeout)

    def _state(self, trainer: Any, pl_module: Any, loops: str = "") -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(pl_module, list(trainer.optimizers))
        # the loop counters travel as one JSON string (a DCP non-tensor item; "" as template)
        return {"model": model, "optim": optim, _LOOPS: loops}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # before Lightning's restore_training_state and fit_loop.run (which resets the loops
        # from restored progress); with ckpt_path, Lightning restores the loops itself
        self._done_resume = False
        if getattr(trainer, "ckpt_path", None) is None:
            self._load(trainer, pl_module, with_loops=True)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._done_resume:
            self._load(trainer, pl_module, with_loops=False)

    def _load(self, trainer: Any, pl_module: Any, with_loops: bool) -> None:
        self._done_resume = True
        if not self.resume or self.checkpointer is None:
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state(trainer, pl_module)
        try:
            if self.format == "dcp":
                step = self.checkpointer.load_dcp(state)
            else:
                state, step = self.checkpointer.load()
        except CheckpointNotFoundError:
            return
        if step is None:
            return
        set_state_dict(pl_module, list(trainer.optimizers), model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.resumed_step = int(step)
        loops = state.get(_LOOPS) if with_loops else None
        if loops:
            trainer.fit_loop.load_state_dict(json.loads(loops))
        _log.info("resumed model and optimizer state%s from step %d",
                  " and loop counters" if loops else "", step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        ckpt.maybe_finalize()
        step = int(trainer.global_step)
        if step > 0 and step % self.every_n_train_steps == 0 and step not in self.saved_steps:
            ckpt.save(self._state(trainer, pl_module, self._loops_json(trainer)), step)
            self.saved_steps.append(step)

    def _loops_json(self, trainer: Any) -> str:
        try:
            return json.dumps(trainer.fit_loop.state_dict())
        except (TypeError, ValueError) as exc:  # e.g. a stateful dataloader's custom state
            if not self._warned:
                self._warned = True
                _log.warning("loop counters not saved with the sharded checkpoint (%s); a "
                             "resume restarts Lightning's loops at step 0", exc)
            return ""

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.close(finalize=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.close(finalize=False)  # no collective: a peer may be gone
