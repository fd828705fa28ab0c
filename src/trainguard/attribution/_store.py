"""Embedded SQLite store of analyses: survives service restarts; one row per request."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Any

from trainguard.errors import ConfigError

__all__ = ["ResultStore", "db_path_from_url"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS analyses (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    cycle INTEGER NOT NULL,
    key TEXT NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    result TEXT,
    error TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS analyses_job ON analyses(job_id, cycle);
CREATE INDEX IF NOT EXISTS analyses_key ON analyses(key, status);
"""


def db_path_from_url(url: str) -> str:
    """``sqlite:///abs/path``, ``sqlite:///:memory:`` or a plain file path -> sqlite3 path.

    Raises:
        ConfigError: another URL scheme (only SQLite is built in).
    """
    if url.startswith("sqlite:///"):
        return url[len("sqlite:///"):] if url != "sqlite:///:memory:" else ":memory:"
    if "://" in url:
        raise ConfigError(f"--db {url!r}: only sqlite:///PATH URLs are supported")
    return url


class ResultStore:
    """Thread-safe wrapper over one SQLite connection (WAL mode, serialized writes)."""

    def __init__(self, url: str) -> None:
        path = db_path_from_url(url)
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def insert(self, rid: str, job_id: str, cycle: int, key: str, request: dict) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO analyses VALUES (?,?,?,?,?,?,?,?,?,?)",
                (rid, job_id, cycle, key, "pending", json.dumps(request), None, None, now, now))
            self._db.commit()

    def update(self, rid: str, status: str, result: dict | None = None,
               error: str | None = None) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE analyses SET status=?, result=?, error=?, updated=? WHERE id=?",
                (status, json.dumps(result) if result is not None else None, error, time.time(),
                 rid))
            self._db.commit()

    def _rows(self, sql: str, args: tuple) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        out = []
        for row in rows:
            rec = dict(row)
            rec["request"] = json.loads(rec["request"])
            rec["result"] = json.loads(rec["result"]) if rec["result"] else None
            out.append(rec)
        return out

    def get(self, rid: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM analyses WHERE id=?", (rid,))
        return rows[0] if rows else None

    def in_flight(self, key: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM analyses WHERE key=? AND status IN ('pending','running')"
                          " ORDER BY created LIMIT 1", (key,))
        return rows[0] if rows else None

    def by_job(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM analyses WHERE job_id=? ORDER BY cycle, created LIMIT ?",
                          (job_id, limit))

    def unfinished(self) -> list[dict[str, Any]]:
        return self._rows("SELECT * FROM analyses WHERE status IN ('pending','running')"
                          " ORDER BY created", ())
