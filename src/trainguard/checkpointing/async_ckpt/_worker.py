"""The persistent writer process (one per trainer rank, started with ``spawn``).

Loop: receive a JSON request header plus the pickled skeleton, map the staging arena, write the
file(s) atomically (tmp -> fsync -> rename -> dir fsync) with xxh3 checksums, reply with a JSON
record. Rank 0's writer also commits (``op: commit``): the DCP ``.metadata``, the manifest last,
``latest`` and keep-last pruning, off the trainer's threads. Errors are replied as JSON records
(errno, file, message), never as pickles; an I/O error inside ``torch.save`` is reported as the
OSError itself (e.g. "No space left on device") with the path and sizes. Requests and replies are
``_core.ipc`` messages (kind 1) on the socket the trainer passed as a descriptor. The worker exits
when asked, when its pipe closes (one line on stderr, no traceback), or when its parent dies.
``op: reset`` (no reply) unmaps every arena it was sent: the trainer parks an idle writer in its
process-wide pool of warm writers (``_pool``) and another checkpointer may take it.

Fault injection (test seam): a request may carry ``fault`` = {"phase", "action", "errno"}; phases
are ``recv`` (before writing), ``write``/``fsync``/``replace`` (patched ``os`` calls), ``reply``
(after the files are durable, before replying), ``commit`` (rank 0's writer, before the
manifest) and ``commit:write``/``commit:fsync``/``commit:replace`` (patched during the commit;
``target`` limits the fault to calls naming that file, e.g. ``latest``); actions ``exit``,
``sigkill``, ``hang``, ``errno``, and (phase ``recv`` only) ``slow``: sleep ``seconds``, then write.
"""

from __future__ import annotations

import errno as errno_mod
import os
import pickle
import select
import signal
import time
from contextlib import contextmanager
from typing import Any

from trainguard._core.ipc import FrameReader, decode_msg, send_msg
from trainguard._core.proctitle import set_title

__all__ = ["worker_main"]

_MSG = 1  # the one frame kind on the writer socket (see _writer.py)
_OS_CALLS = {"write": "write", "fsync": "fsync", "replace": "replace"}


def _act(action: str, err: int) -> None:
    if action == "exit":
        os._exit(17)
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "errno":
        raise OSError(err, os.strerror(err))


@contextmanager
def _patched(fault: dict[str, Any] | None, prefix: str = ""):
    """Patch os.write/os.fsync/os.replace to fire ``fault`` on its first call (on the first call
    naming a file called ``fault["target"]``, if given). ``prefix`` selects commit-time phases
    (``commit:replace`` ...)."""
    phase = (fault or {}).get("phase") or ""
    if not phase.startswith(prefix) or phase[len(prefix):] not in _OS_CALLS:
        yield
        return
    assert fault is not None
    name = _OS_CALLS[phase[len(prefix):]]
    original = getattr(os, name)
    target = fault.get("target")

    def faulty(*args, **kwargs):
        names = {os.path.basename(os.fspath(a)) for a in args if isinstance(a, (str, os.PathLike))}
        if target is None or target in names:
            _act(fault["action"], int(fault.get("errno", errno_mod.ENOSPC)))
        return original(*args, **kwargs)

    setattr(os, name, faulty)
    try:
        yield
    finally:
        setattr(os, name, original)


def _os_error_in_chain(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: torch.save turns a failed ``write()`` of its file object into
    ``RuntimeError: unexpected pos``, keeping the OSError only as the context."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _free_bytes(storage, rel: str) -> str:
    try:
        st = os.statvfs(os.path.dirname(storage.full_path(rel)))
    except (OSError, AttributeError, ValueError):
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} bytes free"


def _write_error(exc: BaseException, storage, rel: str, written: int, total: int) -> BaseException:
    """Name the real I/O error (e.g. ENOSPC), the file and the sizes; other errors unchanged."""
    err = _os_error_in_chain(exc)
    if err is None or exc is err and err.filename:
        return exc
    reason = err.strerror or str(err)
    return OSError(err.errno, f"{reason}: writing {storage.full_path(rel)} failed after {written} "
                   f"of ~{total} bytes ({_free_bytes(storage, rel)} on that filesystem)")


def _write_torch(storage, rel_dir: str, name: str, obj: Any, rank: int, total: int) -> dict:
    import torch

    rel = f"{rel_dir}/{name}" if rel_dir else name
    f = storage.open_atomic(rel)
    try:
        torch.save(obj, f)
        size, digest = f.commit()
    except BaseException as exc:
        mapped = _write_error(exc, storage, rel, f.tell(), total)  # free space before cleanup
        f.abort()
        if mapped is exc:
            raise
        raise mapped from exc
    return {name: {"size": size, "xxh3": digest, "rank": rank}}


def _write_dcp(storage, rel_dir: str, obj: Any, rank: int, total: int) -> tuple[dict, bytes]:
    """Write this rank's planned items in DCP's file format; return file info and (plan, results).

    ``obj`` comes from the trainer's planner (``_dcp_plan``): the deduplicated local plan and,
    per write item, a staged tensor (a local shard) or the item's bytes.
    """
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    name = f"__{rank}_0.distcp"
    f = storage.open_atomic(f"{rel_dir}/{name}")
    results = []
    try:
        for item, data in obj["items"]:
            offset = f.tell()
            if item.type == WriteItemType.BYTE_IO:
                f.write(data)
            else:
                torch.save(data, f)
            length = f.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
        size, digest = f.commit()
    except BaseException as exc:
        mapped = _write_error(exc, storage, f"{rel_dir}/{name}", f.tell(), total)
        f.abort()
        if mapped is exc:
            raise
        raise mapped from exc
    return ({name: {"size": size, "xxh3": digest, "rank": rank}},
            pickle.dumps((obj["dcp_plan"], results)))


_DCP_WRITE_MODULES = ("torch.distributed.checkpoint.filesystem",
                      "torch.distributed.checkpoint.planner",
                      "torch.distributed.checkpoint.storage",
                      "torch.distributed.checkpoint.default_planner")


def _warm_dcp_in_background() -> None:
    """Import what a DCP write and commit use, in a daemon thread (``op: warm``): a cold DCP
    import (it pulls in sympy) takes seconds, on a loaded machine more than a soft timeout, and
    would otherwise be paid inside the first save of a checkpointer made after a restart. A
    save that arrives meanwhile waits on the import lock only for what is still missing."""
    import importlib
    import sys
    import threading

    if all(m in sys.modules for m in _DCP_WRITE_MODULES):
        return

    def run() -> None:
        for name in _DCP_WRITE_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the save imports again and reports it there
                return

    threading.Thread(target=run, name="trainguard-writer-dcp-import", daemon=True).start()


class _Worker:
    def __init__(self, fd: int, parent_pid: int) -> None:
        import socket

        self.fd, self.parent_pid = fd, parent_pid
        self.reader = FrameReader(fd)
        self.sock = socket.socket(fileno=os.dup(fd))
        self.maps: dict[str, Any] = {}
        self.storages: dict[str, Any] = {}

    def receive_arena(self, name: str) -> None:
        import socket

        from trainguard.checkpointing._staging import open_mapping

        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if not fds:
            raise ConnectionError("arena descriptor expected from the trainer")
        self.release(name)
        self.maps[name] = open_mapping(fds[0])

    def storage(self, url: str):
        from trainguard.checkpointing.storage import storage_for

        if url not in self.storages:
            self.storages[url] = storage_for(url)
        return self.storages[url]

    def release(self, path: str) -> None:
        mm = self.maps.pop(path, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # tensors of the last request still alive; GC frees them
                pass

    def save(self, req: dict[str, Any]) -> tuple[dict, bytes | None]:
        from trainguard.checkpointing._staging import TensorSlot, rebuild

        fault = req.get("fault")
        if fault and fault["phase"] == "recv" and fault["action"] == "slow":
            time.sleep(float(fault.get("seconds", 1.0)))  # a writer that falls behind
        elif fault and fault["phase"] == "recv":
            _act(fault["action"], int(fault.get("errno", errno_mod.ENOSPC)))
        mm = self.maps[req["arena"]]
        offset, length = req["trailer"]
        raw_slots, skeleton = pickle.loads(mm[offset : offset + length])
        obj = rebuild(skeleton, mm, [TensorSlot.from_json(s) for s in raw_slots])
        storage = self.storage(req["storage"])
        if req["dir"]:
            storage.makedirs(req["dir"])
        extra = None
        with _patched(fault):
            if req["kind"] == "dcp":
                files, extra = _write_dcp(storage, req["dir"], obj, req["rank"], offset)
            else:
                files = _write_torch(storage, req["dir"], req["file"], obj, req["rank"], offset)
        del obj
        if fault and fault["phase"] == "reply":
            _act(fault["action"], int(fault.get("errno", errno_mod.ENOSPC)))
        return {"id": req["id"], "ok": True, "files": files}, extra

    def commit(self, req: dict[str, Any], payload: bytes) -> tuple[dict, bytes | None]:
        """Rank 0's writer: write the manifest of a save every rank wrote, then prune."""
        from trainguard.checkpointing.async_ckpt._commit import run_commit

        extras = pickle.loads(payload) if req.get("has_extras") else None
        fault = req.get("fault")
        if fault and fault["phase"] == "commit":
            _act(fault["action"], int(fault.get("errno", errno_mod.ENOSPC)))
        with _patched(fault, prefix="commit:"):
            reply = run_commit(self.storage(req["storage"]), req, extras)
        return {"id": req["id"], "op": "commit", **reply}, None

    def handle(self, req: dict[str, Any], payload: bytes = b"") -> bool:
        if req["op"] == "exit":
            return False
        if req["op"] == "release":
            self.release(req["arena"])
            return True
        if req["op"] == "warm":  # its owner writes DCP: import those modules before a save
            if req.get("dcp"):
                _warm_dcp_in_background()
            return True
        if req["op"] == "title":  # its checkpointer learned its rank (rebind): ps and logs
            os.environ["RANK"] = str(req["rank"])
            _title(int(req["rank"]))
            return True
        if req["op"] == "reset":  # back to the pool, or taken from it: hold nothing of anyone
            for name in list(self.maps):
                self.release(name)
            if "rank" in req:  # taken by a checkpointer of this rank
                os.environ["RANK"] = str(req["rank"])
                _title(int(req["rank"]))
            else:  # parked in the pool
                _title(int(os.environ.get("RANK", "-1")), " (pooled, idle)")
            return True
        if req.get("arena_fd"):
            self.receive_arena(req["arena"])
        t0 = time.monotonic()
        try:
            reply, extra = (self.commit(req, payload) if req["op"] == "commit"
                            else self.save(req))
        except Exception as exc:  # noqa: BLE001 - every write failure goes back to the trainer as a record
            reply, extra = {
                "id": req["id"], "op": req["op"], "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "errno": getattr(exc, "errno", None), "file": getattr(exc, "filename", None),
            }, None
        reply["write_s"] = time.monotonic() - t0
        reply["has_extra"] = extra is not None
        try:
            send_msg(self.fd, _MSG, reply, extra or b"")
        except OSError as exc:  # the trainer is gone (crash or abort): nobody to report to
            _log_quiet_exit(int(os.environ.get("RANK", "-1")), exc)
            return False
        return True

    def run(self) -> None:
        while True:
            if not select.select([self.fd], [], [], 1.0)[0]:
                if os.getppid() != self.parent_pid:
                    return  # orphaned: the trainer died
                continue
            try:
                req, payload = decode_msg(self.reader.recv()[1])
            except (EOFError, OSError, ValueError):
                return
            if not self.handle(req, payload):
                return


def _fast_torch_save() -> None:
    """Skip torch.save's zip CRC32 (a slow second pass); every file carries an xxh3 instead."""
    try:
        from torch.utils.serialization import config

        config.save.compute_crc32 = False
    except (ImportError, AttributeError):  # older torch: keep the default
        pass


def worker_main(fd: int, parent_pid: int, rank: int, nice: int = 0) -> None:
    """Entry point of the writer process (runs until told to exit or orphaned)."""
    os.environ["RANK"] = str(rank)
    _title(rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which stops us
    if nice:
        try:
            os.nice(nice)  # optional: keep the writer from competing with the trainer's threads
        except OSError:
            pass
    _fast_torch_save()
    worker = _Worker(fd, parent_pid)
    try:
        send_msg(fd, _MSG, {"ready": True, "pid": os.getpid()})
        worker.run()
    except (OSError, EOFError) as exc:  # the trainer closed its end (restart, abort, crash)
        _log_quiet_exit(rank, exc)
    finally:
        for path in list(worker.maps):
            worker.release(path)


def _title(rank: int, state: str = "") -> None:
    """``ps`` shows ``trainguard: rank R ckpt writer`` (``... (pooled, idle)`` while parked)."""
    set_title(f"trainguard: rank {rank} ckpt writer{state}", f"tg-ckpt{rank}")


def _log_quiet_exit(rank: int, exc: BaseException) -> None:
    """One line instead of a traceback in the rank's log: a closed pipe is a normal way to end."""
    import sys

    sys.stderr.write(f"trainguard checkpoint writer pid {os.getpid()} (rank {rank}): the trainer "
                     f"closed the connection ({type(exc).__name__}); exiting\n")
    sys.stderr.flush()


if __name__ == "__main__":
    import sys

    worker_main(int(sys.argv[1]), int(sys.argv[2]),
                int(sys.argv[3]), int(sys.argv[4]))
    # Every file is fsynced and replied before this point: skip the interpreter's teardown
    # (torch's atexit work and module cleanup took seconds on a loaded machine, and the trainer's
    # ``close()`` waits for this exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
