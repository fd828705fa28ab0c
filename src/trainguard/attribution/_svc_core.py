"""Attribution service core: validation, coalescing, a bounded worker pool, persistence, metrics.

Independent of HTTP: the FastAPI layer (``_service.py``) only translates requests to calls here.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainguard._core.logging import get_logger
from trainguard.attribution._agent import RestartPolicy
from trainguard.attribution._pipeline import JOB_ENDED_DEFAULT, analysis_part, analyze
from trainguard.attribution._store import ResultStore
from trainguard.attribution._svc_security import ApiError, safe_path
from trainguard.attribution.errors import AttributionError
from trainguard.errors import ConfigError

__all__ = ["AnalysisService", "ServiceConfig", "default_db_url"]

_log = get_logger("trainguard.attribution.service")


def default_db_url() -> str:
    """``sqlite:///$XDG_STATE_HOME/trainguard/attrsvc.db``; ``~/.local/state`` when that variable
    is unset or relative (as the XDG base-directory spec says)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        state = os.path.join(os.path.expanduser("~"), ".local", "state")
    return "sqlite:///" + os.path.join(state, "trainguard", "attrsvc.db")


@dataclass
class ServiceConfig:
    """Attribution service settings.

    Attributes:
        allowed_roots: directories whose files may be analysed (symlinks resolved).
        api_keys: accepted API keys; at least one unless ``allow_anonymous``.
        allow_anonymous: accept requests without a key (the CLI allows it on loopback only).
        db_url: ``sqlite:///PATH`` (default :func:`default_db_url`, under the user's state dir).
        max_body_bytes: largest accepted request body (bytes).
        rate_per_minute: requests per minute per client (API key or address).
        workers: concurrent analyses.
        max_paths: most log paths in one request.
        posters: result posting backends (``_posting``), called after each analysis.
        policy: restart-agent limits.
        nvrx_trust_loopback: accept NVRx's header-less ``/logs`` calls from 127.0.0.1/::1
            without a key (other NVRx clients put the key in the URL: ``/k/<key>/logs``).
    """

    allowed_roots: list[str]
    api_keys: list[str] = field(default_factory=list)
    db_url: str = field(default_factory=default_db_url)
    max_body_bytes: int = 64 * 1024
    rate_per_minute: int = 600
    workers: int = 2
    max_paths: int = 64
    posters: list[Any] = field(default_factory=list)
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    allow_anonymous: bool = False
    nvrx_trust_loopback: bool = False

    def __post_init__(self) -> None:
        if not self.allowed_roots:
            raise ConfigError("the attribution service needs at least one --allowed-root")
        roots = []
        for root in self.allowed_roots:
            real = os.path.realpath(root)
            if not os.path.isdir(real):
                raise ConfigError(f"allowed root {root!r} is not a directory")
            roots.append(real)
        self.allowed_roots = roots
        self.api_keys = [k.strip() for k in self.api_keys if k and k.strip()]
        if not self.api_keys and not self.allow_anonymous:
            raise ConfigError("no API key configured: pass --api-key-file, set "
                              "TRAINGUARD_ATTRSVC_API_KEYS=key1,key2, or pass --allow-anonymous "
                              "(loopback --host only; ServiceConfig(allow_anonymous=True) in "
                              "Python)")
        for name in ("max_body_bytes", "rate_per_minute", "workers", "max_paths"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


class Metrics:
    """Counters and gauges rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[tuple[str, tuple], float] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.counters[key] = self.counters.get(key, 0.0) + value

    def render(self, gauges: dict[str, float]) -> str:
        lines = []
        with self._lock:
            items = sorted(self.counters.items())
        for (name, labels), value in items:
            lab = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"trainguard_attrsvc_{name}{{{lab}}} {value}" if lab else
                         f"trainguard_attrsvc_{name} {value}")
        lines += [f"trainguard_attrsvc_{k} {v}" for k, v in sorted(gauges.items())]
        return "\n".join(lines) + "\n"


class AnalysisService:
    """Accepts analysis requests, runs them on a worker pool, stores and posts the results."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.store = ResultStore(cfg.db_url)
        self.metrics = Metrics()
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="attrsvc")
        self._submit_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._running = 0
        for rec in self.store.unfinished():  # persistence: finish what a restart interrupted
            self._pool.submit(self._run, rec["id"])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.store.close()

    def _validate(self, log_paths: list[str], fr_dir: str | None) -> tuple[list[str], str | None]:
        if not log_paths and not fr_dir:
            raise ApiError(400, "invalid_request", "give log_paths, fr_dir, or both")
        if len(log_paths) > self.cfg.max_paths:
            raise ApiError(400, "invalid_request", f"at most {self.cfg.max_paths} log paths")
        roots = self.cfg.allowed_roots
        paths = [safe_path(p, roots) for p in log_paths]
        return paths, safe_path(fr_dir, roots, want_dir=True) if fr_dir else None

    @staticmethod
    def _key(job_id: str, cycle: int, paths: list[str], fr_dir: str | None) -> str:
        sig = []
        for p in paths + ([fr_dir] if fr_dir else []):
            st = os.stat(p)
            sig.append((p, st.st_size, st.st_mtime_ns))
        raw = json.dumps([job_id, cycle, sig])
        return hashlib.sha256(raw.encode()).hexdigest()

    def submit(self, job_id: str, cycle: int, log_paths: list[str], fr_dir: str | None,
               job_ended: bool = JOB_ENDED_DEFAULT) -> tuple[dict[str, Any], bool]:
        """Validate and queue one analysis; returns (record, coalesced).

        The analysis is :func:`trainguard.attribution.analyze` -- the one pipeline the CLI and
        the launcher also call -- with the same ``job_ended`` default.

        Raises:
            ApiError: a path is invalid, outside the roots, missing or not readable.
        """
        paths, fr = self._validate(log_paths, fr_dir)
        key = self._key(job_id, cycle, paths, fr)
        with self._submit_lock:
            existing = self.store.in_flight(key)
            if existing is not None:
                self.metrics.inc("coalesced_total")
                return existing, True
            rid = uuid.uuid4().hex
            request = {"log_paths": paths, "fr_dir": fr, "job_ended": job_ended}
            self.store.insert(rid, job_id, cycle, key, request)
        self.metrics.inc("submitted_total")
        self._pool.submit(self._run, rid)
        row = self.store.get(rid)
        if row is None:  # inserted above under the lock; a missing row is a store defect
            raise RuntimeError(f"analysis {rid} vanished from the store right after its insert")
        return row, False

    def _history(self, job_id: str, cycle: int) -> list[dict[str, Any]]:
        return [r["result"]["analysis"] for r in self.store.by_job(job_id, limit=1000)
                if r["cycle"] < cycle and r["status"] == "completed" and r["result"]
                and r["result"].get("analysis")]

    def _analyse(self, rec: dict[str, Any]) -> dict[str, Any]:
        req = rec["request"]
        out = analyze(req["log_paths"], fr_dir=req.get("fr_dir"),
                      history=self._history(rec["job_id"], rec["cycle"]),
                      policy=self.cfg.policy, fr_within=self.cfg.allowed_roots,
                      job_ended=req.get("job_ended", JOB_ENDED_DEFAULT))
        result: dict[str, Any] = {"analysis": analysis_part(out),
                                  "flight_recorder": out.get("flight_recorder"),
                                  "decision": out["decision"], "reason": out["reason"]}
        if out.get("agent") is not None:
            result["agent"] = out["agent"]
        return result

    def _run(self, rid: str) -> None:
        rec = self.store.get(rid)
        if rec is None:
            return
        self.store.update(rid, "running")
        with self._count_lock:
            self._running += 1
        started = time.monotonic()
        try:
            result = self._analyse(rec)
            self.store.update(rid, "completed", result=result)
            self.metrics.inc("analyses_total", status="completed")
        except AttributionError as exc:
            self.store.update(rid, "failed", error=str(exc))
            self.metrics.inc("analyses_total", status="failed")
            result = None
        except Exception as exc:  # noqa: BLE001 - never let a worker die silently
            _log.exception("analysis %s crashed", rid)
            self.store.update(rid, "failed", error=f"internal error: {type(exc).__name__}")
            self.metrics.inc("analyses_total", status="error")
            result = None
        finally:
            with self._count_lock:
                self._running -= 1
            self.metrics.inc("analysis_seconds_sum", time.monotonic() - started)
        if result is not None:
            self._post(rec, result)

    def _post(self, rec: dict[str, Any], result: dict[str, Any]) -> None:
        record = {"id": rec["id"], "job_id": rec["job_id"], "cycle": rec["cycle"],
                  "decision": result.get("decision"), "reason": result.get("reason"),
                  "result": result.get("analysis"),
                  "flight_recorder": result.get("flight_recorder")}
        for poster in self.cfg.posters:
            try:
                ok = poster.post(record)
            except Exception:  # noqa: BLE001 - a poster must never break the service
                _log.exception("poster %r failed", poster)
                ok = False
            self.metrics.inc("posts_total", status="ok" if ok else "failed")

    def gauges(self) -> dict[str, float]:
        return {"analyses_running": float(self._running)}
