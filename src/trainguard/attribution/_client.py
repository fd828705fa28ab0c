"""Blocking HTTP client of the attribution service (httpx)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from trainguard._core.clock import Deadline
from trainguard.attribution.errors import ServiceError
from trainguard.errors import TrainguardTimeout

__all__ = ["AttributionClient"]


class AttributionClient:
    """Talk to ``trainguard attrsvc``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``X-API-Key``.
        timeout_s: per-request timeout (seconds).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        headers = {"X-API-Key": api_key} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers,
                                  timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AttributionClient:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, url: str, **kwargs) -> Any:
        try:
            resp = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise ServiceError(f"attribution service unreachable: {exc}") from exc
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = {}
            raise ServiceError(f"HTTP {resp.status_code} {body.get('error_code', '')}: "
                               f"{body.get('message', resp.text[:200])}",
                               resp.status_code, body.get("error_code", ""))
        return resp.json()

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def submit(self, job_id: str, log_paths: list[str], cycle: int = 0,
               fr_dir: str | None = None, job_ended: bool | None = None) -> dict[str, Any]:
        """Queue an analysis; returns the record (``id``, ``status``, ``coalesced``).

        ``job_ended``: the caller knows the job (cycle) has ended; ``None`` leaves it to the
        service's default, the one pipeline's ``JOB_ENDED_DEFAULT`` (the log decides).

        Raises:
            ServiceError: the service refused the request (status and error_code attached).
        """
        body: dict[str, Any] = {"job_id": job_id, "cycle": cycle, "log_paths": list(log_paths),
                                "fr_dir": fr_dir}
        if job_ended is not None:
            body["job_ended"] = job_ended
        return self._call("POST", "/v1/analyses", json=body)

    def get(self, analysis_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/analyses/{analysis_id}")

    def list_job(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/jobs/{job_id}/analyses")["analyses"]

    def wait(self, analysis_id: str, timeout_s: float = 60.0, poll_s: float = 0.1) -> dict:
        """Poll until the analysis is completed or failed.

        Raises:
            TrainguardTimeout: still pending/running after ``timeout_s`` seconds.
        """
        deadline = Deadline(timeout_s)
        while True:
            rec = self.get(analysis_id)
            if rec["status"] in ("completed", "failed"):
                return rec
            if deadline.expired():
                raise TrainguardTimeout(f"analysis {analysis_id} still {rec['status']} after "
                                        f"{deadline.elapsed():.1f}s (limit {timeout_s}s)")
            time.sleep(deadline.chunk(poll_s))
