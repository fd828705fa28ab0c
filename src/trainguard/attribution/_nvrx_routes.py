"""NVRx-compatible routes for ``trainguard attrsvc``: what NVRx's launcher client calls.

NVRx's ``ft_launcher --ft-attribution-endpoint URL`` posts each cycle's log to ``URL/logs`` and
polls ``URL/logs?log_path=...&wait=...``; without these routes every call gets 404 and the client
silently turns attribution off. The routes run the service's one pipeline
(:meth:`AnalysisService.submit`) and translate names:

* ``POST /logs`` ``{log_path, user="unknown", job_id?, cycle_id? (strict int),
  analysis_intent: track_only|progressive|terminal}``: ``terminal`` submits an analysis of
  ``log_path`` (coalesced with an identical one in flight); ``progressive``/``track_only`` are
  validated and acknowledged (no analysis). Reply ``{submitted, normalized_path, mode,
  logs_dir, sched_restarts, files_analyzed}``.
* ``GET /logs?log_path=P&wait=true|false``: the latest terminal analysis of ``P``:
  ``{status: pending|in_flight|completed|failed, result, recommendation: {action, reason,
  source}}``. ``wait=true`` holds the request until the analysis finished, at most
  ``WAIT_LIMIT_S`` seconds (then answers with the current status).
* Actions: ``STOP`` stays ``STOP``; ``RESTART``, ``RESTART_EXCLUDE_NODES`` (the nodes are named
  in ``reason``) and ``CONTINUE`` become ``RESTART`` (the NVRx client knows RESTART and STOP);
  no verdict yet is ``UNKNOWN``.

Authentication: NVRx's client sends no headers, so the key travels in the endpoint URL
(``http://host:port/k/<API-KEY>`` -> ``/k/<API-KEY>/logs``), or ``--nvrx-trust-loopback`` lets
``/logs`` through for clients on 127.0.0.1/::1 only; an anonymous service (``--allow-anonymous``)
needs neither. Errors are ``{error_code, message}`` as on the other routes.

Follows: NVRx ``nvrx-attrsvc`` ``/logs`` routes (names, intents, statuses); differences: NVRx
has no authentication; the path -> analysis map lives in memory (a service restart forgets
which analysis answers ``GET /logs``; the analyses themselves persist).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from trainguard.attribution._svc_core import AnalysisService
from trainguard.attribution._svc_security import (
    ApiError,
    RateLimiter,
    check_key,
    client_id,
    safe_path,
)

__all__ = ["WAIT_LIMIT_S", "add_nvrx_routes", "nvrx_action"]

WAIT_LIMIT_S = 60.0
_POLL_S = 0.1
_STATUS = {"pending": "pending", "running": "in_flight", "completed": "completed",
           "failed": "failed"}


class NvrxSubmit(BaseModel):
    """Body of NVRx's ``POST /logs``."""

    model_config = ConfigDict(extra="ignore")
    log_path: str = Field(max_length=4096)
    user: str = Field(default="unknown", max_length=256)
    job_id: str | None = Field(default=None, max_length=128)
    cycle_id: StrictInt | None = Field(default=None, ge=0, le=1_000_000_000)
    analysis_intent: Literal["track_only", "progressive", "terminal"] = "terminal"


def nvrx_action(decision: str | None, reason: str | None) -> tuple[str, str]:
    """(NVRx action, reason) for a trainguard decision (see the module docstring)."""
    text = reason or ""
    if decision == "STOP":
        return "STOP", text
    if decision == "RESTART_EXCLUDE_NODES":
        return "RESTART", f"RESTART_EXCLUDE_NODES: {text}".strip()
    if decision in ("RESTART", "CONTINUE"):
        return "RESTART", text
    return "UNKNOWN", text or "no verdict yet"


def _job_id(body: NvrxSubmit, path: str) -> str:
    raw = body.job_id or ""
    if raw and all(c.isalnum() or c in "._:-" for c in raw):
        return raw
    return "nvrx-" + hashlib.sha256((raw or path).encode()).hexdigest()[:16]


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_nvrx_routes(app: FastAPI, service: Callable[[], AnalysisService], keys: list[bytes],
                    limiter: RateLimiter, trust_loopback: bool) -> None:
    """Mount ``/logs`` and ``/k/{key}/logs`` on ``app``.

    ``service()`` returns the running :class:`AnalysisService` (raises ``KeyError`` before the
    app started). Handlers block at most ``WAIT_LIMIT_S`` seconds (``wait=true``).
    """
    latest: dict[str, str] = {}  # normalized log path -> analysis id of its last terminal POST
    lock = threading.Lock()

    def admit(request: Request, key: str | None) -> AnalysisService:
        host = request.client.host if request.client else None
        wait = limiter.take(client_id(key, host))
        if wait > 0:
            raise ApiError(429, "rate_limited", "too many requests; slow down",
                           {"Retry-After": str(max(1, int(wait + 0.999)))})
        if keys:
            if key is not None:
                if not check_key(key, keys):
                    raise ApiError(401, "unauthorized", "invalid API key in the endpoint URL")
            elif not (trust_loopback and _is_loopback(host)):
                raise ApiError(401, "unauthorized",
                               "NVRx's client sends no API key header: use the endpoint "
                               "http://HOST:PORT/k/<API-KEY>, or start attrsvc with "
                               "--nvrx-trust-loopback for clients on this host")
        return service()

    def submit(request: Request, body: NvrxSubmit, key: str | None) -> dict[str, Any]:
        svc = admit(request, key)
        path = safe_path(body.log_path, svc.cfg.allowed_roots)
        if body.analysis_intent == "terminal":
            rec, _ = svc.submit(_job_id(body, path), body.cycle_id or 0, [path], None, True)
            with lock:
                latest[path] = rec["id"]
        return {"submitted": True, "normalized_path": path, "mode": "single", "logs_dir": None,
                "sched_restarts": 0, "files_analyzed": 1}

    async def result(request: Request, log_path: str, wait: bool,
                     key: str | None) -> dict[str, Any]:
        svc = admit(request, key)
        path = safe_path(log_path, svc.cfg.allowed_roots)
        with lock:
            rid = latest.get(path)
        if rid is None:
            raise ApiError(404, "not_found", f"no terminal analysis was submitted for {log_path!r}"
                           " (POST /logs with analysis_intent=terminal first)")
        deadline = time.monotonic() + WAIT_LIMIT_S
        rec = svc.store.get(rid)
        while (wait and rec is not None and rec["status"] in ("pending", "running")
               and time.monotonic() < deadline):
            await asyncio.sleep(_POLL_S)
            rec = svc.store.get(rid)
        if rec is None:
            raise ApiError(404, "not_found", f"the analysis of {log_path!r} is gone")
        res = rec.get("result") or {}
        action, reason = nvrx_action(res.get("decision"), res.get("reason") or rec.get("error"))
        return {"status": _STATUS.get(rec["status"], rec["status"]),
                "result": res.get("analysis"), "log_path": path, "analysis_id": rid,
                "recommendation": {"action": action, "reason": reason, "source": "trainguard"}}

    router = APIRouter(tags=["nvrx"])

    @router.post("/logs")
    def post_logs(request: Request, body: NvrxSubmit) -> dict[str, Any]:
        return submit(request, body, None)

    @router.get("/logs")
    async def get_logs(request: Request, log_path: str, wait: bool = True) -> dict[str, Any]:
        return await result(request, log_path, wait, None)

    @router.post("/k/{key}/logs")
    def post_logs_key(request: Request, key: str, body: NvrxSubmit) -> dict[str, Any]:
        return submit(request, body, key)

    @router.get("/k/{key}/logs")
    async def get_logs_key(request: Request, key: str, log_path: str,
                           wait: bool = True) -> dict[str, Any]:
        return await result(request, log_path, wait, key)

    app.include_router(router)
