"""Shared memory, one mechanism: named POSIX segments with explicit ownership, growable writer
slots, and unnamed (``memfd``) segments handed to a peer as a file descriptor.

Every trainguard segment name starts with ``tg_`` (the test leak checker looks for
``/dev/shm/tg_*``). Only the creating :class:`ShmSegment` (the *owner*) unlinks; attaching never
registers anything with ``multiprocessing.resource_tracker``, so a reader's exit can never unlink
a writer's block and no "leaked shared_memory" warnings appear at exit (cpython gh-82300).

Space is reserved with ``posix_fallocate`` when the segment is created: on tmpfs ``ftruncate``
past the free space succeeds and the first write past it kills the writer with SIGBUS, whereas
``posix_fallocate`` fails cleanly with ENOSPC, which becomes :class:`ShmAllocationError`.

Follows: ``multiprocessing.shared_memory`` (same ``shm_open``/``mmap`` calls) minus its tracker.
"""

from __future__ import annotations

import _posixshmem
import errno
import mmap
import os
import re
import secrets
import struct
import time

__all__ = [
    "SHM_DIR",
    "fork_shared",
    "map_fd",
    "memfd_segment",
    "SHM_PREFIX",
    "ShmAllocationError",
    "ShmSegment",
    "RecordArea",
    "ShmSlot",
    "shm_space",
    "sweep_prefix",
    "sweep_stale",
    "unique_prefix",
]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tg_"
_MAX_NAME = 30  # macOS limits names to 31 characters including the leading "/"


class ShmAllocationError(MemoryError):
    """A shared-memory segment could not be created or reserved.

    Attributes:
        name: segment name. requested_bytes: size asked for. free_bytes / total_bytes: space of
        ``/dev/shm`` at the time (``-1`` when unknown).
    """

    def __init__(self, name: str, requested_bytes: int, free_bytes: int, total_bytes: int,
                 reason: str) -> None:
        self.name, self.requested_bytes, self.reason = name, requested_bytes, reason
        self.free_bytes, self.total_bytes = free_bytes, total_bytes
        mib = 1 << 20
        super().__init__(
            f"cannot reserve {requested_bytes / mib:.1f} MiB of shared memory for {name!r} "
            f"({reason}); {SHM_DIR} has {free_bytes / mib:.1f} MiB free of "
            f"{total_bytes / mib:.1f} MiB. Fix: enlarge {SHM_DIR} (docker run --shm-size=8g; "
            "the Docker default is 64 MB; Kubernetes: mount an emptyDir with medium: Memory at "
            f"{SHM_DIR}) or send smaller arrays"
        )

    def __reduce__(self):
        args = (self.name, self.requested_bytes, self.free_bytes, self.total_bytes, self.reason)
        return (type(self), args)


def shm_space() -> tuple[int, int]:
    """``(free_bytes, total_bytes)`` of :data:`SHM_DIR`, ``(-1, -1)`` where it does not exist."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return -1, -1
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def unique_prefix(tag: str) -> str:
    """A fresh segment-name prefix ``tg_<tag><pid hex>_<4 hex>_`` naming this process as owner."""
    prefix = f"{SHM_PREFIX}{tag}{os.getpid():x}_{secrets.token_hex(2)}_"
    if len(prefix) > _MAX_NAME - 4:
        raise ValueError(f"shared-memory prefix {prefix!r} is too long; use a shorter tag")
    return prefix


class ShmSegment:
    """One named segment, mapped read-write. The creator owns it and unlinks it in :meth:`close`.

    Raises (constructor):
        ShmAllocationError: ``create=True`` and the space cannot be reserved.
        FileNotFoundError: ``create=False`` and no segment has that name.
    """

    def __init__(self, name: str, size: int = 0, *, create: bool = False) -> None:
        if not name.startswith(SHM_PREFIX) or len(name) > _MAX_NAME:
            raise ValueError(f"segment name {name!r} must start with {SHM_PREFIX!r}, <= 30 chars")
        self.name, self.owner = name, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                self._reserve(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self.mmap = mmap.mmap(fd, size)
        except BaseException:
            if create:
                _unlink("/" + name)
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self.mmap)

    def _reserve(self, fd: int, size: int) -> None:
        if size <= 0:
            raise ValueError(f"segment size must be > 0 bytes, got {size}")
        try:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            free, total = shm_space()
            raise ShmAllocationError(self.name, size, free, total, os.strerror(exc.errno or 0)
                                     ) from exc

    def unlink(self) -> None:
        """Owner only: remove the name now, keep the mapping (attached readers keep theirs).

        Once every reader has attached, an unlinked segment can neither leak nor be removed
        under us by anyone cleaning ``/dev/shm``; its memory is freed with the last mapping.
        """
        if self.owner:
            self.owner = False
            _unlink("/" + self.name)

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Idempotent.

        A mapping still exported to user arrays (zero-copy views) cannot be unmapped yet; it is
        left to the garbage collector, the unlink still happens.
        """
        buf, self.buf = getattr(self, "buf", None), None  # type: ignore[assignment]
        if buf is not None:
            buf.release()
            try:
                self.mmap.close()
            except BufferError:
                pass
        if self.owner:
            self.owner = False
            _unlink("/" + self.name)


def _unlink(path_name: str) -> None:
    try:
        _posixshmem.shm_unlink(path_name)
    except FileNotFoundError:
        pass


class ShmSlot:
    """A writer-owned growable region: one live segment named ``<prefix><generation>``.

    :meth:`reserve` returns a view of at least ``nbytes``; when the current segment is too small
    a new generation at least twice as large is created and the old one unlinked (readers keep
    their old mapping until they attach the new name). Writer side only; one thread.
    """

    max_generations = 64

    def __init__(self, prefix: str, initial_bytes: int = 1 << 20) -> None:
        self.prefix = prefix
        self.generation = -1
        self.segment: ShmSegment | None = None
        if initial_bytes > 0:
            self.reserve(initial_bytes)

    def reserve(self, nbytes: int) -> ShmSegment:
        """The current segment, grown to hold ``nbytes`` if needed.

        Raises:
            ShmAllocationError: no space for the new generation (the old one stays usable).
        """
        seg = self.segment
        if seg is not None and seg.size >= nbytes:
            return seg
        if self.generation + 1 >= self.max_generations:
            raise ShmAllocationError(self.prefix, nbytes, *shm_space(), "too many generations")
        size = max(nbytes, 2 * seg.size if seg else 0, mmap.PAGESIZE)
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        new = ShmSegment(f"{self.prefix}{self.generation + 1}", size, create=True)
        self.generation += 1
        if seg is not None:
            seg.close()
        self.segment = new
        return new

    def unlink_name(self) -> None:
        """Remove the live segment's name once every reader has mapped it (see ShmSegment)."""
        if self.segment is not None:
            self.segment.unlink()

    def close(self) -> None:
        """Unlink the live segment. Idempotent."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def sweep_prefix(prefix: str, max_generations: int = ShmSlot.max_generations) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (also after a kill mid-growth).

    Lists :data:`SHM_DIR` where it exists, else tries generations ``0..max_generations-1``.
    Returns the names removed.
    """
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        names = [f"{prefix}{g}" for g in range(max_generations)]
    removed = []
    for name in names:
        try:
            _posixshmem.shm_unlink("/" + name)
            removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as exc:  # e.g. another user's segment
            if exc.errno not in (errno.EACCES, errno.EPERM):
                raise
    return removed


def sweep_stale(tag: str, min_age_s: float = 600.0) -> list[str]:
    """Unlink ``tg_<tag><pid hex>_*`` segments whose owning pid is gone and that are old.

    The age guard (modification time older than ``min_age_s`` seconds) protects segments of
    processes in another pid namespace sharing ``/dev/shm``. Linux only; returns names removed.
    """
    pattern = re.compile(re.escape(SHM_PREFIX + tag) + r"([0-9a-f]+)_")
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed, now = [], time.time()
    for name in names:
        match = pattern.match(name)
        if not match or _pid_exists(int(match.group(1), 16)):
            continue
        try:
            if now - os.stat(os.path.join(SHM_DIR, name)).st_mtime < min_age_s:
                continue
        except OSError:
            continue
        _unlink("/" + name)
        removed.append(name)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def memfd_segment(tag: str, size: int) -> tuple[int, mmap.mmap]:
    """An unnamed shared segment of ``size`` bytes: ``(fd, mapping)``, both owned by the caller.

    Backed by ``memfd_create`` (close-on-exec): there is no ``/dev/shm`` name to leak or to be
    unlinked by others; a peer gets it as a descriptor (``socket.send_fds``, ``pass_fds``) and
    maps it with :func:`map_fd`. The memory is freed when the last descriptor and mapping go,
    also after a crash. Space is reserved up front as for :class:`ShmSegment`.

    Raises:
        ShmAllocationError: the space cannot be reserved.
    """
    if size <= 0:
        raise ValueError(f"segment size must be > 0 bytes, got {size}")
    fd = os.memfd_create(tag, os.MFD_CLOEXEC)
    try:
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            free, total = shm_space()
            raise ShmAllocationError(tag, size, free, total, os.strerror(exc.errno or 0)) from exc
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def fork_shared(tag: str, size: int) -> mmap.mmap:
    """A shared mapping of ``size`` bytes for this process and the children it forks later.

    A :func:`memfd_segment` whose descriptor is closed at once: nothing to name, leak or pass;
    a child forked after this call shares the same pages (``MAP_SHARED``), so aligned 8-byte
    stores by one are seen by the other without a system call. Freed with the last mapping.

    Raises:
        ShmAllocationError: the space cannot be reserved.
    """
    fd, mapping = memfd_segment(tag, size)
    os.close(fd)
    return mapping


def map_fd(fd: int) -> mmap.mmap:
    """Map a segment received as a descriptor (whole size, read-write); closes ``fd``."""
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


_REC_HEAD = struct.Struct("<HHI")


class RecordArea:
    """Lock-free records in a byte range of a shared mapping: one writer, any number of readers.

    A record at ``offset`` is ``u16 kind, u16 length, u32 seq`` followed by ``length`` bytes.
    The writer makes ``seq`` odd before touching the body and even after (a seqlock), so a
    reader never takes a torn record: :meth:`read` returns None while a write is in progress,
    or when the record changed under it. No lock, no system call; a writer stopped mid-write
    (SIGSTOP) only makes readers see None. Readers skip unknown kinds by length.

    Args:
        buf: the mapping (e.g. ``ShmSegment.buf``). start / size: the area, in bytes.
    """

    def __init__(self, buf: memoryview, start: int, size: int) -> None:
        if start < 0 or size < _REC_HEAD.size or start + size > len(buf):
            raise ValueError(f"record area [{start}, {start + size}) does not fit a "
                             f"{len(buf)}-byte mapping")
        self.buf, self.start, self.size = buf, start, size

    def write(self, kind: int, body: bytes, offset: int = 0) -> None:
        """Write one record at ``offset`` (bytes into the area). Never blocks.

        Raises:
            ValueError: the record does not fit the area.
        """
        if offset < 0 or offset + _REC_HEAD.size + len(body) > self.size:
            raise ValueError(f"record of {len(body)} bytes at offset {offset} does not fit the "
                             f"{self.size}-byte record area")
        buf, at = self.buf, self.start + offset
        _, _, seq = _REC_HEAD.unpack_from(buf, at)
        seq |= 1  # odd: a write is in progress (also after a writer died mid-write)
        _REC_HEAD.pack_into(buf, at, kind, len(body), seq)
        buf[at + _REC_HEAD.size: at + _REC_HEAD.size + len(body)] = body
        _REC_HEAD.pack_into(buf, at, kind, len(body), (seq + 1) & 0xFFFFFFFF)

    def read(self, offset: int = 0) -> tuple[int, bytes] | None:
        """``(kind, body)`` of the record at ``offset``; None when empty or being written."""
        buf, at = self.buf, self.start + offset
        kind, length, seq = _REC_HEAD.unpack_from(buf, at)
        if length == 0 or seq % 2 or offset + _REC_HEAD.size + length > self.size:
            return None
        body = bytes(buf[at + _REC_HEAD.size: at + _REC_HEAD.size + length])
        if _REC_HEAD.unpack_from(buf, at)[2] != seq:
            return None
        return kind, body

    def clear(self) -> None:
        """Zero the whole area (only when no writer is attached)."""
        self.buf[self.start: self.start + self.size] = bytes(self.size)
