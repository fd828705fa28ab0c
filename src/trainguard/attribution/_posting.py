"""Result posting backends: JSON-lines file, generic webhook (retries), Slack incoming webhook.

Posting is best effort: a backend returns False on failure and never raises into the analysis.

Follows: NVRx attrsvc dataflow poster (3 attempts, backoff from 0.5 s, retry on 408/425/429/5xx;
Slack only on STOP).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Protocol

import httpx

from trainguard._core.clock import backoff_delays
from trainguard._core.logging import get_logger

__all__ = ["JsonlPoster", "Poster", "SlackPoster", "WebhookPoster", "format_slack"]

_log = get_logger("trainguard.attribution.posting")
_RETRY_STATUS = {408, 425, 429} | set(range(500, 600))


class Poster(Protocol):
    def post(self, record: dict[str, Any]) -> bool: ...


class JsonlPoster:
    """Append one JSON object per line to ``path`` (thread-safe)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def post(self, record: dict[str, Any]) -> bool:
        line = json.dumps(record, sort_keys=True) + "\n"
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)
            return True
        except OSError as exc:
            _log.warning("cannot append result to %s: %s", self.path, exc)
            return False


class WebhookPoster:
    """POST each record as JSON to ``url``; retries with exponential backoff.

    Args:
        url: http(s) endpoint.
        attempts: total tries (>= 1).
        backoff_s: first delay between tries, doubled each time (seconds).
        timeout_s: per-request timeout (seconds).
    """

    def __init__(self, url: str, attempts: int = 3, backoff_s: float = 0.5,
                 timeout_s: float = 10.0, transform=None) -> None:
        self.url, self.attempts = url, attempts
        self.backoff_s, self.timeout_s = backoff_s, timeout_s
        self.transform = transform

    def _payload(self, record: dict[str, Any]) -> dict[str, Any] | None:
        return self.transform(record) if self.transform else record

    def post(self, record: dict[str, Any]) -> bool:
        payload = self._payload(record)
        if payload is None:
            return True  # nothing to send for this record
        delays = list(backoff_delays(self.backoff_s, 2.0, 30.0, max(self.attempts - 1, 0)))
        for attempt in range(self.attempts):
            try:
                resp = httpx.post(self.url, json=payload, timeout=self.timeout_s)
                if resp.status_code < 300:
                    return True
                if resp.status_code not in _RETRY_STATUS:
                    _log.warning("webhook %s refused the result: HTTP %s", self.url,
                                 resp.status_code)
                    return False
            except httpx.HTTPError as exc:
                _log.info("webhook %s attempt %d failed: %s", self.url, attempt + 1, exc)
            if attempt < len(delays):
                time.sleep(delays[attempt])
        _log.warning("webhook %s: giving up after %d attempts", self.url, self.attempts)
        return False


def format_slack(record: dict[str, Any]) -> dict[str, Any] | None:
    """Slack message for a STOP verdict (other verdicts are not worth a human's attention)."""
    result = record.get("result") or {}
    if record.get("decision", result.get("decision")) != "STOP":
        return None
    ev = (result.get("evidence") or [{}])[0]
    cite = f"\n`{ev.get('file')}:{ev.get('line')}` {ev.get('text', '')[:300]}" if ev else ""
    text = (f":octagonal_sign: *trainguard*: job `{record.get('job_id')}` cycle "
            f"{record.get('cycle')} will not be restarted.\n"
            f"{record.get('reason') or result.get('reason')}"
            f"{cite}")
    return {"text": text}


class SlackPoster(WebhookPoster):
    """Slack incoming-webhook messages, sent only for STOP verdicts."""

    def __init__(self, url: str, **kwargs) -> None:
        super().__init__(url, transform=format_slack, **kwargs)
