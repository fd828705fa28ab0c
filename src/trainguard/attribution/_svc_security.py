"""Service guards: API keys (constant time), path allow-list, body size limit, rate limits."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time

__all__ = ["ApiError", "BodyLimitMiddleware", "RateLimiter", "check_key", "safe_path"]


class ApiError(Exception):
    """An HTTP error with a stable ``error_code`` (rendered as ``{error_code, message}``)."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def check_key(presented: str | None, keys: list[bytes]) -> bool:
    """True when ``presented`` equals one of ``keys``; compares against every key, in constant
    time per key, so timing does not reveal which key or prefix matched."""
    if not presented:
        return False
    given = presented.encode("utf-8", "replace")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok


def client_id(presented: str | None, host: str | None) -> str:
    """Rate-limit identity: a hash of the presented key, else the client address."""
    if presented:
        return "key:" + hashlib.sha256(presented.encode("utf-8", "replace")).hexdigest()[:16]
    return "ip:" + (host or "unknown")


def safe_path(path: object, roots: list[str], want_dir: bool = False) -> str:
    """Resolve ``path`` (symlinks included) and require it inside one of ``roots``.

    Raises:
        ApiError: 400 invalid_path/not_regular, 403 outside_root/not_readable, 404 not_found.
    """
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise ApiError(400, "invalid_path", "paths must be non-empty strings without NUL bytes")
    if not os.path.isabs(path):
        raise ApiError(400, "invalid_path", f"{path!r} is not absolute; send absolute paths")
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ApiError(403, "outside_root", f"{path!r} is outside the allowed roots")
    if not os.path.exists(real):
        raise ApiError(404, "not_found", f"{path!r} does not exist")
    if want_dir != os.path.isdir(real) or not (want_dir or os.path.isfile(real)):
        kind = "a directory" if want_dir else "a regular file"
        raise ApiError(400, "not_regular", f"{path!r} is not {kind}")
    if not os.access(real, os.R_OK):
        raise ApiError(403, "not_readable", f"{path!r} is not readable by the service")
    return real


class RateLimiter:
    """Token bucket per client: ``per_minute`` requests, refilled continuously."""

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, client: str) -> float:
        """Consume one token; returns 0 when allowed, else seconds until the next token."""
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(client, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[client] = (tokens - 1.0, now)
                return 0.0
            self._buckets[client] = (tokens, now)
            if len(self._buckets) > 10000:  # bound memory: forget full buckets
                self._buckets = {k: v for k, v in self._buckets.items() if v[0] < self.capacity}
            return (1.0 - tokens) / self.rate if self.rate > 0 else 60.0


class BodyLimitMiddleware:
    """Pure ASGI middleware: reject request bodies over ``max_bytes`` with 413 (never buffered
    beyond the limit)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, send) -> None:
        body = json.dumps({"error_code": "too_large",
                           "message": f"request body exceeds {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await self._reject(send)
                except ValueError:
                    return await self._reject(send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                return await self._reject(send)
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
