"""Storage backends: the local filesystem (default) and fsspec URLs (object stores, etc.).

Every file is written through :meth:`Storage.open_atomic`: bytes go to a temporary name, are
checksummed (xxh3-64) while being written, then fsync'd, renamed over the final name and the
directory fsync'd. A crash therefore leaves either the old file or a ``*.tmp.*`` leftover that
garbage collection removes, never a torn file under the final name.

All I/O on the local backend goes through ``os.write`` / ``os.fsync`` / ``os.replace`` so tests can
inject ENOSPC/EDQUOT/EACCES by patching exactly those calls.
"""

from __future__ import annotations

import os
import shutil
import uuid
from abc import ABC, abstractmethod
from typing import IO, Any

import xxhash

__all__ = ["TMP_MARK", "AtomicFile", "FsspecStorage", "LocalStorage", "Storage", "storage_for"]

TMP_MARK = ".tmp."  # every temporary name contains this; GC removes stale ones


def _tmp_name(name: str) -> str:
    return f"{name}{TMP_MARK}{os.getpid()}.{uuid.uuid4().hex[:8]}"


class AtomicFile(ABC):
    """A file being written under a temporary name; :meth:`commit` makes it durable and visible."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()
        self._size = 0

    def write(self, data: Any) -> int:
        """Append ``data`` (bytes-like); returns the number of bytes written."""
        view = memoryview(data).cast("B")
        self._write(view)
        self._hash.update(view)
        self._size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def flush(self) -> None:  # file-like protocol (torch.save); data is unbuffered
        return None

    @property
    def checksum(self) -> str:
        """xxh3-64 hex digest of everything written so far."""
        return self._hash.hexdigest()

    @abstractmethod
    def _write(self, view: memoryview) -> None: ...

    @abstractmethod
    def commit(self) -> tuple[int, str]:
        """fsync, rename to the final name, fsync the directory; returns (size bytes, xxh3 hex)."""

    @abstractmethod
    def abort(self) -> None:
        """Discard the temporary file (idempotent, never raises)."""

    def __enter__(self) -> AtomicFile:  # noqa: PYI034
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class Storage(ABC):
    """Where checkpoints live. Paths are relative, '/'-separated, below the storage root."""

    url: str

    @abstractmethod
    def open_atomic(self, rel: str) -> AtomicFile: ...

    @abstractmethod
    def open_read(self, rel: str) -> IO[bytes]: ...

    @abstractmethod
    def listdir(self, rel: str) -> list[str]:
        """Entry names in directory ``rel``; empty when it does not exist."""

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def size(self, rel: str) -> int: ...

    @abstractmethod
    def makedirs(self, rel: str) -> None: ...

    @abstractmethod
    def remove(self, rel: str) -> None:
        """Remove a file or a directory tree; missing paths are ignored."""

    @abstractmethod
    def full_path(self, rel: str) -> str:
        """A path or URL usable by other tools (``torch.distributed.checkpoint.load``)."""

    def read_bytes(self, rel: str) -> bytes:
        with self.open_read(rel) as f:
            return f.read()

    def write_bytes(self, rel: str, data: Any) -> tuple[int, str]:
        """Atomically write ``data`` (any bytes-like); returns (size bytes, xxh3 hex)."""
        f = self.open_atomic(rel)
        try:
            f.write(data)
            return f.commit()
        except BaseException:
            f.abort()
            raise


class _LocalAtomicFile(AtomicFile):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.tmp = os.path.join(os.path.dirname(path), _tmp_name(os.path.basename(path)))
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def _open_fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"{self.tmp}: already committed or aborted")
        return self.fd

    def _write(self, view: memoryview) -> None:
        fd = self._open_fd()
        while view.nbytes:
            n = os.write(fd, view[: 1 << 30])
            view = view[n:]

    def commit(self) -> tuple[int, str]:
        fd = self._open_fd()
        os.fsync(fd)
        os.close(fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(self.path))
        return self._size, self.checksum

    def abort(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """A directory on a local (or mounted) filesystem."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, *[p for p in rel.split("/") if p])

    def open_atomic(self, rel: str) -> AtomicFile:
        return _LocalAtomicFile(self._p(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return open(self._p(rel), "rb")

    def listdir(self, rel: str) -> list[str]:
        try:
            return os.listdir(self._p(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._p(rel))

    def size(self, rel: str) -> int:
        return os.path.getsize(self._p(rel))

    def makedirs(self, rel: str) -> None:
        path = self._p(rel)
        if not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            fsync_dir(os.path.dirname(path))

    def remove(self, rel: str) -> None:
        path = self._p(rel)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def full_path(self, rel: str) -> str:
        return self._p(rel)


class _FsspecAtomicFile(AtomicFile):
    def __init__(self, fs: Any, path: str) -> None:
        super().__init__()
        self.fs, self.path = fs, path
        self.tmp = path.rsplit("/", 1)[0] + "/" + _tmp_name(path.rsplit("/", 1)[-1])
        self.f: Any = fs.open(self.tmp, "wb")

    def _write(self, view: memoryview) -> None:
        self.f.write(view)

    def commit(self) -> tuple[int, str]:
        self.f.flush()
        if hasattr(self.f, "fileno"):
            try:
                os.fsync(self.f.fileno())
            except (OSError, ValueError, AttributeError):
                pass  # remote file objects have no fd; close() uploads
        self.f.close()
        self.f = None
        self.fs.mv(self.tmp, self.path)
        return self._size, self.checksum

    def abort(self) -> None:
        try:
            if self.f is not None:
                self.f.close()
        except Exception:  # noqa: BLE001, S110 - an aborting upload may fail again; nothing to do
            pass
        self.f = None
        try:
            self.fs.rm(self.tmp)
        except (OSError, FileNotFoundError):
            pass


class FsspecStorage(Storage):
    """Any fsspec URL (``s3://bucket/ckpt``, ``gs://…``, ``file:///…``).

    Object stores have no rename; fsspec emulates ``mv`` with copy + delete. The manifest written
    last remains the commit marker, so a half-copied object is never trusted.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.url = url

    def _p(self, rel: str) -> str:
        parts = [p for p in rel.split("/") if p]
        return "/".join([self.root, *parts]) if parts else self.root

    def open_atomic(self, rel: str) -> AtomicFile:
        return _FsspecAtomicFile(self.fs, self._p(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self._p(rel), "rb")

    def listdir(self, rel: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(rel), detail=False)
            return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self._p(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self._p(rel)))

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self._p(rel), exist_ok=True)

    def remove(self, rel: str) -> None:
        path = self._p(rel)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def full_path(self, rel: str) -> str:
        proto = self.url.split("://", 1)[0]
        return f"{proto}://{self._p(rel)}" if "://" in self.url else self._p(rel)


def storage_for(location: str | os.PathLike | Storage) -> Storage:
    """A :class:`Storage` for a local path, a ``scheme://`` URL, or an existing storage.

    Raises:
        ConfigError: the URL scheme is unknown to fsspec.
    """
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    if "://" not in text:
        return LocalStorage(text)
    try:
        return FsspecStorage(text)
    except (ValueError, ImportError) as exc:
        from trainguard.errors import ConfigError

        raise ConfigError(f"cannot open checkpoint storage {text!r}: {exc}; use a local path or "
                          "an fsspec URL whose filesystem package is installed") from exc
