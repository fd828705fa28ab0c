"""The shared mechanisms under the runner: _core.shm segments/slots and _core.ipc frames."""

from __future__ import annotations

import os
import threading

import pytest

import trainguard.runner as runner_pkg
from trainguard._core.ipc import FrameReader, send_frame
from trainguard._core.shm import (
    SHM_DIR,
    ShmAllocationError,
    ShmSegment,
    ShmSlot,
    sweep_prefix,
    unique_prefix,
)
from trainguard.errors import TrainguardError
from trainguard.runner import (
    RankDesync,
    RunnerError,
    SharedSlotAllocationFailed,
    WorkerCrashed,
    WorkerTimeout,
)


def _names(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def test_public_surface_and_error_bases():
    assert runner_pkg.__all__ == sorted(runner_pkg.__all__)
    assert all(hasattr(runner_pkg, n) for n in runner_pkg.__all__)
    assert issubclass(RunnerError, TrainguardError)
    assert issubclass(RankDesync, RuntimeError) and issubclass(WorkerCrashed, RuntimeError)
    assert issubclass(WorkerTimeout, TimeoutError)
    assert issubclass(SharedSlotAllocationFailed, MemoryError)
    for cls in (RankDesync, WorkerCrashed, WorkerTimeout, SharedSlotAllocationFailed):
        assert issubclass(cls, RunnerError)


def test_only_the_owner_unlinks_and_attach_sees_owner_writes():
    prefix = unique_prefix("t")
    owner = ShmSegment(prefix + "0", 10_000, create=True)
    assert owner.size == 10_000 and prefix.startswith("tg_")
    owner.buf[:5] = b"hello"
    reader = ShmSegment(prefix + "0")
    assert bytes(reader.buf[:5]) == b"hello"
    reader.close()
    reader.close()
    assert _names(prefix) == [prefix + "0"]  # a reader's close never unlinks
    owner.close()
    owner.close()
    assert _names(prefix) == []
    with pytest.raises(FileNotFoundError):
        ShmSegment(prefix + "0")


def test_early_unlink_keeps_every_mapping_valid():
    prefix = unique_prefix("t")
    owner = ShmSegment(prefix + "0", 4096, create=True)
    reader = ShmSegment(prefix + "0")
    owner.unlink()
    assert _names(prefix) == []  # nothing left to leak or to be removed under us
    owner.buf[:3] = b"abc"
    assert bytes(reader.buf[:3]) == b"abc"
    reader.close()
    owner.close()


def test_slot_grows_by_generations_and_unlinks_the_old_one():
    prefix = unique_prefix("t")
    slot = ShmSlot(prefix, 4096)
    assert _names(prefix) == [prefix + "0"]
    seg = slot.reserve(3000)
    assert seg.name == prefix + "0"
    seg = slot.reserve(100_000)
    assert seg.size >= 100_000 and seg.name == prefix + "1"
    assert _names(prefix) == [prefix + "1"]
    slot.close()
    assert _names(prefix) == []


def test_reservation_beyond_free_space_is_a_clean_memory_error():
    prefix = unique_prefix("t")
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(ShmAllocationError) as info:
        ShmSegment(prefix + "0", free + (1 << 30), create=True)
    assert isinstance(info.value, MemoryError) and info.value.requested_bytes > free
    assert _names(prefix) == []  # the failed segment was removed


def test_sweep_prefix_removes_leftovers_of_a_killed_writer():
    prefix = unique_prefix("t")
    segs = [ShmSegment(f"{prefix}{g}", 4096, create=True) for g in range(3)]
    for s in segs:
        s.owner = False  # as if the owner died before unlinking
        s.close()
    assert len(_names(prefix)) == 3
    assert sorted(sweep_prefix(prefix)) == _names_none(prefix, 3)
    assert _names(prefix) == []


def _names_none(prefix: str, n: int) -> list[str]:
    return sorted(f"{prefix}{g}" for g in range(n))


def test_frames_round_trip_large_bodies_and_report_eof_mid_frame():
    r, w = os.pipe()
    body = os.urandom(3 << 20)  # larger than the pipe: partial writes while the reader drains
    sender = threading.Thread(target=lambda: (send_frame(w, 7, body), send_frame(w, 1)))
    sender.start()
    reader = FrameReader(r, initial_bytes=16)
    kind, got = reader.recv()
    assert kind == 7 and bytes(got) == body
    assert reader.recv()[0] == 1
    sender.join(10)
    os.write(w, b"\x01\x05\x10\x00\x00\x00abc")  # v1 header promises 16 bytes, writer exits after 3
    os.close(w)
    with pytest.raises(EOFError):
        reader.recv()
    os.close(r)
    with pytest.raises(ValueError):
        send_frame(1, 300)


def test_receive_buffers_rotate_and_never_alias_live_results():
    import numpy as np

    from trainguard.runner._transport import Receiver, Sender

    sender, receiver = Sender(unique_prefix("t") + "i", 8 << 20), Receiver()
    try:
        base = np.arange(1 << 20, dtype=np.float32)
        out = None
        for i in range(6):  # the usual loop: the previous result is alive during the next call
            out = receiver.decode(sender.encode(base + i))
            assert out[1] == 1 + i
        assert len(receiver._pool) == 2  # two buffers ping-pong, no new allocations
        kept = [receiver.decode(sender.encode(base + k)) for k in range(4)]
        assert [float(k[0]) for k in kept] == [0.0, 1.0, 2.0, 3.0]  # none was overwritten
    finally:
        sender.close()
        receiver.close()


def test_replenish_readies_a_buffer_when_the_worker_keeps_every_input():
    import numpy as np

    from trainguard.runner._transport import Receiver, Sender

    sender, receiver = Sender(unique_prefix("t") + "i", 8 << 20), Receiver()
    try:
        base = np.arange(1 << 20, dtype=np.float32)
        kept = [receiver.decode(sender.encode(base + k)) for k in range(4)]  # every buffer busy
        receiver.replenish()  # what a rank does after replying
        ready = [id(b) for b in receiver._pool]  # ids: holding the buffers would pin them
        nxt = receiver.decode(sender.encode(base + 9))
        owner = nxt.base
        while not isinstance(owner, memoryview):  # ndarray views wrap the pickle buffer
            owner = owner.base
        owner = owner.obj
        print("next buffer came from the replenished pool:", id(owner) in ready)
        assert id(owner) in ready  # no allocation while the caller waited
        assert [float(k[0]) for k in kept] == [0.0, 1.0, 2.0, 3.0]  # kept inputs untouched
        assert float(nxt[0]) == 9.0
        receiver.replenish()  # the free buffer is in use again: nothing to keep ready here
        del nxt
        before = [id(b) for b in receiver._pool]
        receiver.replenish()  # a free buffer of the right size exists: no new allocation
        assert [id(b) for b in receiver._pool] == before
    finally:
        sender.close()
        receiver.close()
