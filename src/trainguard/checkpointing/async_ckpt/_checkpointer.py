"""AsyncCheckpointer: prepare -> stage (blocking memcpy) -> write (writer) -> agree -> commit
(rank 0's writer) -> agree on the outcome. Each save's lifecycle is a :class:`SaveState`.

Collaborators: :class:`~trainguard.checkpointing.manager.CheckpointManager` (layout, commit,
retention), the staging arenas and the persistent writer process (``_writer``), the commit
(``_commit``), directory reuse (``_reuse``) and the save-time loadability check
(``checkpointing._loadable``). One instance per rank; all ranks call ``save`` with the same steps
in the same order, and ``maybe_finalize`` at the same points.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import pickle
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard._core.clock import Deadline, as_seconds
from trainguard._core.hooks import defer_to_restart, in_restart_loop, register_reset_callback
from trainguard._core.logging import get_logger
from trainguard.checkpointing import _staging
from trainguard.checkpointing._loadable import check_loadable
from trainguard.checkpointing.async_ckpt import _pool
from trainguard.checkpointing.async_ckpt._commit import (
    check_same_save,
    commit_header,
    raise_for_failures,
)
from trainguard.checkpointing.async_ckpt._dcp_plan import DcpPlanner
from trainguard.checkpointing.async_ckpt._loading import LoadMixin
from trainguard.checkpointing.async_ckpt._overlap import SYNC_BYTES, OverlapGuard
from trainguard.checkpointing.async_ckpt._request import SaveRequest, SaveState
from trainguard.checkpointing.async_ckpt._reuse import (
    ExistingRun,
    join_run_id,
    refuse_step,
    scan_existing,
)
from trainguard.checkpointing.async_ckpt._writer import ArenaPool, WriterDied, WriterProcess
from trainguard.checkpointing.errors import (
    CheckpointError,
    CheckpointTimeout,
    CheckpointWriteError,
)
from trainguard.checkpointing.manager import CheckpointManager, rank_file
from trainguard.errors import ConfigError

__all__ = ["AsyncCheckpointer", "SaveRequest", "SaveState"]

_log = get_logger("trainguard.checkpointing")
_INSTANCES: weakref.WeakSet = weakref.WeakSet()
_ids = itertools.count(1)


def abort_all_checkpointers() -> None:
    """Reset callback for in-process restart: kill every busy writer, drop every in-flight save.

    In the restart's monitor thread only the busy writers are signalled (that unblocks a main
    thread waiting on them) and the rest of :meth:`AsyncCheckpointer.abort` is deferred to the
    main thread (``_core.hooks.defer_to_restart``): the queue, the process group and the writer
    handles are the main thread's, which may still be inside the aborted iteration.
    """
    for ckpt in list(_INSTANCES):
        ckpt.abort()


register_reset_callback("trainguard.checkpointing.async", abort_all_checkpointers)


class AsyncCheckpointer(LoadMixin):
    """Asynchronous, never-torn checkpoints with one persistent writer process per rank.

    Args:
        root: directory or fsspec URL of step checkpoints (None: only :meth:`async_save` files).
        format: ``"torch"`` (one ``torch.save`` file per rank) or ``"dcp"`` (readable by
            ``torch.distributed.checkpoint.load``; keys must be strings).
        keep_last: committed checkpoints kept (>= 1).
        write_timeout: longest a write may take before the writer counts as stuck and is killed.
        collective_timeout: timeout of the checkpointer's own gloo group (finalize/load).
        max_in_flight: staging arenas (host memory = this x state size); a save waits for the
            oldest write when all are busy.
        staging_budget_bytes: cap on all staging arenas together (None: max_in_flight x state);
            saves wait for older writes to fit, and a state larger than the cap raises
            ConfigError up front instead of exhausting host memory.
        run_id: optional name of this run: checkpoints go to ``root/run_id``, so a new run
            (e.g. a different world size with ``format="torch"``) does not meet an earlier
            run's checkpoints. Without it, a directory that already holds committed steps is
            resumed from (``load()``, then save newer steps); ``save`` refuses a step that is not
            newer than the newest committed one with a ConfigError naming these fixes.
        on_error: ``"raise"`` (default) or ``"log"``: a failed save is logged and counted in
            ``failed_saves`` and training continues (the next save retries).
        writer_nice: niceness added to the writer (e.g. 10 on CPU-bound trainers; 0 = same).
        keep_idle_writer: accepted for compatibility; idle writers are now always kept:
            ``abort()`` parks a writer with no write in flight (it holds nothing of the aborted
            iteration) in the process-wide pool of warm writers, where this checkpointer's next
            use or a checkpointer made after the restart takes it, so no save after an
            in-process restart waits seconds for a fresh writer to import torch. A busy writer
            is always killed (and a replacement starts in the pool at once).
        spare_writer: keep one more writer process for this checkpointer warm and idle in the
            process-wide pool (it has imported torch, and DCP's write modules for
            ``format="dcp"``), so that when an abort kills a writer busy with a save (an
            in-process restart while writing) the next save is written and committed by the
            spare instead of by a replacement that is still importing torch (1-2 s on an idle
            machine, 5-26 s on a loaded 2-core one); another spare then starts in the
            background. ``True``: from the start. ``None`` (default): inside an in-process
            restart loop (``inprocess.Wrapper``; checked here and at :meth:`rebind`) once an
            abort in this process has killed a writer busy with a save (the first such restart
            waits for a replacement as before; the later ones take a spare), so a job whose
            faults never meet a write in flight pays nothing; ``TRAINGUARD_CKPT_SPARE_WRITER=1``
            makes ``None`` act as ``True``. ``False``: never. Cost per spare: one idle
            interpreter (about 275 MiB RSS, 146 MiB of it its own, with torch 2.13 CPU) and one
            torch import of CPU time when it starts. ``TRAINGUARD_CKPT_SPARE_WRITER=0`` turns
            spares off whatever this says.
        faults: test seam, step -> fault dict for the writer (see ``_worker``).

    The writer process is taken warm from the process-wide pool (``_pool``: writers of aborted
    or abandoned checkpointers, pre-warmed ones on a reserve rank, see
    :func:`~trainguard.checkpointing.prewarm_writers`) or started here (it imports torch while
    training runs), so no save pays for its start-up; :meth:`warmup` also waits for it and
    pre-allocates the staging memory. With checkpointers made inside an ``inprocess.Wrapper``
    function the number of writer processes stays the number of checkpointers.
    The commit (manifest fsyncs, keep-last pruning) runs in rank 0's writer; the trainers only
    agree on the outcome.

    Raises:
        ConfigError: a bad argument, or an unwritable ``root``.

    Failure contract:
        * a dead, stuck or failing writer, or a failed commit, raises ``CheckpointWriteError``
          (``CheckpointWorkerError`` for dead/stuck) from ``maybe_finalize`` on every rank;
        * the previous committed checkpoint stays loadable and the next ``save`` works (it
          restarts the writer when needed);
        * ``abort()`` (also run by in-process restart's reset callbacks) kills a busy writer and
          parks an idle one in the pool; ``close()`` stops the writer; leaving a ``with`` block
          with an exception, or dropping the last reference, parks an idle writer (at most
          ``_pool.MAX_IDLE`` pooled; pooled writers stop at interpreter exit).

    Follows: NVRx ``AsyncCallsQueue`` + persistent caller; differences: true snapshots in reused
    shm arenas, liveness checks and timeouts, checksums and a manifest commit marker.
    """

    def __init__(self, root: Any = None, *, format: str = "torch", keep_last: int = 2,
                 write_timeout: float | timedelta = 600.0,
                 collective_timeout: float | timedelta = 600.0, max_in_flight: int = 2,
                 staging_budget_bytes: int | None = None, use_dist: bool | None = None,
                 writer_nice: int = 0, on_error: str = "raise", keep_idle_writer: bool = False,
                 faults: dict[int, dict] | None = None, run_id: str | None = None,
                 spare_writer: bool | None = None) -> None:
        if format not in ("torch", "dcp"):
            raise ConfigError(f"format must be 'torch' or 'dcp', got {format!r}")
        if (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                or max_in_flight < 1):
            raise ConfigError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.write_timeout_s = as_seconds(write_timeout, "write_timeout")
        self.start_timeout_s = 120.0  # a writer that has not started after this is dead
        self.collective_timeout_s = as_seconds(collective_timeout, "collective_timeout")
        if self.write_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ConfigError("write_timeout and collective_timeout must be > 0 seconds")
        if on_error not in ("raise", "log"):
            raise ConfigError(f"on_error must be 'raise' or 'log', got {on_error!r}")
        if use_dist and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("use_dist=True but torch.distributed is not initialized; call "
                              "init_process_group first or pass use_dist=False")
        self.format, self.on_error, self.failed_saves = format, on_error, 0
        self.keep_idle_writer = bool(keep_idle_writer)
        self.use_dist = (dist.is_available() and dist.is_initialized() if use_dist is None
                         else use_dist)
        self.rank = dist.get_rank() if self.use_dist else 0
        self.world_size = dist.get_world_size() if self.use_dist else 1
        root = join_run_id(root, run_id)
        self.manager = CheckpointManager(root, keep_last) if root is not None else None
        self.faults = dict(faults or {})
        if spare_writer is not None and not isinstance(spare_writer, bool):
            raise ConfigError(f"spare_writer must be True, False or None, got {spare_writer!r}")
        self._spare_arg = spare_writer
        self.writer = WriterProcess(_label_rank(), writer_nice, warm_dcp=format == "dcp",
                                    spare=_wants_spare(spare_writer))
        if staging_budget_bytes is not None and (
                isinstance(staging_budget_bytes, bool) or not isinstance(staging_budget_bytes, int)
                or staging_budget_bytes <= 0):
            raise ConfigError(f"staging_budget_bytes must be a positive int or None, got "
                              f"{staging_budget_bytes!r}")
        self.pool = ArenaPool(max_in_flight, staging_budget_bytes)
        self.queue: deque[SaveRequest] = deque()
        self._dcp_planner = DcpPlanner(warm=format == "dcp")
        self._overlap = OverlapGuard(self.write_timeout_s)
        self._saves_skipped = 0
        self._group: Any = None
        self._last_step: int | None = None
        self._existing: ExistingRun | None = None  # an earlier run's newest commit, if any
        self._newest: int | None = None  # newest step committed in the directory
        self._closed = False
        self._abort_pending = False  # set off the main thread by abort(); applied on it
        _INSTANCES.add(self)
        self._finalizer = weakref.finalize(self, _release, self.writer, self.pool)
        self.writer.ensure_started()  # the child imports torch while the trainer goes on
        if self.manager is not None:
            try:
                self._check_writable()
                self._scan_directory()
            except BaseException:
                self._finalizer()
                raise

    # -- setup -------------------------------------------------------------------------------
    def _scan_directory(self) -> None:
        """Rank 0 removes leftovers and finds the newest commit; every rank learns it (the
        broadcast also keeps any rank from writing before the leftovers are gone)."""
        box: list[Any] = [None]
        if self.rank == 0:
            self.manager.cleanup_stale()  # type: ignore[union-attr]
            found = scan_existing(self.manager)  # type: ignore[arg-type]
            box[0] = found.to_list() if found is not None else None
        if self.use_dist:
            group = self._ensure_group()
            self._collective(dist.broadcast_object_list, box,
                             src=dist.get_global_rank(group, 0), group=group)
        if box[0] is not None:
            self._existing = ExistingRun(*box[0])
            self._newest = self._existing.step

    def warmup(self, state_dict: Any = None, timeout: float | timedelta = 120.0) -> None:
        """Wait until the writer process is ready, and pre-allocate staging memory for a state
        like ``state_dict`` (optional), so that even the first save blocks only for its memcpy.

        Local to this rank, no collective. Blocks up to ``timeout`` (seconds or timedelta) for
        the writer to import torch (typically 1-2 s on a busy machine), plus the first touch of
        the staging memory (about state size / memory bandwidth).

        Raises:
            CheckpointWorkerError: the writer died or did not start within ``timeout``.
        """
        from trainguard.checkpointing.errors import CheckpointWorkerError

        deadline = Deadline(as_seconds(timeout, "timeout"))
        self.writer.ensure_started()
        try:
            while not self.writer.ready:
                got = self.writer.recv(deadline.chunk(0.5))
                if got is not None and not got[0].get("ready"):
                    self._on_reply(*got)
                if deadline.expired() and not self.writer.ready:
                    raise CheckpointWorkerError(
                        f"rank {self.rank}: checkpoint {self.writer.describe()} not ready after "
                        f"{deadline.elapsed():.1f} s (warmup timeout)", {self.rank: "not ready"})
        except WriterDied as exc:
            self._fail_pending(str(exc), dead=True)
            raise CheckpointWorkerError(f"rank {self.rank}: checkpoint writer died during warmup: "
                                        f"{exc}", {self.rank: str(exc)}) from exc
        if state_dict is not None:
            skeleton, tensors = _staging.flatten(state_dict)
            slots, total = _staging.plan_slots(tensors)
            trailer = pickle.dumps(([x.to_json() for x in slots],
                                    _staging.pickle_skeleton(skeleton)), protocol=5)
            nbytes = total + len(trailer)
            if self.pool.count() == 0 and self.pool.can_acquire(nbytes):
                self.pool.acquire(nbytes, -1, self._retire, prefault=True)
                self.pool.release(-1)

    def _check_writable(self) -> None:
        try:
            self.manager.storage.makedirs("")  # type: ignore[union-attr]
            self.manager.storage.write_bytes(f".probe{os.getpid()}", b"")  # type: ignore[union-attr]
            self.manager.storage.remove(f".probe{os.getpid()}")  # type: ignore[union-attr]
        except OSError as exc:
            raise ConfigError(
                f"checkpoint location {self.manager.storage.url!r} is not writable "  # type: ignore[union-attr]
                f"({type(exc).__name__}: {exc}); choose a writable directory or fix its "
                "permissions/quota") from exc

    def _ensure_group(self) -> Any:
        """Own gloo group (created collectively on first use, and again after abort()).

        Rank and world size are re-read with the group: after an in-process restart the
        default group (and this process's rank in it) may have changed.
        """
        self._apply_pending_abort()
        if self.use_dist and self._group is None:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=self.collective_timeout_s))
        return self._group

    # -- save --------------------------------------------------------------------------------
    def save(self, state_dict: Any, step: int,
             finalize_fns: Sequence[Callable[[], None]] = (), *,
             overlap: bool = False, if_busy: str | None = None) -> SaveRequest:
        """Stage ``state_dict`` and queue its write as checkpoint ``step`` (all ranks call it).

        Blocks for the memcpy of every tensor into a staging arena (plus waiting for a free arena
        when ``max_in_flight`` saves are unwritten, bounded by ``write_timeout``). After it returns
        the caller may mutate its tensors. Commit happens in :meth:`maybe_finalize`.

        With ``format="dcp"`` the state may hold ``DTensor``s (FSDP2, tensor parallel) and
        ``ShardedTensor``s: each rank writes only its local shards, an item held by several ranks
        (replicated) is written once, and ``torch.distributed.checkpoint.load`` (or
        :meth:`load_dcp`) reshards it to any mesh or world size. Planning costs one scalar
        all-reduce per save (plus a gather of the plans when they changed).

        ``overlap=True`` (opt-in): returns after copying only the small tensors (<= 64 KiB each)
        and pickling the non-tensor values; the large tensors are copied in a background thread
        while training continues, and every ``optimizer.step()`` in the process first waits for
        that copy (a global step pre-hook), so the checkpoint is still an exact snapshot of
        ``step``. A large tensor changed in place outside an optimizer step before the next one is
        not protected: call :meth:`wait_staged` before such a change. See ``_overlap``.

        ``if_busy`` is what a save does when the previous one is still being staged or written
        (its staging memory is not free yet, ``max_in_flight`` saves unwritten), on any rank:
            * ``"skip"`` (default with ``overlap=True``): drop this save, on every rank (one
              scalar all-reduce agrees on it), and return a request in state ``SKIPPED``;
              :attr:`saves_skipped` counts them. The step never waits for an earlier save, so a
              save requested every step checkpoints as often as the writer keeps up with. Pass
              ``"wait"`` for a save that must happen (e.g. the last one).
            * ``"wait"`` (default otherwise): block until an older write frees its staging
              memory (bounded by ``write_timeout``).
        With ``overlap=True`` and ``"skip"`` a save blocks only for the small tensors, pickling and
        (with ``torch.distributed``) one scalar all-reduce, bounded by ``collective_timeout``.

        Raises:
            ConfigError: no root, a bad ``if_busy``, a bad step (not an int, or not newer than
                the newest step committed in the directory or queued: an earlier run's
                checkpoints are resumed from or refused, see ``run_id``), or a state that the
                chosen format cannot hold.
            StateDictError: a value cannot be pickled, or (format ``torch``) could not be loaded
                back by ``torch.load(weights_only=True)``, or is a ``DTensor`` /
                ``ShardedTensor``; the key is named and nothing is written. NumPy arrays,
                scalars and RNG states are allowed.
            CheckpointTimeout: the previous overlapped copy did not finish within
                ``write_timeout``.
        """
        self._apply_pending_abort()
        if self.manager is None:
            raise ConfigError("save() needs AsyncCheckpointer(root=...); use async_save(obj, path) "
                              "for plain per-rank files")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        queued = [r.step for r in tuple(self.queue) if r.step is not None]
        newest = max([*queued, *([self._newest] if self._newest is not None else [])], default=None)
        if newest is not None and step <= newest:
            refuse_step(step, newest, self._existing, self.world_size, self.format,
                        self.manager.storage.url)
        if self.format == "dcp" and not (isinstance(state_dict, dict)
                                         and all(isinstance(k, str) for k in state_dict)):
            raise ConfigError("format='dcp' needs a dict with str keys (DCP flattens nested dicts)")
        if if_busy not in (None, "skip", "wait"):
            raise ConfigError(f"if_busy must be 'skip', 'wait' or None, got {if_busy!r}")
        self._ensure_group()
        rel = self.manager.step_dir(step)
        skip = (if_busy or ("skip" if overlap else "wait")) == "skip"
        return self._submit(state_dict, step, self.format, rel, rank_file(self.rank),
                            self.manager.storage.url, True, finalize_fns, overlap=overlap,
                            skip_if_busy=skip)

    def wait_staged(self) -> None:
        """Block until an overlapped save's background copy is done (no-op otherwise); after it
        the saved tensors may be changed. Blocks at most ``write_timeout``.

        Raises:
            CheckpointTimeout: the copy did not finish in time.
        """
        self._overlap.wait()

    @property
    def saves_skipped(self) -> int:
        """Saves dropped by ``if_busy="skip"`` because an earlier one was still in flight."""
        return self._saves_skipped

    @property
    def fenced_steps(self) -> int:
        """Optimizer steps that waited for an overlapped save's copy (0 = fully overlapped)."""
        return self._overlap.fenced_steps

    def async_save(self, obj: Any, path: str, finalize_fns: Sequence[Callable[[], None]] = (),
                   fault: dict | None = None) -> SaveRequest:
        """``torch.save(obj, path)`` in the background (per-rank file, no collective, atomic).

        ``path`` is a local path or fsspec URL; the file appears complete or not at all.
        ``fault`` is a test seam (see ``_worker``).
        Raises: see :meth:`save`.
        """
        text = os.fspath(path)
        base, _, name = text.rpartition("/")
        if not name:
            raise ConfigError(f"async_save path {text!r} must name a file")
        return self._submit(obj, None, "torch", "", name, base or ".", False, finalize_fns, fault)

    def _submit(self, obj: Any, step: int | None, kind: str, rel_dir: str, file: str,
                url: str, collective: bool, finalize_fns: Sequence[Callable[[], None]],
                fault: dict | None = None, overlap: bool = False,
                skip_if_busy: bool = False) -> SaveRequest:
        if self._closed:
            raise ConfigError("this AsyncCheckpointer is closed; create a new one")
        # an earlier overlapped copy finishes (and is sent) first, unless this save may be skipped
        self._overlap.wait(blocking=not skip_if_busy)
        t0 = time.perf_counter()
        if kind == "dcp":
            skeleton, tensors = self._dcp_planner.plan(obj, self.rank, self._group, self.use_dist)
        else:
            skeleton, tensors = _staging.flatten(obj)
        payload = _staging.pickle_skeleton(skeleton)
        if collective and kind == "torch":  # never commit what the default load refuses
            check_loadable(skeleton, _staging.TensorRef)
        slots, total = _staging.plan_slots(tensors)
        req = SaveRequest(next(_ids), step, kind, rel_dir, file, url, collective,
                          Deadline(self.write_timeout_s), list(finalize_fns), t_submit=t0)
        trailer = pickle.dumps(([s.to_json() for s in slots], payload), protocol=5)
        if skip_if_busy and self._agree_busy(total + len(trailer), collective):
            self._saves_skipped += 1
            req.state = SaveState.SKIPPED
            _log.debug("checkpoint step %s skipped: the previous save is still in flight", step)
            return req
        self._wait_for_arena(total + len(trailer))
        # The pickled skeleton rides in the arena behind the tensors: the request message stays
        # tiny, so sending never blocks on a writer that is still starting.
        arena = self.pool.acquire(total + len(trailer), req.id, self._retire)
        arena.buf[total : total + len(trailer)].copy_(
            torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
        fault = self.faults.get(step) if step is not None else fault
        header = {"op": "save", "id": req.id, "step": step, "kind": kind, "dir": rel_dir,
                  "file": file, "rank": self.rank, "storage": url, "arena": arena.name,
                  "trailer": [total, len(trailer)], "fault": fault}
        self.queue.append(req)
        streams = _staging.cuda_fence(tensors)
        if not overlap:
            _staging.stage(tensors, slots, arena, streams)
            self._send(req, header, arena, None)
            return req
        pairs = list(zip(tensors, slots))
        late = [p for p in pairs if p[1].nbytes > SYNC_BYTES]
        _staging.stage([t for t, s in pairs if s.nbytes <= SYNC_BYTES],
                       [s for t, s in pairs if s.nbytes <= SYNC_BYTES], arena, streams)

        def copy() -> None:  # the staging thread; a new arena's first touch happens here
            _stage_fault(fault, late, arena, streams)
            _staging.stage([t for t, _ in late], [s for _, s in late], arena, streams,
                           chunk_bytes=_staging.CHUNK_BYTES)

        self._overlap.start(copy, lambda error: self._send(req, header, arena, error), step)
        return req

    def _send(self, req: SaveRequest, header: dict[str, Any], arena: _staging.Arena,
              error: BaseException | None) -> None:
        """Hand a staged request to the writer (trainer thread), or fail it if staging failed."""
        req.stage_s = time.perf_counter() - req.t_submit
        if req.state is not SaveState.WRITING:
            return  # dropped meanwhile (the writer died with it)
        if error is not None:
            req.state = SaveState.FAILED
            req.record = {"ok": False, "error": f"staging failed: {type(error).__name__}: "
                                                f"{error}", "dead": False}
            self.pool.release(req.id)
            return
        req.deadline = Deadline(self.write_timeout_s)
        try:
            self.writer.ensure_started()
            self.writer.send(header, arena=arena)
        except WriterDied as exc:
            self._fail_pending(str(exc), dead=True)

    def _retire(self, arena: _staging.Arena) -> None:
        if self.writer.alive():
            try:
                self.writer.send({"op": "release", "arena": arena.name})
            except WriterDied:
                pass

    def _agree_busy(self, nbytes: int, collective: bool) -> bool:
        """Is the previous save still staging, or would this one wait for staging memory, on
        this rank or (collective saves, one scalar all-reduce) on any rank? Never blocks on I/O.
        """
        self._overlap.wait(blocking=False)  # a copy that finished meanwhile is sent now
        for req in tuple(self.queue):  # take replies already sent: their arenas are free
            if req.state is SaveState.WRITING:
                self._pump(req, blocking=False)
        budget = self.pool.budget_bytes
        too_big = budget is not None and self.pool.size_for(nbytes) > budget  # raised later
        busy = self._overlap.pending or not (too_big or self.pool.can_acquire(nbytes))
        if collective and self.use_dist:
            flag = torch.tensor([1 if busy else 0], dtype=torch.int32)
            self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self._group)
            busy = bool(flag.item())
        return busy

    def _wait_for_arena(self, nbytes: int) -> None:
        """Block until staging memory for ``nbytes`` is available (older writes finish).

        Raises:
            ConfigError: the state alone exceeds ``staging_budget_bytes``.
        """
        budget = self.pool.budget_bytes
        if budget is not None and self.pool.size_for(nbytes) > budget:
            raise ConfigError(
                f"state needs {self.pool.size_for(nbytes)} bytes of staging memory but "
                f"staging_budget_bytes={budget}; raise the budget or checkpoint fewer/smaller "
                "tensors per rank (e.g. shard the state)")
        while not self.pool.can_acquire(nbytes):
            oldest = next((r for r in tuple(self.queue) if r.state is SaveState.WRITING), None)
            if oldest is None:
                break  # nothing in flight holds memory; acquire() replaces the free arenas
            self._pump(oldest, blocking=True)

    # -- worker replies ---------------------------------------------------------------------
    # The queue is iterated through tuple() snapshots: a committer thread may finalize (pop)
    # while the training thread saves (append), as in the demo.
    def _owes(self, req: SaveRequest) -> bool:
        """Does this rank's writer still owe a reply for ``req`` (its write or its commit)?"""
        return req.state is SaveState.WRITING or req.commit_pending

    def _fail_pending(self, message: str, dead: bool) -> None:
        for req in tuple(self.queue):
            if req.state is SaveState.WRITING:
                req.state = SaveState.FAILED
                req.record = {"ok": False, "error": message, "dead": dead}
                self.pool.release(req.id)
            elif req.commit_pending:
                req.commit_pending = False
                req.commit_record = {"ok": False, "error": message, "dead": dead}
        self.writer.kill()

    def _pump(self, target: SaveRequest, blocking: bool) -> None:
        """Read writer replies until the writer owes none for ``target`` (or one poll if not
        blocking). A writer that sends nothing for ``write_timeout`` while owing a reply is stuck:
        it is killed and every reply it owed becomes a failure."""
        while self._owes(target):
            wait_s = 0.0
            if blocking:
                wait_s = min(0.5, target.deadline.remaining()) if self.writer.ready else 0.5
            try:
                got = self.writer.recv(wait_s)
            except WriterDied as exc:
                self._fail_pending(f"{exc} while writing (step {target.step})", dead=True)
                return
            if got is not None:
                self._on_reply(*got)
                continue
            if not self.writer.ready and target.deadline.elapsed() < self.start_timeout_s:
                if not blocking:
                    return
                continue  # the writer is still importing torch: its time does not count yet
            if target.deadline.expired():
                pid = self.writer.pid
                self._fail_pending(f"writer pid {pid} stuck: no reply after "
                                   f"{self.write_timeout_s:.1f} s (write_timeout); killed", True)
                return
            if not blocking:
                return

    def _on_reply(self, reply: dict[str, Any], extra: bytes | None) -> None:
        if not reply.get("ready"):
            req = next((r for r in tuple(self.queue) if r.id == reply["id"]), None)
            if req is not None and reply.get("op") == "commit":
                req.commit_pending, req.commit_record = False, reply
            elif req is not None and req.state is SaveState.WRITING:
                req.state = SaveState.WRITTEN if reply["ok"] else SaveState.FAILED
                req.record, req.extra = reply, extra
                self.pool.release(req.id)
        # write_timeout counts from when the writer can work on a request, not from its queueing
        for req in tuple(self.queue):
            if self._owes(req):
                req.deadline = Deadline(self.write_timeout_s)

    # -- finalize ----------------------------------------------------------------------------
    def maybe_finalize(self, blocking: bool = False) -> list[int | None]:
        """Finalize finished saves in FIFO order; returns their steps (None for async_save files).

        A save passes two agreements: every rank wrote it (then rank 0's writer commits it:
        manifest, ``latest``, pruning), and the commit succeeded. Non-blocking: one scalar
        all-reduce per call and agreement, never a wait for I/O. Blocking: waits (bounded by
        write_timeout + collective_timeout per save) for all saves.

        Raises:
            CheckpointWriteError / CheckpointWorkerError: a save failed on some rank (all ranks
                raise, the failed save is dropped, later saves stay queued).
            CheckpointTimeout: a collective of the finalize timed out.
            CheckpointError: a collective failed otherwise (a peer is gone), or ranks finalize
                different saves.
        """
        self._apply_pending_abort()
        self._overlap.wait(blocking)
        done: list[int | None] = []
        while self.queue:
            head = self.queue[0]
            if head.state is not SaveState.COMMITTING:
                self._pump(head, blocking)
                if not blocking and not self._all_ready(head, head.state is not SaveState.WRITING):
                    break
                self._agree_written(head)
                if not blocking and head.state is SaveState.COMMITTING:
                    break  # rank 0's writer commits now; a later call agrees on the outcome
            if head.state is SaveState.COMMITTING:
                self._pump(head, blocking)  # rank 0: the commit reply; other ranks owe nothing
                if not blocking and not self._all_ready(head, not self._owes(head)):
                    break
                self._agree_committed(head)
            self.queue.popleft()
            if head.state is SaveState.FAILED:
                try:
                    raise_for_failures(head.step, head.record["failures"], head.record["dead"])
                except CheckpointWriteError as exc:
                    if self.on_error == "raise":
                        raise
                    self.failed_saves += 1
                    _log.warning("checkpoint save failed (on_error='log', continuing): %s", exc)
                continue
            head.durable_s = time.perf_counter() - head.t_submit
            if head.collective:
                self._last_step = head.step
                self._newest = max(head.step, self._newest or 0)  # type: ignore[type-var]
            for fn in head.finalize_fns:
                fn()
            done.append(head.step)
        return done

    def _all_ready(self, head: SaveRequest, ready: bool) -> bool:
        if not head.collective or not self.use_dist:
            return ready
        flag = torch.tensor([1 if ready else 0], dtype=torch.int32)
        self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _collective(self, fn: Callable, *args: Any, **kwargs: Any) -> None:
        """Run one collective on the checkpointer's group; its failure is mapped here, once.

        gloo raises a plain RuntimeError both for a timeout and for a peer that closed its
        connection; they are told apart by the call's duration against the group's timeout.

        Raises:
            CheckpointTimeout: the call failed after (about) ``collective_timeout``.
            CheckpointError: it failed earlier (a peer rank died or its group was aborted).
        """
        t0 = time.monotonic()
        try:
            fn(*args, **kwargs)
        except RuntimeError as exc:  # torch.distributed.DistError and gloo's untyped errors
            elapsed, name = time.monotonic() - t0, getattr(fn, "__name__", "collective")
            if elapsed >= 0.95 * self.collective_timeout_s:
                raise CheckpointTimeout(
                    f"rank {self.rank}: checkpoint collective {name} timed out after "
                    f"{elapsed:.1f} s (collective_timeout {self.collective_timeout_s:.1f} s): "
                    f"{exc}") from exc
            raise CheckpointError(
                f"rank {self.rank}: checkpoint collective {name} failed after {elapsed:.1f} s "
                f"(a peer rank is gone or the group was aborted): {exc}") from exc

    def _agree_written(self, head: SaveRequest) -> None:
        """Gather every rank's write record; on success rank 0 asks its writer to commit
        (state COMMITTING), otherwise the save is FAILED on every rank (rank 0 removes it)."""
        record = {"rank": self.rank, "step": head.step, "kind": head.kind,
                  "ok": head.record.get("ok", False), "error": head.record.get("error"),
                  "dead": head.record.get("dead", False), "files": head.record.get("files", {})}
        if not head.collective:
            failures = {} if record["ok"] else {self.rank: record["error"]}
            self._set_outcome(head, failures, record["dead"])
            return
        gathered: list[Any] = [(record, head.extra)]
        if self.use_dist:
            gathered = [None] * self.world_size
            self._collective(dist.all_gather_object, gathered, (record, head.extra),
                             group=self._group)
        records = [g[0] for g in gathered]
        check_same_save(records)
        failures = {r["rank"]: r["error"] for r in records if not r["ok"]}
        if failures:
            self._discard(head, failures, any(r.get("dead") for r in records))
            return
        head.state = SaveState.COMMITTING
        if self.rank == 0:
            self._send_commit(head, records, [g[1] for g in gathered])

    def _send_commit(self, head: SaveRequest, records: list[dict], extras: list[Any]) -> None:
        fault = self.faults.get(head.step) if head.step is not None else None
        header = commit_header(head.id, records, self.world_size, head.rel_dir, head.storage_url,
                               self.manager.keep_last, fault)  # type: ignore[union-attr]
        payload = pickle.dumps(extras) if head.kind == "dcp" else None
        head.commit_pending, head.deadline = True, Deadline(self.write_timeout_s)
        try:
            self.writer.ensure_started()
            self.writer.send({**header, "has_extras": payload is not None}, payload)
        except WriterDied as exc:
            self._fail_pending(f"{exc} (commit of step {head.step})", dead=True)

    def _discard(self, head: SaveRequest, failures: dict[int, str], dead: bool) -> None:
        """A save failed on some rank: rank 0 removes its directory, then every rank learns that
        the removal is over (so a retry of the step cannot race it) and marks it FAILED."""
        if self.rank == 0:
            try:  # uncommitted leftovers of the failed save; may fail too (EROFS, EIO)
                self.manager.storage.remove(head.rel_dir)  # type: ignore[union-attr]
            except OSError as exc:  # the outcome must still reach every rank
                _log.warning("could not remove the failed save's directory %s: %s",
                             head.rel_dir, exc)
        if self.use_dist:
            self._collective(dist.barrier, group=self._group)
        self._set_outcome(head, failures, dead)

    def _agree_committed(self, head: SaveRequest) -> None:
        """Rank 0 tells every rank whether its writer committed the save."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            rec = head.commit_record
            if not rec.get("ok"):
                outcome[0] = (f"commit of manifest failed: {rec.get('error')}",
                              bool(rec.get("dead")))
            elif rec.get("prune_error"):
                _log.warning("step %s committed, but pruning older checkpoints failed: %s",
                             head.step, rec["prune_error"])
        if self.use_dist:
            self._collective(dist.broadcast_object_list, outcome,
                             src=dist.get_global_rank(self._group, 0), group=self._group)
        if outcome[0] is None:
            self._set_outcome(head, {}, False)
        else:
            self._set_outcome(head, {0: outcome[0][0]}, outcome[0][1])

    @staticmethod
    def _set_outcome(head: SaveRequest, failures: dict[int, str], dead: bool) -> None:
        head.commit_pending = False
        head.state = SaveState.FAILED if failures else SaveState.COMMITTED
        head.record = {**head.record, "failures": failures, "dead": dead}

    def is_written(self, req: SaveRequest) -> bool:
        """Local, non-blocking: has the writer finished ``req`` (successfully or not)?"""
        self._overlap.wait(blocking=False)
        self._pump(req, blocking=False)
        return req.state is not SaveState.WRITING

    def wait(self) -> list[int | None]:
        """Blocking finalize of everything queued (see :meth:`maybe_finalize`)."""
        return self.maybe_finalize(blocking=True)

    @property
    def num_unfinalized(self) -> int:
        return len(self.queue)

    @property
    def durability_lag_s(self) -> float:
        """Seconds since the oldest unfinalized save was staged (0.0 when none): how far the
        newest durable checkpoint trails training, e.g. behind a stalled file system."""
        return time.perf_counter() - self.queue[0].t_submit if self.queue else 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    def abort(self) -> None:
        """Release the writer (park or kill) and drop every queued save, no collectives (restart).

        Safe from any thread of the trainer. A writer that owes no reply is detached into the
        process-wide writer pool (it unmaps this checkpointer's arenas); a busy one is killed and
        a replacement is started in the pool at once (it imports torch while the restart goes
        on). Afterwards this checkpointer holds no writer: its next use (``save``, the commit,
        :meth:`warmup`) takes a warm one from the pool, and so does a checkpointer made after
        the restart. The next ``save`` recreates the checkpointer's process group (re-reading
        rank and world size). Blocks for the SIGKILL and reap of a busy writer (milliseconds,
        at most about 5.5 s).

        Called off the main thread (the in-process restart's monitor thread runs it through the
        reset callbacks while the main thread may still be inside this checkpointer), it only
        SIGKILLs a writer that owes a reply (so a main thread waiting on it wakes) and defers
        the rest to the main thread: the restart loop runs it once the aborted iteration has
        unwound (``_core.hooks.run_deferred_resets``), and any use of the checkpointer before
        that applies it first. The queue, group and writer handles are never touched by two
        threads at once (a cleared queue under ``maybe_finalize`` raised ``IndexError``, a
        cleared group made the next collective run on the default group, and closing the
        writer's handles twice could close a descriptor reused by a process-group socket).
        """
        if threading.current_thread() is not threading.main_thread():
            self._abort_pending = True
            if self.writer.owed > 0:  # requests on the wire; a starting writer has none
                self.writer.signal_kill()
            defer_to_restart(f"trainguard.checkpointing.async.{id(self)}",
                             self._apply_pending_abort)
            return
        self._abort_pending = False
        self._overlap.drop()
        self._drop(to_pool=not self._closed)

    def _apply_pending_abort(self) -> None:
        """Main thread: finish an abort requested from another thread (no-op otherwise)."""
        if self._abort_pending and threading.current_thread() is threading.main_thread():
            self.abort()

    def _drop(self, to_pool: bool) -> None:
        """Forget every queued save; kill a busy or dead writer. With ``to_pool`` (abort) an idle
        writer is parked in the pool, and a killed one is replaced there."""
        had = self.writer.proc is not None
        busy = had and self.writer.owed > 0  # requests in flight (maybe killed off-thread)
        if not self.writer.idle():  # dead, or requests on the wire (a starting one has none)
            self.writer.kill()
            # a replacement starts at once, unless a spare is kept for this writer (the next
            # save takes the spare; the spare keeper starts the next one, one at a time)
            if to_pool and had and not (self.writer.spare and _pool.spare_enabled()):
                _pool.spawn(self.writer.rank, self.writer.nice, warm_dcp=self.writer.warm_dcp)
            if to_pool and busy and in_restart_loop():
                _pool.note_busy_kill()  # spare_writer=None checkpointers keep spares from now
        elif to_pool:
            warm = self.writer.detach()
            if warm is not None:
                _pool.park(warm)
        for req in tuple(self.queue):
            self.pool.release(req.id)
        self.queue.clear()
        self._group = None

    def rebind(self) -> None:
        """Attach to the current default process group, e.g. at the start of every in-process
        restart iteration (the world may have changed) or after ``init_process_group`` when the
        checkpointer was made before it (``use_dist=False``, to start its writer early).

        Drops in-flight saves like :meth:`abort`; rank and world size are re-read and the
        checkpointer's own group is recreated (collectively) on next use.
        """
        self.abort()
        self.use_dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.use_dist else 0
        self.world_size = dist.get_world_size() if self.use_dist else 1
        if not self.writer.spare and _wants_spare(self._spare_arg):
            self.writer.spare = True  # made before the Wrapper's call, rebound inside it
        label = _label_rank()
        if label != self.writer.rank:  # made before init_process_group: ps and logs follow
            self.writer.rank = label
            if self.writer.alive():
                with contextlib.suppress(WriterDied):
                    self.writer.send({"op": "title", "rank": label})

    def close(self, finalize: bool = True) -> None:
        """Finalize pending saves (if ``finalize``), stop the writer, unlink staging memory.

        Blocks for the finalize (see :meth:`wait`) and the writer's exit (up to ~4 s)."""
        self._close(finalize, park=False)

    def _close(self, finalize: bool, park: bool) -> None:
        try:
            if finalize and self.queue:
                self.wait()
        finally:
            self._overlap.drop()
            self._overlap.close()
            self._closed = True
            if not finalize:
                self._drop(to_pool=False)
            self.writer.park_on_release = park
            self._finalizer()

    def __enter__(self) -> AsyncCheckpointer:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Without an exception: :meth:`close`. With one: drop pending saves, and park an idle
        writer in the pool (an in-process restart's next iteration takes it warm)."""
        if exc_type is None:
            self.close()
        else:
            self._close(finalize=False, park=True)


def _stage_fault(fault: dict | None, late: list, arena: _staging.Arena,
                 streams: dict[Any, Any]) -> None:
    """Test seam: ``{"phase": "stage", "action": "slow"|"sigkill"|"errno", "seconds", "errno"}``
    fires in the overlap thread after half of the large tensors are copied."""
    if not fault or fault.get("phase") != "stage":
        return
    half = late[: len(late) // 2]
    _staging.stage([t for t, _ in half], [s for _, s in half], arena, streams)
    if fault["action"] == "slow":
        time.sleep(float(fault.get("seconds", 0.2)))
        return
    if fault["action"] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    err = int(fault.get("errno", errno.EIO))
    raise OSError(err, os.strerror(err))


def _release(writer: WriterProcess, pool: ArenaPool) -> None:
    """Finalizer (close, or the checkpointer was garbage collected): park or stop the writer
    (``writer.park_on_release``), then unlink the staging arenas."""
    writer.release()
    pool.close()


def _wants_spare(arg: bool | None) -> bool:
    """``spare_writer``: an explicit choice, else (``None``) on inside an in-process restart loop
    once a busy writer was killed by an abort in this process (or always with
    ``TRAINGUARD_CKPT_SPARE_WRITER=1``); off whenever spares are disabled (no pool,
    ``TRAINGUARD_CKPT_SPARE_WRITER=0``)."""
    if not _pool.spare_enabled():
        return False
    if arg is None:
        return in_restart_loop() and (_pool.busy_kills() > 0 or _pool.spare_forced())
    return arg


def _label_rank() -> int:
    """This process's rank for the writer's title and log lines: the process group's, else
    ``RANK`` from the launcher's environment (a checkpointer made with ``use_dist=False``, or
    before ``init_process_group``, still names the rank it serves), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return max(0, int(os.environ.get("RANK", "0")))
    except ValueError:
        return 0
