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
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._initialized = False
        # mark statistics, read by calculate_and_set_*: [last heartbeat ns, longest gap ns,
        # first heartbeat after init ns] and per section [slot word, open since ns, longest ns]
        self._hb: list[int] = [0, 0, 0]
        self._secs: dict[str, list[int]] = {}
        self._oos: list[int] = [0, _mono(), 0]  # [open sections, outside since ns, longest ns]
        self._loaded: dict[str, Any] | None = None
        self.timeouts: dict[str, Any] = {}
        self._bind(self._w, [])

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
        self._bind(slot.words, names)
        reply = self._request({"op": "init", "pid": os.getpid(), "warmup": num_warmup_iters},
                              timeout_s)
        self.timeouts = reply.get("timeouts", {})
        w = self._w
        now = _mono()
        w[W.INIT] = now
        w[W.HB_NS] = 0
        self._hb[0] = 0
        self._oos[1] = now
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
        self._bind(memoryview(self._local).cast("q"), list(self._secs))

    def __enter__(self) -> Self:
        self.init_workload_monitoring()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown_workload_monitoring()

    # -- marks (hot path: no syscalls) --------------------------------------------------
    def _bind(self, w: memoryview, names: list[str]) -> None:
        """Point the mark methods at slot words ``w`` with sections ``names`` (slot order).

        The marks are closures stored on the instance (they shadow the documented methods
        below): every name they use is a local or a cell, so a mark costs one clock read, one
        8-byte store and a few local operations, no attribute chain, no dict write, no lock.
        Statistics carry over from the previous binding.
        """
        mono = _mono
        hb = self._hb
        oos = self._oos
        old = self._secs
        secs = {n: [W.SECTIONS + 2 * i, 0, old[n][2] if n in old else 0]
                for i, n in enumerate(names)}
        self._w, self._secs = w, secs
        for n, s in secs.items():
            if n in old and old[n][1]:
                s[1] = old[n][1]
                w[s[0]] = s[1]
        hb_word = W.HB_NS
        init_word = W.INIT

        def send_heartbeat() -> None:
            now = mono()
            w[hb_word] = now
            if now - hb[0] > hb[1]:  # a new longest gap, or the first heartbeat
                if hb[0]:
                    hb[1] = now - hb[0]
                elif w[init_word]:
                    hb[2] = now - w[init_word]
            hb[0] = now

        def start_section(name: str) -> None:
            s = secs.get(name)
            if s is None:
                return
            if s[1]:
                raise LauncherError(f"section {name!r} is already open; end it first")
            now = mono()
            w[s[0]] = now
            s[1] = now
            if not oos[0] and now - oos[1] > oos[2]:
                oos[2] = now - oos[1]
            oos[0] += 1

        def end_section(name: str) -> None:
            s = secs.get(name)
            if s is None or not s[1]:
                return
            now = mono()
            w[s[0]] = -now  # negative: closed at -value (one store marks both)
            if now - s[1] > s[2]:  # noqa: PLR1730 - hot path, no call
                s[2] = now - s[1]
            s[1] = 0
            oos[0] -= 1
            if not oos[0]:
                oos[1] = now

        def progress(n: int = 1) -> None:
            now = mono()
            if oos[0]:
                for s in secs.values():
                    if s[1]:
                        w[s[0] + 1] = now
            w[W.PROGRESS] += n
            w[W.PROGRESS_NS] = now

        # instance attributes shadow the methods (documented below); setattr keeps mypy quiet
        setattr(self, "send_heartbeat", send_heartbeat)  # noqa: B010
        setattr(self, "start_section", start_section)  # noqa: B010
        setattr(self, "end_section", end_section)  # noqa: B010
        setattr(self, "progress", progress)  # noqa: B010

    def send_heartbeat(self) -> None:
        """Record a heartbeat: one clock read and one shared-memory store; never blocks."""

    def start_section(self, name: str) -> None:
        """Open section ``name`` (one shared-memory store; no-op for a section without a
        configured timeout).

        Raises:
            LauncherError: ``name`` is already open.
        """

    def end_section(self, name: str) -> None:
        """Close section ``name`` (one store; no-op if it is not open or not configured)."""

    def end_all_sections(self) -> None:
        """Close every open section."""
        for name, s in self._secs.items():
            if s[1]:
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

    # -- timeouts ------------------------------------------------------------------------
    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Collective: heartbeat timeouts = safety factor x the longest observed gaps (max over
        ranks), merged with earlier calculated values; sent to the monitor.

        Returns:
            True when set; False when some rank has fewer than 2 heartbeats (logged, no raise;
            ``skip_if_not_ready`` only silences the log).
        Blocks for one all-reduce (when a process group is initialised) plus one request.
        """
        ready = self._hb[1] > 0  # a gap was seen: at least two heartbeats
        vals = _allreduce_max([self._hb[2] / 1e9, self._hb[1] / 1e9, 0.0 if ready else 1.0])
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
        names = sorted(self._secs) if selected_sections is None else sorted(selected_sections)
        vals = [self._secs[n][2] / 1e9 if n in self._secs else 0.0 for n in names]
        vals += [self._oos[2] / 1e9, 0.0 if all(v > 0 for v in vals) else 1.0]
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
