"""Rank monitor: one persistent process per local rank, supervised by the launcher.

It reads the rank's shared-memory slot every ``workload_check_interval`` (so a SIGSTOPped or
GIL-holding rank cannot wedge it), serves the client's requests on a Unix socket, and on a
timeout: dumps the rank's Python stacks to the rank's log (``faulthandler`` signal registered by
the worker bootstrap), SIGCONT, then ``_core.procs.terminate_processes`` (termination signal to
the rank's main process, per-rank grace, SIGKILL of the whole tree).

Launcher channel (``_core.ipc`` messages, kind 1, on a socketpair): launcher -> monitor
``cycle`` {cycle, pid, start_ns}, ``idle``, ``timeouts`` {...}, ``stop``; monitor -> launcher
``ready``, ``hang`` {rank, kind, reason, detected_ns, timeout_s}, ``killed`` {rank},
``timeouts`` {...} (calculated, kept by the launcher for a respawned monitor), ``control``.

Follows: NVRx ``RankMonitorServer``; differences: shared-memory marks, stack dump before the
kill, SIGTERM + grace + tree SIGKILL, progress-based section timeouts, persistent calculated
timeouts, several client connections.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_msg
from trainguard._core.procs import pid_alive, terminate_processes
from trainguard._core.proctitle import set_title
from trainguard.fault_tolerance._bootstrap import set_pdeathsig
from trainguard.fault_tolerance._slot import Slot, W
from trainguard.fault_tolerance.config import FaultToleranceConfig, signal_number

MSG = 1
_NS = 1e9


class Timeouts:
    """Effective timeouts (seconds, None = off): configured, then calculated values on top."""

    def __init__(self, cfg: FaultToleranceConfig) -> None:
        self.cfg = cfg
        self.initial = cfg.initial_rank_heartbeat_timeout
        self.subsequent = cfg.rank_heartbeat_timeout
        self.sections: dict[str, float] = dict(cfg.rank_section_timeouts)
        self.out_of_section = cfg.rank_out_of_section_timeout
        self.calculated: dict[str, Any] = {}

    def apply(self, calc: dict[str, Any]) -> None:
        self.calculated = calc
        hb = calc.get("heartbeat") or {}
        if hb.get("were_calculated"):
            self.initial, self.subsequent = float(hb["initial"]), float(hb["subsequent"])
        sec = calc.get("section") or {}
        for name in sec.get("calculated_sections", []):
            if name in self.sections and name in sec.get("section", {}):
                self.sections[name] = float(sec["section"][name])
        if sec.get("is_out_of_section_calculated") and sec.get("out_of_section"):
            self.out_of_section = float(sec["out_of_section"])

    def to_json(self) -> dict[str, Any]:
        return {"initial": self.initial, "subsequent": self.subsequent,
                "sections": self.sections, "out_of_section": self.out_of_section,
                "safety_factor": self.cfg.safety_factor, "calculated": self.calculated}


class Monitor:
    def __init__(self, rank: int, local_rank: int, slot_name: str, sock_path: str,
                 cfg: FaultToleranceConfig, ctl_fd: int) -> None:
        self.rank, self.local_rank, self.cfg = rank, local_rank, cfg
        self.slot = Slot(slot_name)
        self.names = cfg.section_names
        self.t = Timeouts(cfg)
        self.ctl_fd, self.ctl = ctl_fd, FrameReader(ctl_fd, 4096)
        self.path = sock_path
        if os.path.exists(sock_path):
            os.unlink(sock_path)  # a previous monitor's socket (respawn)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path)
        self.listener.listen(8)
        self.clients: dict[int, tuple[socket.socket, FrameReader]] = {}
        self.pid = 0
        self.start_ns = 0
        self.cycle = 0
        self.client_done = False
        self.active = False
        self.running = True

    def tell(self, msg: dict[str, Any]) -> None:
        try:
            send_msg(self.ctl_fd, MSG, msg)
        except OSError:
            self.running = False  # launcher gone

    def run(self) -> None:
        self.tell({"op": "ready", "rank": self.rank, "pid": os.getpid()})
        tick = self.cfg.workload_check_interval
        while self.running:
            fds = [self.ctl_fd, self.listener.fileno(), *self.clients]
            ready, _, _ = select.select(fds, [], [], tick)
            for fd in ready:
                if fd == self.ctl_fd:
                    self._on_launcher()
                elif fd == self.listener.fileno():
                    conn, _ = self.listener.accept()
                    self.clients[conn.fileno()] = (conn, FrameReader(conn.fileno(), 4096))
                else:
                    self._on_client(fd)
            if self.active:
                self._check()

    def _on_launcher(self) -> None:
        try:
            msg, _ = decode_msg(self.ctl.recv()[1])
        except (EOFError, OSError, FrameError):
            self.running = False
            return
        op = msg.get("op")
        if op == "cycle":
            self.pid, self.start_ns, self.active = int(msg["pid"]), int(msg["start_ns"]), True
            self.cycle = int(msg.get("cycle", 0))
            self.client_done = False
        elif op == "idle":
            self.active = False
        elif op == "timeouts":
            self.t.apply(msg.get("timeouts") or {})
        elif op == "stop":
            self.running = False

    def _on_client(self, fd: int) -> None:
        conn, reader = self.clients[fd]
        try:
            msg, _ = decode_msg(reader.recv()[1])
        except (EOFError, OSError, FrameError):
            conn.close()
            del self.clients[fd]
            return
        op = msg.get("op")
        reply: dict[str, Any] = {"ok": True}
        if op == "init":
            reply["timeouts"] = self.t.to_json()
        elif op == "set_timeouts":
            self.t.apply(msg.get("timeouts") or {})
            self.tell({"op": "timeouts", "rank": self.rank, "timeouts": self.t.calculated})
            reply["timeouts"] = self.t.to_json()
        elif op == "control":
            self.tell({"op": "control", "rank": self.rank, "action": msg.get("action"),
                       "description": msg.get("description", "")})
        elif op == "shutdown":
            self.client_done = True  # client timeouts off until the next cycle
        else:
            reply = {"error": f"unknown request {op!r}"}
        try:
            send_msg(fd, MSG, reply)
        except OSError:
            pass

    # -- checks ---------------------------------------------------------------------------
    def _check(self) -> None:
        verdict = self.verdict(time.monotonic_ns())
        if verdict is not None:
            self._fire(*verdict)

    def verdict(self, now: int) -> tuple[str, str, float] | None:
        """``(kind, reason, timeout_s)`` of the first expired timeout, or None."""
        s, cfg = self.slot, self.cfg
        auto = s.get(W.AUTO)
        if cfg.auto_heartbeat_timeout is not None and auto:
            age = (now - auto) / _NS
            if age > cfg.auto_heartbeat_timeout:
                return ("auto_heartbeat", f"main thread ran no Python code for {age:.2f} s",
                        cfg.auto_heartbeat_timeout)
        init = s.get(W.INIT)
        if self.client_done:
            return None
        if not init:
            if cfg.client_timeouts_explicit() and self.t.initial is not None:
                age = (now - self.start_ns) / _NS
                if age > self.t.initial:
                    return ("no_client", (f"never called RankMonitorClient()."
                            f"init_workload_monitoring() within {age:.1f} s although client "
                            "timeouts are configured"), self.t.initial)
            return None
        return self._client_verdict(now, init)

    def _client_verdict(self, now: int, init: int) -> tuple[str, str, float] | None:
        s, t = self.slot, self.t
        last_hb = s.get(W.HB_NS)  # 0 until the first heartbeat
        if last_hb == 0 and t.initial is not None and (now - init) / _NS > t.initial:
            return ("heartbeat", f"no first heartbeat {(now - init) / _NS:.2f} s after init",
                    t.initial)
        if last_hb and t.subsequent is not None:
            age = (now - last_hb) / _NS
            if age > t.subsequent:
                return "heartbeat", f"no heartbeat for {age:.2f} s", t.subsequent
        n_open = 0
        for i, name in enumerate(self.names):
            opened, prog = s.section_state(i)
            if not opened:
                continue
            n_open += 1
            idle = (now - max(opened, prog)) / _NS  # progress() restarts the clock
            limit = t.sections.get(name)
            if limit is not None and idle > limit:
                return ("section", f"no progress in section {name!r} for {idle:.2f} s", limit)
        if n_open == 0 and t.out_of_section is not None:
            since = max(s.last_close_ns(len(self.names)), init)
            age = (now - since) / _NS
            if age > t.out_of_section:
                return "out_of_section", f"{age:.2f} s outside any section", t.out_of_section
        return None

    def _fire(self, kind: str, reason: str, timeout_s: float) -> None:
        self.active = False
        pid = self.pid
        if not pid_alive(pid):
            return  # the rank already exited: its launcher reports that, not a hang
        self.tell({"op": "hang", "rank": self.rank, "cycle": self.cycle, "kind": kind,
                   "reason": reason,
                   "timeout_s": timeout_s, "detected_ns": time.monotonic_ns()})
        stacks = self.slot.get(W.STACKS_SIG)
        try:
            if stacks:
                os.kill(pid, stacks)  # faulthandler: every thread's stack to the rank's log
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if stacks:
            time.sleep(0.2)  # let the dump reach the pipe before the termination signal
        terminate_processes([pid], grace_s=self.cfg.rank_termination_grace,
                            first_signal=signal_number(self.cfg.rank_termination_signal))
        self.tell({"op": "killed", "rank": self.rank, "pid": pid})

    def close(self) -> None:
        for conn, _ in self.clients.values():
            conn.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.slot.close()


def main() -> None:
    spec = json.loads(sys.argv[1])
    set_pdeathsig(int(spec["parent"]))
    # ps shows this, not the JSON spec on the command line
    set_title(f"trainguard: rank {spec['rank']} rank monitor (local {spec['local_rank']})",
              f"tg-rankmon{spec['local_rank']}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards signals, not the tty
    cfg = FaultToleranceConfig.from_json(spec["cfg"])
    mon = Monitor(int(spec["rank"]), int(spec["local_rank"]), spec["slot"], spec["socket"], cfg,
                  int(spec["fd"]))
    if spec.get("timeouts"):
        mon.t.apply(spec["timeouts"])
    try:
        mon.run()
    finally:
        mon.close()


if __name__ == "__main__":
    main()
