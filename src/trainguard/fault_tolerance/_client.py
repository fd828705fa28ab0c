"""``RankMonitorClient``: heartbeats, sections and progress from a training rank.

Heartbeats, section marks and progress are plain stores into the rank's shared-memory slot
(``_slot``): no system call, no lock, no message, well under a microsecond. Only requests that need
an answer (init, setting timeouts, workload-control requests) go to the rank monitor, as
``_core.ipc`` messages over a Unix socket whose path the launcher exports.

Follows: NVRx ``RankMonitorClient`` (same method names, the same ``state_dict`` layout);
differences: shared memory instead of a pickled socket stream, ``progress(n)`` inside sections
(a section times out on "no progress for T", not "open for T"), calculating timeouts never raises
for lack of data (it returns False), and timeouts survive restarts in the persistent monitor too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

from typing_extensions import Self

from trainguard._core.clock import Deadline
from trainguard._core.ipc import FrameReader, decode_msg, send_msg
from trainguard.fault_tolerance._slot import EXT_OFFSET, Slot, W
from trainguard.fault_tolerance.errors import (
    LauncherError,
    MonitorTimeout,
    MonitorUnavailableError,
)

__all__ = ["RankMonitorClient", "WorkloadAction", "WorkloadControlRequest", "shared_slot"]

ENV_SLOT = "TRAINGUARD_FT_SLOT"
ENV_SOCKET = "TRAINGUARD_FT_SOCKET"
ENV_SECTIONS = "TRAINGUARD_FT_SECTIONS"
MSG = 1
_log = logging.getLogger("trainguard.fault_tolerance")
_mono = time.monotonic_ns
_SLOT: Slot | None = None


def shared_slot() -> Slot | None:
    """This process's slot (attached once per process), or None when not under the launcher."""
    global _SLOT
    name = os.environ.get(ENV_SLOT)
    if _SLOT is None and name:
        try:
            _SLOT = Slot(name)
        except (FileNotFoundError, ValueError):
            return None
    return _SLOT


class WorkloadAction(enum.Enum):
    """What a rank asks the launcher to do (NVRx ``WorkloadAction``)."""

    Continue = "continue"
    ExcludeThisNode = "exclude_this_node"
    ShutdownWorkload = "shutdown_workload"


@dataclasses.dataclass(frozen=True)
class WorkloadControlRequest:
    """A rank's request to the launcher; on one node both non-Continue actions end the job with
    the no-restart exit code at the next failure (there is no other node to move to)."""

    action: WorkloadAction
    description: str = ""


class RankMonitorClient:
    """Client of this rank's monitor. One per process; use from the training (main) thread.

    Every method is safe to call when the process was not started by ``trainguard launch``:
    only :meth:`init_workload_monitoring` and the request methods raise
    :class:`MonitorUnavailableError` then; marks go to a private buffer.

    Failure contract:
        * heartbeats, sections and progress never block and never raise for a dead monitor;
        * requests wait at most ``timeout_s`` (5 s default) for an answer, then raise
          :class:`MonitorTimeout`;
        * ``calculate_and_set_*`` return False (and log why) when there is not enough data,
          never raise for it (a shutdown path must not fail; fault_tolerance.md §8 #6).
    """

    def __init__(self) -> None:
        self._local = bytearray(EXT_OFFSET)
        self._w: memoryview = memoryview(self._local).cast("q")
        self._sec: dict[str, int] = {}
        self._open: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._initialized = False
        self._first_hb_ns = 0
        self._hb_gap_ns = 0
        self._sec_max: dict[str, int] = {}
        self._oos_max = 0
        self._oos_since = _mono()
        self._loaded: dict[str, Any] | None = None
        self.timeouts: dict[str, Any] = {}

    # -- lifecycle -----------------------------------------------------------------------
    def init_workload_monitoring(self, num_warmup_iters: int | None = None,
                                 timeout_s: float = 5.0) -> None:
        """Connect to this rank's monitor and start its client timeouts. Blocks <= ``timeout_s``.

        Raises:
            MonitorUnavailableError: not started by ``trainguard launch`` or the monitor is gone.
            MonitorTimeout: the monitor did not answer within ``timeout_s`` seconds.
        """
        slot, path = shared_slot(), os.environ.get(ENV_SOCKET)
        if slot is None or not path:
            raise MonitorUnavailableError(
                "no rank monitor: this process was not started by 'trainguard launch' "
                f"({ENV_SLOT}/{ENV_SOCKET} unset); run it with trainguard launch")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise MonitorUnavailableError(f"rank monitor socket {path}: {exc}") from exc
        self._sock, self._reader = sock, FrameReader(sock.fileno(), 4096)
        names = [n for n in os.environ.get(ENV_SECTIONS, "").split(",") if n]
        self._sec = {n: W.SECTIONS + 2 * i for i, n in enumerate(names)}
        self._sec_max = dict.fromkeys(names, 0)
        self._w = slot.words
        reply = self._request({"op": "init", "pid": os.getpid(), "warmup": num_warmup_iters},
                              timeout_s)
        self.timeouts = reply.get("timeouts", {})
        w = self._w
        now = _mono()
        w[W.INIT] = now
        w[W.HB_NS] = 0
        self._oos_since = now
        w[W.PID] = os.getpid()
        self._initialized = True
        if self._loaded is not None:
            self._push(self._loaded, timeout_s)

    def shutdown_workload_monitoring(self) -> None:
        """Stop client timeouts for this rank (the monitor keeps watching liveness). Idempotent."""
        if self._sock is not None:
            with contextlib.suppress(OSError, LauncherError):
                self._request({"op": "shutdown"}, 2.0)
            self._sock.close()
        self._sock, self._reader, self._initialized = None, None, False
        self._w = memoryview(self._local).cast("q")

    def __enter__(self) -> Self:
        self.init_workload_monitoring()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown_workload_monitoring()

    # -- marks (hot path: no syscalls) --------------------------------------------------
    def send_heartbeat(self) -> None:
        """Record a heartbeat (two shared-memory stores; never blocks)."""
        now = _mono()
        w = self._w
        gap = now - w[4]
        if gap > self._hb_gap_ns:
            self._note_gap(now, gap)
        w[4] = now
        w[3] += 1

    def _note_gap(self, now: int, gap: int) -> None:
        w = self._w
        if w[4]:
            self._hb_gap_ns = gap
        elif w[2]:
            self._first_hb_ns = now - w[2]

    def start_section(self, name: str) -> None:
        """Open section ``name`` (one shared-memory store; no-op for a section without a
        configured timeout).

        Raises:
            LauncherError: ``name`` is already open.
        """
        base = self._sec.get(name)
        if base is None:
            return
        opened = self._open
        if name in opened:
            raise LauncherError(f"section {name!r} is already open; end it first")
        now = _mono()
        if not opened and now - self._oos_since > self._oos_max:
            self._oos_max = now - self._oos_since
        opened[name] = now
        self._w[base] = now

    def end_section(self, name: str) -> None:
        """Close section ``name`` (no-op if it is not open or not configured)."""
        started = self._open.pop(name, None)
        if started is None:
            return
        now = _mono()
        w = self._w
        w[self._sec[name]] = 0
        w[6] = now
        if now - started > self._sec_max[name]:  # noqa: PLR1730 - hot path, no call
            self._sec_max[name] = now - started
        if not self._open:
            self._oos_since = now

    def end_all_sections(self) -> None:
        """Close every open section."""
        for name in list(self._open):
            self.end_section(name)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """``with client.section("step"): ...`` opens and always closes ``name``."""
        self.start_section(name)
        try:
            yield
        finally:
            self.end_section(name)

    def progress(self, n: int = 1) -> None:
        """Report ``n`` units of progress: restarts the no-progress clock of every open section
        and advances the progress counter the launcher's progress tracker reads."""
        now = _mono()
        w = self._w
        for name in self._open:
            w[self._sec[name] + 1] = now
        w[7] += n
        w[11] = now

    # -- timeouts ------------------------------------------------------------------------
    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Collective: heartbeat timeouts = safety factor x the longest observed gaps (max over
        ranks), merged with earlier calculated values; sent to the monitor.

        Returns:
            True when set; False when some rank has fewer than 2 heartbeats (logged, no raise;
            ``skip_if_not_ready`` only silences the log).
        Blocks for one all-reduce (when a process group is initialised) plus one request.
        """
        ready = self._w[3] >= 2
        vals = _allreduce_max([self._first_hb_ns / 1e9, self._hb_gap_ns / 1e9,
                               0.0 if ready else 1.0])
        if vals[2] > 0:
            if not skip_if_not_ready:
                _log.warning("heartbeat timeouts not calculated: a rank has < 2 heartbeats")
            return False
        factor = float(self.timeouts.get("safety_factor", 5.0))
        # the initial timeout never undercuts the subsequent one (a first heartbeat sent right
        # after init would otherwise give a near-zero startup timeout)
        hb = {"initial": factor * max(vals[0], vals[1]), "subsequent": factor * vals[1]}
        old = self._calculated("heartbeat")
        if old and old.get("were_calculated"):
            hb = {k: 0.5 * (hb[k] + float(old[k])) for k in hb}
        self._push({"heartbeat": {**hb, "were_calculated": True}})
        return True

    def calculate_and_set_section_timeouts(self, selected_sections: list[str] | None = None,
                                           calc_out_of_section: bool = True,
                                           skip_if_not_ready: bool = False) -> bool:
        """Collective: section (and out-of-section) timeouts = safety factor x the longest
        observed durations (max over ranks), merged with earlier values; sent to the monitor.

        Returns:
            True when set; False when a selected section was never completed on some rank.
        """
        names = sorted(self._sec) if selected_sections is None else sorted(selected_sections)
        vals = [self._sec_max.get(n, 0) / 1e9 for n in names]
        vals += [self._oos_max / 1e9, 0.0 if all(v > 0 for v in vals) else 1.0]
        red = _allreduce_max(vals)
        if red[-1] > 0 or (not names and (not calc_out_of_section or red[-2] <= 0)):
            if not skip_if_not_ready:
                _log.warning("section timeouts not calculated: a section was never completed")
            return False
        factor = float(self.timeouts.get("safety_factor", 5.0))
        old = self._calculated("section") or {}
        old_sec = old.get("section", {})
        sections = dict(old_sec)
        for name, value in zip(names, red[: len(names)]):
            new = factor * value
            if name in old.get("calculated_sections", []):
                new = 0.5 * (new + float(old_sec[name]))
            sections[name] = new
        out: dict[str, Any] = {
            "section": sections,
            "calculated_sections": sorted(set(old.get("calculated_sections", [])) | set(names)),
            "out_of_section": old.get("out_of_section"),
            "is_out_of_section_calculated": bool(old.get("is_out_of_section_calculated")),
        }
        if calc_out_of_section and red[-2] > 0:
            oos = factor * red[-2]
            if out["is_out_of_section_calculated"] and out["out_of_section"]:
                oos = 0.5 * (oos + float(out["out_of_section"]))
            out["out_of_section"], out["is_out_of_section_calculated"] = oos, True
        self._push({"section": out})
        return True

    def _calculated(self, kind: str) -> dict[str, Any] | None:
        current = (self._loaded or {}).get(kind)
        return current if isinstance(current, dict) else None

    def _push(self, update: dict[str, Any], timeout_s: float = 5.0) -> None:
        merged = dict(self._loaded or {})
        merged.update(update)
        self._loaded = merged
        if self._initialized:
            reply = self._request({"op": "set_timeouts", "timeouts": merged}, timeout_s)
            self.timeouts = reply.get("timeouts", self.timeouts)

    def state_dict(self) -> dict[str, Any]:
        """Calculated timeouts, identical on every rank: ``{"current_timeouts": {...}}``."""
        return {"current_timeouts": dict(self._loaded or {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore timeouts from :meth:`state_dict` (before or after init; pushed at init)."""
        current = state.get("current_timeouts", {}) if isinstance(state, dict) else {}
        self._loaded = dict(current)
        if self._initialized and self._loaded:
            self._push({})

    # -- requests ------------------------------------------------------------------------
    def send_workload_control_request(self, req: WorkloadControlRequest,
                                      timeout_s: float = 5.0) -> None:
        """Ask the launcher to act (see :class:`WorkloadControlRequest`). Blocks <= timeout_s.

        Raises:
            MonitorUnavailableError: not initialised. MonitorTimeout: no answer in time.
        """
        self._request({"op": "control", "action": req.action.value,
                       "description": req.description}, timeout_s)

    def _request(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        sock, reader = self._sock, self._reader
        if sock is None or reader is None:
            raise MonitorUnavailableError("call init_workload_monitoring() first")
        deadline = Deadline(timeout_s)
        try:
            send_msg(sock.fileno(), MSG, msg)
            if not select.select([sock], [], [], deadline.remaining())[0]:
                raise MonitorTimeout(f"rank monitor did not answer {msg['op']!r} within "
                                     f"{timeout_s:.1f} s")
            reply, _ = decode_msg(reader.recv()[1])
        except (OSError, EOFError) as exc:
            raise MonitorUnavailableError(f"rank monitor connection lost: {exc}") from exc
        if reply.get("error"):
            raise LauncherError(f"rank monitor refused {msg['op']!r}: {reply['error']}")
        return reply


def _allreduce_max(values: list[float]) -> list[float]:
    """Element-wise max over ranks when a process group is initialised (else ``values``)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return values
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu().tolist()]
