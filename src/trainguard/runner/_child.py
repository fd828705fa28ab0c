"""Code that runs inside each rank process (spawned by :mod:`trainguard.runner._runner`).

The rank blocks in ``read`` on its inbox pipe between calls (no polling, ~0 % CPU idle). A daemon
thread blocks on a second "death" pipe whose only writer is the parent: EOF there means the
parent is gone (even SIGKILLed), and the rank removes the runner's shared-memory segments and
SIGKILLs its own process group, taking any grandchildren with it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import os
import pickle
import signal
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any

from trainguard._core.ipc import FrameReader, send_frame
from trainguard._core.proctitle import set_title
from trainguard._core.shm import ShmAllocationError, sweep_prefix
from trainguard.runner._transport import Receiver, Sender

# Frame kinds, parent -> rank.
GENERATE, RESET, SHUTDOWN, JOIN, ATTACH = 1, 2, 3, 4, 5
# Frame kinds, rank -> parent.
READY, LOADED, OK, RESULT, ERROR = 10, 11, 12, 13, 14


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """Everything a rank needs; pickled into the spawned process (worker class by reference)."""

    worker_cls: type
    rank: int
    world_size: int
    load_kwargs: dict[str, Any]
    init_process_group: bool
    shm_prefix: str
    shm_bytes: int
    transfer: str
    start_timeout_s: float


def error_record(exc: BaseException, transport: bool = False) -> bytes:
    """Pickle ``exc`` for the parent; a failed round trip becomes ``RuntimeError("Type: msg")``."""
    type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload = pickle.dumps(exc, protocol=5)
        if type(pickle.loads(payload)) is not type(exc):
            raise TypeError("exception changed type in a pickle round trip")
    except Exception:  # noqa: BLE001 - any failure of the round trip means: substitute
        payload = pickle.dumps(RuntimeError(f"{type_name}: {exc}"), protocol=5)
    return pickle.dumps((type_name, payload, tb, transport), protocol=5)


def child_main(spec: ChildSpec, inbox: Any, outbox: Any, death: Any) -> None:
    """Entry point of a rank process; exits with 0 after SHUTDOWN or parent exit, 1 on load
    error."""
    os.setpgid(0, 0)  # own group: a terminal Ctrl-C reaches the parent only
    set_title(f"trainguard: rank {spec.rank} runner worker", f"tg-runner{spec.rank}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # parent spawned us with SIG_IGN
    faulthandler.enable()
    threading.Thread(target=_watch_parent, args=(death.fileno(), spec.shm_prefix),
                     name=f"tg-rank{spec.rank}-parent-watch", daemon=True).start()
    os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.rank),
                      WORLD_SIZE=str(spec.world_size), LOCAL_WORLD_SIZE=str(spec.world_size),
                      MASTER_ADDR="127.0.0.1")
    rank = _Rank(spec, inbox.fileno(), outbox.fileno())
    sys.exit(rank.run())


def _watch_parent(fd: int, prefix: str) -> None:
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    sweep_prefix(prefix)
    os.killpg(os.getpgid(0), signal.SIGKILL)


class _Rank:
    def __init__(self, spec: ChildSpec, inbox_fd: int, outbox_fd: int) -> None:
        self.spec, self.out_fd = spec, outbox_fd
        self.reader = FrameReader(inbox_fd)
        self.receiver = Receiver(spec.transfer)
        self.sender: Sender | None = None
        self.worker: Any = None
        self.group = False

    def run(self) -> int:
        try:
            self._load()
        except Exception as exc:  # noqa: BLE001 - worker errors of any type cross to the parent
            send_frame(self.out_fd, ERROR, error_record(exc))
            self._close()
            return 1
        send_frame(self.out_fd, LOADED)
        try:
            return self._serve()
        finally:
            self._close()

    def _load(self) -> None:
        spec = self.spec
        worker = self.worker = spec.worker_cls()
        device, backend = _pick_device(spec)
        worker.rank, worker.world_size, worker.device = spec.rank, spec.world_size, device
        if spec.init_process_group and spec.world_size > 1:
            self._init_group(backend)
        worker.load(**spec.load_kwargs)
        if spec.rank == 0:  # reserved last: its name lives only until the parent maps it
            self.sender = Sender(spec.shm_prefix + "o", spec.shm_bytes)

    def _init_group(self, backend: str) -> None:
        import torch.distributed as dist

        spec = self.spec
        timeout = timedelta(seconds=spec.start_timeout_s)
        if spec.rank == 0:  # the OS picks the port; the parent relays it to the other ranks
            store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            send_frame(self.out_fd, READY, str(store.port).encode())
        else:
            kind, body = self.reader.recv()
            if kind != JOIN:
                raise RuntimeError(f"rank {spec.rank} expected the rendezvous port, got {kind}")
            store = dist.TCPStore("127.0.0.1", int(bytes(body)), spec.world_size,
                                  is_master=False, timeout=timeout)
        os.environ["MASTER_PORT"] = str(store.port)
        dist.init_process_group(backend, store=store, rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
        self.group = True

    def _serve(self) -> int:
        while True:
            try:
                kind, body = self.reader.recv()
            except EOFError:  # parent closed the pipe: it is gone or shutting down
                return 0
            if self.sender is not None:  # a new frame: the parent has mapped our last result
                self.sender.release_name()
            if kind == GENERATE:
                self._generate(body)
            elif kind == RESET:
                self._call(self.worker.reset)
            elif kind == ATTACH:
                self._call(functools.partial(self.receiver.attach, bytes(body).decode()))
            elif kind == SHUTDOWN:
                return 0

    def _call(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - worker errors of any type cross to the parent
            send_frame(self.out_fd, ERROR, error_record(exc))
            return
        send_frame(self.out_fd, OK)

    def _generate(self, body: memoryview) -> None:
        self._answer(body)
        self.receiver.replenish()  # after the reply, so off the caller's critical path

    def _answer(self, body: memoryview) -> None:
        try:
            result = self.worker.generate(self.receiver.decode(body))
        except Exception as exc:  # noqa: BLE001 - worker errors of any type cross to the parent
            send_frame(self.out_fd, ERROR, error_record(exc))
            return
        if self.sender is None:  # only rank 0's result travels
            send_frame(self.out_fd, OK)
            return
        try:
            encoded = self.sender.encode(result)
        except ShmAllocationError as exc:
            send_frame(self.out_fd, ERROR, error_record(exc, transport=True))
            return
        except Exception as exc:  # noqa: BLE001 - worker errors of any type cross to the parent
            send_frame(self.out_fd, ERROR, error_record(exc))
            return
        del result
        send_frame(self.out_fd, RESULT, encoded)

    def _close(self) -> None:
        self.receiver.close()
        if self.sender is not None:
            self.sender.close()
        if self.group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _pick_device(spec: ChildSpec) -> tuple[str, str]:
    """``(device, backend)``: ``cuda:<rank>``/NCCL when torch sees CUDA, else ``cpu``/Gloo.

    torch is imported only when the process group needs it or the worker's module already did,
    so torch-free workers start fast.
    """
    torch = sys.modules.get("torch")
    if torch is None and spec.init_process_group and spec.world_size > 1:
        import torch
    if torch is None or not torch.cuda.is_available():
        return "cpu", "gloo"
    count = torch.cuda.device_count()
    if spec.rank >= count:
        raise ValueError(f"world_size={spec.world_size} needs {spec.world_size} CUDA devices but "
                         f"only {count} are visible; lower world_size or set CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(spec.rank)
    return f"cuda:{spec.rank}", "nccl"
