"""The parent side: :class:`DistributedRunner` drives one spawned process per rank.

Channels per rank: an inbox pipe (parent -> rank frames), an outbox pipe (rank -> parent; one
reply channel per rank, so a rank killed mid-write cannot corrupt another rank's replies) and a
death pipe the rank watches for the parent's exit. The parent waits with one ``poll`` on every
outbox and every process sentinel, so a dead rank is noticed within milliseconds.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing.util  # noqa: F401 - its exit hook must be registered before ours (LIFO)
import pickle
import select
from datetime import timedelta
from typing import Any

from trainguard._core.clock import Deadline
from trainguard._core.ipc import FrameReader, send_frame
from trainguard._core.logging import get_logger
from trainguard._core.procs import describe_exit, spawn_context
from trainguard._core.shm import ShmAllocationError, sweep_prefix, sweep_stale, unique_prefix
from trainguard.runner import _child as proto
from trainguard.runner import _validate as check
from trainguard.runner._stop import exit_status, sigint_ignored, stop_ranks
from trainguard.runner._transport import Receiver, Sender
from trainguard.runner.errors import (
    RankDesync,
    SharedSlotAllocationFailed,
    WorkerCrashed,
    WorkerTimeout,
)

__all__ = ["DistributedRunner"]

_log = get_logger("trainguard.runner")
_UNUSABLE = "the runner is unusable: call shutdown() and construct a new DistributedRunner"


class _Error:
    """A rank's decoded exception reply."""

    __slots__ = ("exc", "transport", "type_name")

    def __init__(self, rank: int, body: memoryview) -> None:
        self.type_name, payload, tb, self.transport = pickle.loads(body)
        try:
            self.exc = pickle.loads(payload)
        except Exception:  # noqa: BLE001 - e.g. the exception's module is not importable here
            self.exc = RuntimeError(f"{self.type_name}: (exception could not be unpickled)")
        if hasattr(self.exc, "add_note"):
            self.exc.add_note(f"raised in rank {rank}; remote traceback:\n{tb.rstrip()}")


class DistributedRunner:
    """Run ``world_size`` copies of a worker class as one model, one spawned process per rank.

    Every call sends the same input to every rank, waits for all of them and returns rank 0's
    result. Contract (one calling thread, one outstanding call):

    * all ranks raise the same exception type -> rank 0's exception, runner stays healthy; an
      exception that cannot be pickled arrives as ``RuntimeError("<module.Type>: <message>")``;
    * mixed success or different types -> :class:`RankDesync`; a rank dies ->
      :class:`WorkerCrashed` (rank, exit code or signal); no answer in ``call_timeout`` ->
      :class:`WorkerTimeout` (a ``TimeoutError``); a ``KeyboardInterrupt`` mid-call propagates.
      All of these leave the runner unusable: :meth:`shutdown` it and construct a new one;
    * shared memory cannot be reserved -> :class:`SharedSlotAllocationFailed` (a ``MemoryError``)
      raised inside the call; the runner stays usable.

    Contiguous NumPy arrays >= 64 KiB travel through shared memory (``/dev/shm/tg_r*``); with
    ``transfer="copy"`` received arrays are private copies (into pooled, pre-faulted buffers),
    with ``transfer="view"`` they are read-only views valid until the next call.

    Args:
        worker_cls: top-level class with ``load``, ``generate``, ``reset`` (see
            :class:`~trainguard.runner.DistributedWorker`); constructed with no arguments.
        world_size: number of rank processes, an ``int`` >= 1.
        load_kwargs: passed to every rank's ``load``; values must be picklable.
        call_timeout: limit for one ``generate``/``reset`` (seconds or ``timedelta``).
        start_timeout: limit for spawning, process-group set-up and ``load`` on every rank.
        init_process_group: with ``world_size > 1``, initialise ``torch.distributed`` in each rank
            (NCCL with CUDA, else Gloo) on a rendezvous port chosen by the OS.
        transfer: ``"copy"`` or ``"view"``, how received arrays are handed out (both directions).
        shm_bytes: shared memory reserved up front for inputs and for rank 0's results (bytes).

    Raises:
        ValueError (ConfigError): bad ``world_size``, timeout, ``transfer`` or ``shm_bytes``.
        TypeError: ``worker_cls`` lacks a method or is not importable by name (defined in a
            function); a ``load_kwargs`` value cannot be pickled.

    Follows: reactor-runtime ``DistributedRunner`` (names, defaults, outcome policy); differs by
    sentinel-based death detection, per-rank reply pipes, pooled receive buffers and
    ``posix_fallocate``-reserved shared memory.
    """

    def __init__(self, worker_cls: type, *, world_size: int = 1,
                 load_kwargs: dict[str, Any] | None = None,
                 call_timeout: float | timedelta = 30.0, start_timeout: float | timedelta = 3600.0,
                 init_process_group: bool = True, transfer: str = "copy",
                 shm_bytes: int = 1 << 20) -> None:
        self._world_size = check.check_world_size(world_size)
        self._worker_cls = check.check_worker_cls(worker_cls)
        self._load_kwargs = check.check_load_kwargs(load_kwargs)
        self._call_timeout_s = check.check_timeout(call_timeout, "call_timeout")
        self._start_timeout_s = check.check_timeout(start_timeout, "start_timeout")
        check.check_options(transfer, shm_bytes)
        self._init_pg = bool(init_process_group)
        self._transfer, self._shm_bytes = transfer, shm_bytes
        self._state = "new"  # new -> starting -> started -> closed
        self._broken: str | None = None
        self._procs: list[Any] = []
        self._inboxes: list[int] = []
        self._readers: list[FrameReader] = []
        self._conns: list[Any] = []  # parent-side Connections, kept open until shutdown
        self._fdmap: dict[int, tuple[int, bool]] = {}  # fd -> (rank, is_sentinel)
        self._poller = select.poll()
        self._exited: set[int] = set()
        self._prefix = ""
        self._sender: Sender | None = None
        self._receiver = Receiver(transfer)

    # -- properties -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The configured number of ranks."""
        return self._world_size

    @property
    def healthy(self) -> bool:
        """Started, not shut down, and no crash/timeout/desync/interrupt so far (not a watchdog)."""
        return self._state == "started" and self._broken is None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn every rank, set up the process group, run ``load`` everywhere; block until done.

        Blocks at most ``start_timeout``. On any failure (including ``KeyboardInterrupt``) the
        ranks are shut down before the error propagates.

        Raises:
            RuntimeError: called a second time.
            Exception: the first ``load()`` (or worker construction) error, unchanged.
            WorkerCrashed: a rank died before it was ready. WorkerTimeout: not ready in time.
            SharedSlotAllocationFailed: the up-front ``shm_bytes`` could not be reserved.
        """
        if self._state != "new":
            raise RuntimeError("DistributedRunner.start() was already called; a runner starts "
                               "once, construct a new one")
        self._state = "starting"
        atexit.register(self._atexit_shutdown)  # after multiprocessing.util's hook: runs first
        try:
            self._launch()
            self._await_loaded(Deadline(self._start_timeout_s))
        except BaseException as exc:
            self._broken = self._broken or f"start failed: {type(exc).__name__}"
            self.shutdown()
            if isinstance(exc, ShmAllocationError):
                raise _slot_failed(exc) from exc
            raise
        self._state = "started"

    def _launch(self) -> None:
        ctx = spawn_context()
        sweep_stale("r")
        self._prefix = unique_prefix("r")
        for rank in range(self._world_size):
            spec = proto.ChildSpec(self._worker_cls, rank, self._world_size, self._load_kwargs,
                                   self._init_pg, self._prefix, self._shm_bytes, self._transfer,
                                   self._start_timeout_s)
            inbox_r, inbox_w = ctx.Pipe(duplex=False)
            outbox_r, outbox_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            self._conns += [inbox_w, outbox_r, death_w]
            proc = ctx.Process(target=proto.child_main, name=f"tg-runner-rank{rank}",
                               args=(spec, inbox_r, outbox_w, death_r), daemon=False)
            with sigint_ignored():  # inherited across exec until the rank has its own group
                proc.start()
            self._procs.append(proc)
            for conn in (inbox_r, outbox_w, death_r):
                conn.close()
            self._inboxes.append(inbox_w.fileno())
            self._readers.append(FrameReader(outbox_r.fileno()))
            for fd, is_sentinel in ((outbox_r.fileno(), False), (proc.sentinel, True)):
                self._fdmap[fd] = (rank, is_sentinel)
                self._poller.register(fd, select.POLLIN)

    def _await_loaded(self, deadline: Deadline) -> None:
        pending = set(range(self._world_size))
        while pending:
            for rank, kind, body in self._frames(pending, deadline, "start"):
                if kind == proto.READY:  # rank 0's store port: relay it to the others
                    self._broadcast(proto.JOIN, bytes(body), "start", first=1)
                elif kind == proto.LOADED:
                    pending.discard(rank)
                    if rank == 0 and self._shm_bytes:  # rank 0's result reservation
                        self._receiver.attach(self._prefix + "o0")
                elif kind == proto.ERROR:
                    err = _Error(rank, body)
                    raise err.exc
        self._reserve_inputs()

    def _reserve_inputs(self) -> None:
        """Reserve ``shm_bytes`` for inputs, have every rank map it, then drop its name."""
        self._sender = Sender(self._prefix + "i", self._shm_bytes)
        segment = self._sender.slot.segment
        if segment is not None:
            self._call(proto.ATTACH, segment.name.encode(), "attach")  # then unlinks the name

    def shutdown(self) -> None:
        """End the ranks and release the runner's shared memory. Idempotent; also run at exit.

        A healthy runner asks ranks to exit and waits up to 10 s; an unusable one (or stragglers)
        gets SIGTERM to each rank's process group, then SIGKILL after 5 s; every rank is reaped.
        """
        if self._state == "closed":
            return
        cooperative = self._state == "started" and self._broken is None
        self._state = "closed"
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit_shutdown)
        try:
            stop_ranks(self._procs, self._inboxes if cooperative else [], grace_s=10.0)
        finally:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
            self._receiver.close()
            if self._sender is not None:
                self._sender.close()
            if self._prefix:
                sweep_prefix(self._prefix)  # rank 0's result blocks, even after a kill mid-growth

    def _atexit_shutdown(self) -> None:
        try:
            self.shutdown()
        except Exception as exc:  # noqa: BLE001 - interpreter is exiting: report, never raise
            _log.warning("runner shutdown at exit failed: %s", exc)

    def __enter__(self) -> DistributedRunner:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- calls ------------------------------------------------------------------------------
    def generate(self, input: Any, /) -> Any:
        """Send ``input`` to every rank, wait for all, return rank 0's result.

        Blocks at most ``call_timeout``. See the class docstring for the failure contract.

        Raises:
            RuntimeError: not started, shut down or unusable.
            RankDesync, WorkerCrashed, WorkerTimeout, SharedSlotAllocationFailed, or the
            workers' own exception (all ranks raised that type).
        """
        self._check_usable("generate")
        try:
            body = self._sender.encode(input)  # type: ignore[union-attr]
        except ShmAllocationError as exc:
            raise _slot_failed(exc) from exc
        return self._call(proto.GENERATE, body, "generate")

    def reset(self) -> None:
        """Call every rank's ``reset()`` and wait (at most ``call_timeout``); same contract."""
        self._check_usable("reset")
        self._call(proto.RESET, b"", "reset")

    def _check_usable(self, what: str) -> None:
        if self._state != "started":
            state = "not started: call start() first" if self._state == "new" else "shut down"
            raise RuntimeError(f"cannot {what}(): the runner is {state}")
        if self._broken is not None:
            raise RuntimeError(f"cannot {what}(): {_UNUSABLE} (cause: {self._broken})")

    def _call(self, kind: int, body: bytes, what: str) -> Any:
        deadline = Deadline(self._call_timeout_s)
        replies: dict[int, Any] = {}
        try:
            for rank in sorted(self._exited):
                self._crashed(rank, what)
            self._broadcast(kind, body, what)
            pending = set(range(self._world_size))
            while pending:
                for rank, rkind, rbody in self._frames(pending, deadline, what, replies):
                    pending.discard(rank)
                    if rkind == proto.ERROR:
                        replies[rank] = _Error(rank, rbody)
                    elif rkind == proto.RESULT:
                        replies[rank] = self._receiver.decode(rbody)
                    else:
                        replies[rank] = None
        except BaseException as exc:
            self._broken = self._broken or f"{what}() failed: {type(exc).__name__}"
            raise
        self._sender.release_name()  # type: ignore[union-attr]  # every rank has mapped it
        return self._resolve(replies)

    def _broadcast(self, kind: int, body: bytes, what: str, first: int = 0) -> None:
        for rank in range(first, self._world_size):
            try:
                send_frame(self._inboxes[rank], kind, body)
            except BrokenPipeError:
                self._crashed(rank, what)

    def _frames(self, pending: set[int], deadline: Deadline, what: str,
                replies: dict[int, Any] | None = None):
        """Yield ``(rank, kind, body)`` frames from pending ranks; raise on death or timeout."""
        if deadline.expired():
            self._timed_out(pending, deadline, what, replies or {})
        events = self._poller.poll(math.ceil(deadline.remaining() * 1000))
        if not events:
            self._timed_out(pending, deadline, what, replies or {})
        # Replies first: a rank that answered and then exited is not a crash.
        for fd, _ in sorted(events, key=lambda e: self._fdmap[e[0]][1]):
            rank, is_sentinel = self._fdmap[fd]
            if is_sentinel:
                self._on_exit(rank, pending, what)
                continue
            if rank not in pending:
                if rank in self._exited:  # a dead rank's EOF after its last reply: no wake-ups
                    self._drop_fds(rank, sentinel_only=False)
                continue
            try:
                kind, body = self._readers[rank].recv()
            except EOFError:
                self._crashed(rank, what)
            yield rank, kind, body

    def _on_exit(self, rank: int, pending: set[int], what: str) -> None:
        self._exited.add(rank)
        # A dying process's pipes close one by one: its sentinel can wake us before its reply
        # pipe shows the reply or EOF. A readable reply pipe stays watched (the reply, else EOF
        # -> WorkerCrashed, is read next); dropping it too left a SIGKILLed rank to the call
        # timeout (CI: 30 s, WorkerTimeout instead of WorkerCrashed).
        readable = _readable(self._readers[rank].fd)
        self._drop_fds(rank, sentinel_only=readable)
        if rank in pending and not readable:
            self._crashed(rank, what)

    def _drop_fds(self, rank: int, sentinel_only: bool) -> None:
        """Stop level-triggered wake-ups from a dead rank's sentinel (and its reply pipe)."""
        for fd, (r, is_sentinel) in list(self._fdmap.items()):
            if r == rank and (is_sentinel or not sentinel_only):
                self._poller.unregister(fd)
                del self._fdmap[fd]

    def _crashed(self, rank: int, what: str) -> None:
        proc = self._procs[rank]
        code = exit_status(proc)
        hint = ""
        if what == "start" and code == 1:
            # the usual cause: spawn re-imports the caller's script, which starts a runner again
            hint = (" If the script creates the runner at module level, put that code under "
                    "`if __name__ == \"__main__\":` (ranks use the spawn start method, which "
                    "re-imports the main module).")
        raise WorkerCrashed(
            f"rank {rank} (pid {proc.pid}) died during {what}() without answering: "
            f"{describe_exit(code)}; see its stderr for the traceback (faulthandler is on).{hint} "
            f"{_UNUSABLE}", rank=rank, pid=proc.pid, exitcode=code)

    def _timed_out(self, pending: set[int], deadline: Deadline, what: str,
                   replies: dict[int, Any]) -> None:
        silent = sorted(pending)
        failed = sorted(r for r, v in replies.items() if isinstance(v, _Error))
        if failed:  # peers likely wait in a collective the failing rank never joined
            first = failed[0]
            raise RankDesync(
                f"{what}(): rank {first} raised {replies[first].type_name} while rank(s) "
                f"{silent} did not answer within {deadline.timeout_s:.1f} s (probably blocked in "
                f"a collective); {_UNUSABLE}", rank=first,
                outcomes={r: "no answer" for r in silent}) from replies[first].exc
        raise WorkerTimeout(
            f"{what}(): rank(s) {silent} did not answer within {deadline.timeout_s:.1f} s "
            f"({'start_timeout' if what == 'start' else 'call_timeout'}); {_UNUSABLE} "
            "(shutdown() kills the ranks)", ranks=silent, timeout_s=deadline.timeout_s)

    def _resolve(self, replies: dict[int, Any]) -> Any:
        errors = {r: v for r, v in replies.items() if isinstance(v, _Error)}
        if not errors:
            return replies[0]
        first = min(errors)
        if errors.get(0) is not None and errors[0].transport and len(errors) == 1:
            raise _slot_failed(errors[0].exc) from errors[0].exc
        if len(errors) == self._world_size and len({e.type_name for e in errors.values()}) == 1:
            raise errors[0].exc
        outcomes = {r: (replies[r].type_name if r in errors else "ok") for r in sorted(replies)}
        self._broken = f"rank desync {outcomes}"
        raise RankDesync(f"ranks disagreed: {outcomes}; first failure on rank {first}: "
                         f"{errors[first].type_name}: {errors[first].exc}; {_UNUSABLE}",
                         rank=first, outcomes=outcomes) from errors[first].exc


def _slot_failed(exc: BaseException) -> SharedSlotAllocationFailed:
    if isinstance(exc, ShmAllocationError):
        return SharedSlotAllocationFailed(str(exc), exc.requested_bytes, exc.free_bytes,
                                          exc.total_bytes)
    return SharedSlotAllocationFailed(str(exc))


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])
