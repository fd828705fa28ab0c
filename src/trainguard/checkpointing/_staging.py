"""Staging: flatten a state into (skeleton, tensors) and copy tensors into reusable shm arenas.

An arena is one anonymous shared-memory file (``memfd``) mapped by the trainer and by its writer
process, reused across saves, so a steady-state save costs one memcpy (no page faults, no
per-tensor shm handles, no file descriptors per tensor). Its pages are first touched either at
creation (``prefault=True``: ``warmup``), or by the first copy into it (a save: the copy is the
first touch, one pass instead of zero-fill + copy; for an overlapped save that pass runs in the
background staging thread, so even the first save does not block on page faults).
The trainer owns arenas and closes them on close.

Only strided, non-quantized tensors inside plain dicts/lists/tuples are staged; every other value
(and tensors hidden inside custom objects) is pickled during staging, which is also a snapshot.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from trainguard._core.shm import map_fd, memfd_segment
from trainguard.checkpointing.errors import StateDictError

__all__ = ["CHUNK_BYTES", "Arena", "TensorRef", "TensorSlot", "cuda_fence", "flatten",
           "is_sharded_value", "pickle_skeleton", "rebuild", "stage"]

_ALIGN = 64
CHUNK_BYTES = 4 << 20
"""Chunk of a background (overlapped) CPU copy: one ``memmove`` without the GIL per chunk."""
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them


class TensorRef:
    """Placeholder for the ``index``-th staged tensor inside a pickled skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (TensorRef, (self.index,))


@dataclass(frozen=True)
class TensorSlot:
    """Where a staged tensor lives in an arena: byte ``offset``, ``nbytes``, dtype name, shape."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> list:
        return [self.offset, self.nbytes, self.dtype, list(self.shape)]

    @staticmethod
    def from_json(raw: list) -> TensorSlot:
        return TensorSlot(int(raw[0]), int(raw[1]), str(raw[2]), tuple(raw[3]))


def _stageable(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_quantized
        and value.device.type != "meta"
    )


def is_sharded_value(value: Any) -> bool:
    """True for a ``DTensor`` or ``ShardedTensor`` (values only the ``dcp`` format can save)."""
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return True
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(value, ShardedTensor)


def flatten(obj: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Replace stageable tensors in nested dicts/lists/tuples by :class:`TensorRef`.

    Returns (skeleton, [(key path, tensor)]) in skeleton order.

    Raises:
        StateDictError: a ``DTensor``/``ShardedTensor`` (only ``format="dcp"`` can save those).
    """
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, path: str) -> Any:
        if is_sharded_value(value):
            raise StateDictError(
                f"state value at key {path or '<root>'!r} is a {type(value).__name__}: sharded "
                "tensors need AsyncCheckpointer(format='dcp'), which saves each rank's shards "
                "and reshards on load")
        if _stageable(value):
            found.append((path, value))
            return TensorRef(len(found) - 1)
        if type(value) in (dict, OrderedDict):
            return type(value)(
                (k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(walk(v, f"{path}[{i}]") for i, v in enumerate(value))
        return value

    return walk(obj, ""), found


def _leaves(value: Any, path: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif type(value) in (list, tuple):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def pickle_skeleton(skeleton: Any) -> bytes:
    """Pickle the skeleton (this is the snapshot of every non-staged value).

    Raises:
        StateDictError: a value cannot be pickled; the message names its key path.
    """
    try:
        return pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickling raises many types (TypeError, PicklingError, ...)
        for path, leaf in _leaves(skeleton):
            try:
                pickle.dumps(leaf, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as leaf_exc:
                raise StateDictError(
                    f"state value at key {path or '<root>'!r} ({type(leaf).__name__}) cannot be "
                    f"pickled: {leaf_exc}. Convert it to plain data or a tensor, or drop it from "
                    "the state dict before saving."
                ) from leaf_exc
        raise StateDictError(f"state cannot be pickled: {exc}") from exc


def plan_slots(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorSlot], int]:
    """Lay tensors out back to back at 64-byte alignment; returns (slots, total bytes)."""
    slots, offset = [], 0
    for _, t in tensors:
        nbytes = t.numel() * t.element_size()
        slots.append(TensorSlot(offset, nbytes, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return slots, offset


class Arena:
    """A pre-faulted shared-memory buffer of ``capacity`` bytes (owner: the creating process).

    Backed by ``memfd_create`` and handed to the writer as a file descriptor over its socket, so
    there is no /dev/shm name to leak (nor for anyone to unlink under us) and the memory is freed
    when the last process holding it exits, even after a crash.

    Args:
        capacity: size in bytes (at least one page).
        prefault: touch every page now (``MADV_POPULATE_WRITE``, else a zero fill; about
            capacity / memory bandwidth in the calling thread). False leaves the first touch to
            the first copy into the arena.
    """

    def __init__(self, capacity: int, prefault: bool = True) -> None:
        self.capacity = max(int(capacity), mmap.PAGESIZE)
        self.name = f"tg_ckpt_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        fd, mm = memfd_segment(self.name, self.capacity)
        self.fd: int | None = fd
        self._mm: mmap.mmap | None = mm
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        self.touched = False  # every page faulted in (prefault or a complete copy)
        if prefault:
            self.prefault()

    def prefault(self) -> None:
        """Fault every page in now (idempotent), so later copies run at memcpy speed."""
        if self.touched or self._mm is None:
            return
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # older kernel: touch by writing
            self.buf.zero_()
        self.touched = True

    def view(self, slot: TensorSlot) -> torch.Tensor:
        raw = self.buf[slot.offset : slot.offset + slot.nbytes]
        return raw.view(getattr(torch, slot.dtype)).view(slot.shape)

    def close(self) -> None:
        """Unmap and close (idempotent); the memory is freed once the writer unmaps it too."""
        if self._mm is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
        self.buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; it is freed with that view
            pass
        self._mm = None
        os.close(self.fd)  # type: ignore[arg-type]
        self.fd = None


_SIDE_STREAMS: dict[Any, Any] = {}


def cuda_fence(tensors: list[tuple[str, torch.Tensor]]) -> dict[Any, Any]:
    """Trainer thread, at save time: one side stream per CUDA device of ``tensors``, ordered
    after the work already queued on the caller's current stream (the work producing the state).

    Call in the thread that produced the tensors (current streams are per thread); pass the
    result to :meth:`stage`, which may run in another thread. Empty without CUDA tensors.
    """
    streams: dict[Any, Any] = {}
    for _, t in tensors:
        if t.is_cuda and t.device not in streams:
            stream = _SIDE_STREAMS.get(t.device)
            if stream is None:
                stream = _SIDE_STREAMS[t.device] = torch.cuda.Stream(device=t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            streams[t.device] = stream
    return streams


def _copy_chunked(dst: list[torch.Tensor], src: list[torch.Tensor], chunk_bytes: int) -> None:
    """CPU copies as single-threaded ``memmove`` calls of ``chunk_bytes`` each, the GIL released
    during each (ctypes foreign calls drop it): a background copy takes one core and leaves the
    trainer's GIL and its intra-op threads alone (``copy_`` of a large tensor would start an
    OpenMP team of its own next to the trainer's). Non-contiguous sources use ``copy_``."""
    for d, s in zip(dst, src):
        if not (s.is_contiguous() and s.dtype == d.dtype and s.shape == d.shape):
            d.copy_(s)
            continue
        nbytes, dptr, sptr = s.numel() * s.element_size(), d.data_ptr(), s.data_ptr()
        for off in range(0, nbytes, chunk_bytes):
            ctypes.memmove(dptr + off, sptr + off, min(chunk_bytes, nbytes - off))


def stage(tensors: list[tuple[str, torch.Tensor]], slots: list[TensorSlot], arena: Arena,
          streams: dict[Any, Any] | None = None, chunk_bytes: int | None = None) -> None:
    """Copy every tensor into its slot; returns when all copies (CPU and CUDA) are complete.

    CUDA tensors are copied on the side streams from :func:`cuda_fence` (made here if not
    given) into the arena, which is page-locked once (``cudaHostRegister``) and reused by later
    saves, so device-to-host copies run at PCIe speed without a new pinned allocation.
    CPU tensors: one ``_foreach_copy_`` (intra-op parallel; the blocking path), or with
    ``chunk_bytes`` single-threaded chunks without the GIL (the overlapped path, see
    :func:`_copy_chunked`). Blocks until the copies are done; caller thread or the overlap thread.
    """
    if streams is None:
        streams = cuda_fence(tensors)
    if streams and not arena.pinned:
        torch.cuda.cudart().cudaHostRegister(arena.buf.data_ptr(), arena.capacity, 0)
        arena.pinned = True
    cpu_dst, cpu_src = [], []
    with torch.no_grad():
        for (_, t), slot in zip(tensors, slots):
            dst = arena.view(slot)
            if t.is_cuda:
                with torch.cuda.stream(streams[t.device]):
                    dst.copy_(t.detach(), non_blocking=True)
            else:
                cpu_dst.append(dst)
                cpu_src.append(t.detach())
        if cpu_dst and chunk_bytes:
            _copy_chunked(cpu_dst, cpu_src, chunk_bytes)
        elif cpu_dst:  # one call: the GIL is released once for all copies
            torch._foreach_copy_(cpu_dst, cpu_src)
    for stream in streams.values():
        stream.synchronize()


def open_mapping(fd: int) -> mmap.mmap:
    """Map an arena received as a file descriptor from the trainer (writer side); closes fd."""
    return map_fd(fd)


def rebuild(skeleton_bytes: bytes, mm: mmap.mmap, slots: list[TensorSlot]) -> Any:
    """Writer side: unpickle the skeleton and put arena-backed tensors in place of the refs.

    Each tensor gets its own storage over exactly its bytes, so ``torch.save`` writes only them.
    """
    tensors = []
    for s in slots:
        dtype = getattr(torch, s.dtype)
        if s.nbytes == 0:
            tensors.append(torch.empty(s.shape, dtype=dtype))
        else:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=s.nbytes, offset=s.offset)
            tensors.append(raw.view(dtype).view(s.shape))

    def walk(value: Any) -> Any:
        if isinstance(value, TensorRef):
            return tensors[value.index]
        if type(value) in (dict, OrderedDict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return value

    return walk(pickle.loads(skeleton_bytes))
