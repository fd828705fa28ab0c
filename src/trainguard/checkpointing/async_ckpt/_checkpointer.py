"""AsyncCheckpointer: prepare -> stage (blocking memcpy) -> write (worker) -> finalize (collective).

Collaborators: :class:`~trainguard.checkpointing.manager.CheckpointManager` (layout, commit,
retention), the staging arenas and the persistent writer process (``_writer``), and the collective
commit (``_commit``). One instance per rank; all ranks call ``save`` with the same steps in the
same order, and ``maybe_finalize`` at the same points.
"""

from __future__ import annotations

import errno
import itertools
import os
import pickle
import signal
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard._core.clock import Deadline, as_seconds
from trainguard._core.hooks import register_reset_callback
from trainguard._core.logging import get_logger
from trainguard.checkpointing import _staging
from trainguard.checkpointing.async_ckpt._commit import commit_collective, raise_for_failures
from trainguard.checkpointing.async_ckpt._dcp_plan import DcpPlanner
from trainguard.checkpointing.async_ckpt._loading import LoadMixin
from trainguard.checkpointing.async_ckpt._overlap import SYNC_BYTES, OverlapGuard
from trainguard.checkpointing.async_ckpt._request import SaveRequest
from trainguard.checkpointing.async_ckpt._writer import ArenaPool, WriterDied, WriterProcess
from trainguard.checkpointing.errors import (
    CheckpointTimeout,
    CheckpointWriteError,
)
from trainguard.checkpointing.manager import CheckpointManager, rank_file
from trainguard.errors import ConfigError

__all__ = ["AsyncCheckpointer", "SaveRequest"]

_log = get_logger("trainguard.checkpointing")
_INSTANCES: weakref.WeakSet = weakref.WeakSet()
_ids = itertools.count(1)


def abort_all_checkpointers() -> None:
    """Reset callback for in-process restart: kill every writer, drop every in-flight save."""
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
        on_error: ``"raise"`` (default) or ``"log"``: a failed save is logged and counted in
            ``failed_saves`` and training continues (the next save retries).
        writer_nice: niceness added to the writer (e.g. 10 on CPU-bound trainers; 0 = same).
        keep_idle_writer: ``abort()`` keeps a writer with no write in flight (it holds nothing
            of the aborted iteration), so the saves after an in-process restart do not wait
            seconds for a fresh writer to import torch; a busy writer is always killed.
        faults: test seam, step -> fault dict for the writer (see ``_worker``).

    Failure contract:
        * a dead, stuck or failing writer, or a failed commit, raises ``CheckpointWriteError``
          (``CheckpointWorkerError`` for dead/stuck) from ``maybe_finalize`` on every rank;
        * the previous committed checkpoint stays loadable and the next ``save`` works (it
          restarts the writer when needed);
        * ``abort()`` (also run by in-process restart's reset callbacks) kills the writer.

    Follows: NVRx ``AsyncCallsQueue`` + persistent caller; differences: true snapshots in reused
    shm arenas, liveness checks and timeouts, checksums and a manifest commit marker.
    """

    def __init__(self, root: Any = None, *, format: str = "torch", keep_last: int = 2,
                 write_timeout: float | timedelta = 600.0,
                 collective_timeout: float | timedelta = 600.0, max_in_flight: int = 2,
                 staging_budget_bytes: int | None = None, use_dist: bool | None = None,
                 writer_nice: int = 0, on_error: str = "raise", keep_idle_writer: bool = False,
                 faults: dict[int, dict] | None = None) -> None:
        if format not in ("torch", "dcp"):
            raise ConfigError(f"format must be 'torch' or 'dcp', got {format!r}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
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
        self.use_dist = dist.is_available() and dist.is_initialized() if use_dist is None else use_dist
        self.rank = dist.get_rank() if self.use_dist else 0
        self.world_size = dist.get_world_size() if self.use_dist else 1
        self.manager = CheckpointManager(root, keep_last) if root is not None else None
        self.faults = dict(faults or {})
        self.writer = WriterProcess(self.rank, writer_nice)
        if staging_budget_bytes is not None and (
                isinstance(staging_budget_bytes, bool) or not isinstance(staging_budget_bytes, int)
                or staging_budget_bytes <= 0):
            raise ConfigError(f"staging_budget_bytes must be a positive int or None, got "
                              f"{staging_budget_bytes!r}")
        self.pool = ArenaPool(max_in_flight, staging_budget_bytes)
        self.queue: deque[SaveRequest] = deque()
        self._dcp_planner = DcpPlanner(warm=format == "dcp")
        self._overlap = OverlapGuard(self.write_timeout_s)
        self._group: Any = None
        self._last_step: int | None = None
        self._closed = False
        if self.manager is not None:
            self._check_writable()
            if self.rank == 0:
                self.manager.cleanup_stale()
            if self.use_dist:  # no rank may start writing before the leftovers are gone
                self._collective(dist.barrier, group=self._ensure_group())
        _INSTANCES.add(self)
        self._finalizer = weakref.finalize(self, _release, self.writer, self.pool)
        if self.manager is not None:
            self.writer.ensure_started()  # warm up: the child imports torch while training runs

    # -- setup -------------------------------------------------------------------------------
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
        if self.use_dist and self._group is None:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=self.collective_timeout_s))
        return self._group

    # -- save --------------------------------------------------------------------------------
    def save(self, state_dict: Any, step: int,
             finalize_fns: Sequence[Callable[[], None]] = (), *,
             overlap: bool = False) -> SaveRequest:
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

        Raises:
            ConfigError: no root, a bad step (not an int, or not newer than the last commit), or a
                state that the chosen format cannot hold.
            StateDictError: a value cannot be pickled (the key is named), or a ``DTensor`` /
                ``ShardedTensor`` with ``format="torch"``.
            CheckpointTimeout: the previous overlapped copy did not finish within
                ``write_timeout``.
        """
        if self.manager is None:
            raise ConfigError("save() needs AsyncCheckpointer(root=...); use async_save(obj, path) "
                              "for plain per-rank files")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ConfigError(f"step {step} is not newer than the last committed step "
                              f"{self._last_step}; checkpoints are never overwritten")
        if self.format == "dcp" and not (isinstance(state_dict, dict)
                                         and all(isinstance(k, str) for k in state_dict)):
            raise ConfigError("format='dcp' needs a dict with str keys (DCP flattens nested dicts)")
        self._ensure_group()
        rel = self.manager.step_dir(step)
        return self._submit(state_dict, step, self.format, rel, rank_file(self.rank),
                            self.manager.storage.url, True, finalize_fns, overlap=overlap)

    def wait_staged(self) -> None:
        """Block until an overlapped save's background copy is done (no-op otherwise); after it
        the saved tensors may be changed. Blocks at most ``write_timeout``.

        Raises:
            CheckpointTimeout: the copy did not finish in time.
        """
        self._overlap.wait()

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
                fault: dict | None = None, overlap: bool = False) -> SaveRequest:
        if self._closed:
            raise ConfigError("this AsyncCheckpointer is closed; create a new one")
        self._overlap.wait()  # an earlier overlapped copy finishes (and is sent) first
        t0 = time.perf_counter()
        if kind == "dcp":
            skeleton, tensors = self._dcp_planner.plan(obj, self.rank, self._group, self.use_dist)
        else:
            skeleton, tensors = _staging.flatten(obj)
        payload = _staging.pickle_skeleton(skeleton)
        slots, total = _staging.plan_slots(tensors)
        req = SaveRequest(next(_ids), step, kind, rel_dir, file, url, collective,
                          Deadline(self.write_timeout_s), list(finalize_fns), t_submit=t0)
        trailer = pickle.dumps(([s.to_json() for s in slots], payload), protocol=5)
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

        def copy() -> None:
            _stage_fault(fault, late, arena, streams)
            _staging.stage([t for t, _ in late], [s for _, s in late], arena, streams)

        self._overlap.start(copy, lambda error: self._send(req, header, arena, error), step)
        return req

    def _send(self, req: SaveRequest, header: dict[str, Any], arena: _staging.Arena,
              error: BaseException | None) -> None:
        """Hand a staged request to the writer (trainer thread), or fail it if staging failed."""
        req.stage_s = time.perf_counter() - req.t_submit
        if req.state != "writing":
            return  # dropped meanwhile (the writer died with it)
        if error is not None:
            req.state = "failed"
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
            oldest = next((r for r in self.queue if r.state == "writing"), None)
            if oldest is None:
                break  # nothing in flight holds memory; acquire() replaces the free arenas
            self._pump(oldest, blocking=True)

    # -- worker replies ---------------------------------------------------------------------
    def _fail_pending(self, message: str, dead: bool) -> None:
        for req in self.queue:
            if req.state == "writing":
                req.state = "failed"
                req.record = {"ok": False, "error": message, "dead": dead}
                self.pool.release(req.id)
        self.writer.kill()

    def _pump(self, target: SaveRequest, blocking: bool) -> None:
        """Read writer replies until ``target`` is no longer writing (or one poll if not blocking)."""
        while target.state == "writing":
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
            req = next((r for r in self.queue if r.id == reply["id"]), None)
            if req is not None:
                req.state = "written" if reply["ok"] else "failed"
                req.record, req.extra = reply, extra
                self.pool.release(req.id)
        # write_timeout counts from when the writer can start a request, not from its queueing
        nxt = next((r for r in self.queue if r.state == "writing"), None)
        if nxt is not None:
            nxt.deadline = Deadline(self.write_timeout_s)

    # -- finalize ----------------------------------------------------------------------------
    def maybe_finalize(self, blocking: bool = False) -> list[int | None]:
        """Finalize finished saves in FIFO order; returns their steps (None for async_save files).

        Non-blocking: one scalar all-reduce per call tells whether the head finished on every
        rank. Blocking: waits (bounded by write_timeout + collective_timeout) for all saves.

        Raises:
            CheckpointWriteError / CheckpointWorkerError: a save failed on some rank (all ranks
                raise, the failed save is dropped, later saves stay queued).
            CheckpointTimeout: a collective of the finalize timed out.
        """
        self._overlap.wait(blocking)
        done: list[int | None] = []
        while self.queue:
            head = self.queue[0]
            self._pump(head, blocking)
            if not blocking and not self._all_ready(head):
                break
            self.queue.popleft()
            try:
                self._finalize(head)
            except CheckpointWriteError as exc:
                if self.on_error == "raise":
                    raise
                self.failed_saves += 1
                _log.warning("checkpoint save failed (on_error='log', continuing): %s", exc)
                continue
            done.append(head.step)
        return done

    def _all_ready(self, head: SaveRequest) -> bool:
        ready = head.state != "writing"
        if not head.collective or not self.use_dist:
            return ready
        flag = torch.tensor([1 if ready else 0], dtype=torch.int32)
        self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _collective(self, fn: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except RuntimeError as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise CheckpointTimeout(f"checkpoint collective {fn.__name__} timed out after "
                                        f"{self.collective_timeout_s:.1f} s: {exc}") from exc
            raise

    def _finalize(self, req: SaveRequest) -> None:
        record = {"rank": self.rank, "step": req.step, "kind": req.kind,
                  "ok": req.record.get("ok", False), "error": req.record.get("error"),
                  "dead": req.record.get("dead", False), "files": req.record.get("files", {})}
        if req.collective:
            group = self._group if self.use_dist else None
            try:
                commit_collective(self.manager, record, req.extra, group, self.rank,  # type: ignore[arg-type]
                                  self.world_size)
            except RuntimeError as exc:
                if "timeout" in str(exc).lower():
                    raise CheckpointTimeout(f"finalize of step {req.step} timed out: {exc}") from exc
                raise
            req.durable_s = time.perf_counter() - req.t_submit
            self._last_step = req.step
            if self.rank == 0:
                self.manager.prune()  # type: ignore[union-attr]
        else:
            failures = {} if record["ok"] else {self.rank: record["error"]}
            raise_for_failures(None, failures, record["dead"])
            req.durable_s = time.perf_counter() - req.t_submit
        for fn in req.finalize_fns:
            fn()

    def is_written(self, req: SaveRequest) -> bool:
        """Local, non-blocking: has the writer finished ``req`` (successfully or not)?"""
        self._overlap.wait(blocking=False)
        self._pump(req, blocking=False)
        return req.state != "writing"

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
        return self.queue[0].deadline.elapsed() if self.queue else 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    def abort(self) -> None:
        """Kill the writer and drop every queued save without collectives (restart path).

        Safe from any thread of the trainer; the next ``save`` respawns the writer and recreates
        the checkpointer's process group (re-reading rank and world size). With
        ``keep_idle_writer`` a writer that owes no reply is kept.
        """
        self._overlap.drop()
        if not (self.keep_idle_writer and self.writer.alive()
                and all(r.state != "writing" for r in self.queue)):
            self.writer.kill()
        for req in self.queue:
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

    def close(self, finalize: bool = True) -> None:
        """Finalize pending saves (if ``finalize``), stop the writer, unlink staging memory."""
        try:
            if finalize and self.queue:
                self.wait()
        finally:
            if not finalize:
                self.abort()
            self._overlap.drop()
            self._overlap.close()
            self._closed = True
            self._finalizer()

    def __enter__(self) -> AsyncCheckpointer:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finalize=exc_type is None)


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
    writer.stop(grace_s=2.0)
    pool.close()
