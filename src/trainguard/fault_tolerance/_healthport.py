"""``--health-port``: the launcher's liveness as JSON over HTTP, for a Kubernetes liveness probe.

``GET /health`` (or ``/``) answers ``200`` while the launcher's main loop is alive and ``503``
when it is wedged; a frozen process (SIGSTOP) does not answer at all, so a probe with a short
timeout fails too. The verdict comes from the main loop's own tick (:meth:`Liveness.tick`), not
from the server thread: the server only reads it. Before a legitimate blocking wait (starting
monitors, health checks, the stop grace of the workers, a blocking attribution) the loop declares
its bound with :meth:`Liveness.enter`; the probe stays ``200`` until that bound has passed.

Body: ``{"status": "ok"|"stale", "state": "rendezvous"|"running"|"restarting"|"stopping",
"cycle": N, "heartbeat_age_s": s, "stale_after_s": s, "pid": P, "run_id": ..., "node_rank": R}``.

Why the stdlib ``http.server`` and not uvicorn: one read-only GET with a ~200-byte body; a
``ThreadingHTTPServer`` in one named thread starts in milliseconds, imports nothing into the
launcher, installs no signal handlers (uvicorn's ``Server`` does unless subclassed) and stops
deterministically with ``shutdown()``; FastAPI/uvicorn stay in the services that need them.

Follows: torchelastic's health-check server hook (``torch.distributed.elastic.agent.server.
health_check_server``, kept alive during the exit barrier, pytorch PR#178197); difference: the
answer reflects the main loop's tick, so a wedged launcher fails the probe within 2 s.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from typing_extensions import Self

from trainguard.fault_tolerance.errors import LaunchConfigError

__all__ = ["HealthServer", "LauncherState", "Liveness"]


class LauncherState(enum.Enum):
    """What the launcher is doing. RENDEZVOUS -> RUNNING -> (RESTARTING -> RUNNING)* ->
    STOPPING; RENDEZVOUS also covers setup and the pre-cycle health checks."""

    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"


class Liveness:
    """The main loop's tick and declared waits; read by :class:`HealthServer` from its thread.

    Args:
        stale_after_s: seconds without a tick (and outside a declared wait) after which the
            launcher counts as wedged; keep it >= 2 x the loop's longest select timeout.
    """

    def __init__(self, stale_after_s: float = 1.0) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0 seconds, got {stale_after_s}")
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._state = LauncherState.RENDEZVOUS
        self._cycle = 0
        self._tick = time.monotonic()
        self._wait_until = 0.0
        self.info: dict[str, Any] = {}

    def tick(self) -> None:
        """Called by the main loop on every iteration (never blocks; a monotonic stamp). Ends
        any wait declared by :meth:`enter`: the loop is back."""
        self._tick = time.monotonic()
        self._wait_until = 0.0

    def enter(self, state: LauncherState, cycle: int | None = None, wait_s: float = 0.0) -> None:
        """Switch to ``state`` and allow one blocking wait of up to ``wait_s`` seconds from now
        without ticks (0: none)."""
        now = time.monotonic()
        with self._lock:
            self._state = state
            if cycle is not None:
                self._cycle = cycle
            self._tick = now
            self._wait_until = now + wait_s

    def snapshot(self) -> dict[str, Any]:
        """The probe's JSON body; ``status`` is ``ok`` or ``stale``."""
        now = time.monotonic()
        with self._lock:
            age = now - self._tick
            ok = age <= self.stale_after_s or now <= self._wait_until
            return {"status": "ok" if ok else "stale", "state": self._state.value,
                    "cycle": self._cycle, "heartbeat_age_s": round(age, 3),
                    "stale_after_s": self.stale_after_s, **self.info}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 2.0  # seconds a client may take to send its request line and headers

    def do_GET(self) -> None:  # http.server's naming
        if self.path.split("?")[0] not in ("/", "/health", "/healthz"):
            self._send(404, {"error": f"unknown path {self.path}; use /health"})
            return
        body = self.server.liveness.snapshot()
        self._send(200 if body["status"] == "ok" else 503, body)

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # the base's signature
        pass  # probes every few seconds would flood the launcher's stderr


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A probe that gave up (timeout, closed connection) is the prober's business: no
        traceback on the launcher's stderr; anything else is one warning line."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        logging.getLogger("trainguard.fault_tolerance").warning(
            "health endpoint: request from %s failed: %r", client_address, exc)

    def __init__(self, addr: tuple[str, int], liveness: Liveness) -> None:
        self.liveness = liveness
        super().__init__(addr, _Handler)


class HealthServer:
    """Serves :class:`Liveness` on ``host:port`` from one named daemon thread.

    Raises:
        LaunchConfigError: the port cannot be bound (in use, or privileged).
    """

    def __init__(self, liveness: Liveness, port: int, host: str = "0.0.0.0") -> None:
        try:
            self._server = _Server((host, port), liveness)
        except OSError as exc:
            raise LaunchConfigError(f"--health-port {port}: cannot listen ({exc.strerror or exc});"
                                    " pick a free port") from None
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,),
                                        name="tg-launch-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (blocks at most ~2.5 s); idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(2.0)
        self._server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
