"""Per-subpackage loggers with a rank-prefixed format (``[rank3] trainguard.inprocess: ...``)."""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "rank_prefix"]

_FORMAT = "%(asctime)s %(rank_prefix)s%(name)s %(levelname)s: %(message)s"


def rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank{rank}] " if rank not in (None, "") else ""


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = rank_prefix()
        return True


def get_logger(name: str) -> logging.Logger:
    """Logger ``name`` whose records carry ``rank_prefix``; handlers are left to the application.

    Set ``TRAINGUARD_LOG_LEVEL`` (e.g. ``DEBUG``) to attach a stderr handler at that level.
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    level = os.environ.get("TRAINGUARD_LOG_LEVEL")
    root = logging.getLogger("trainguard")
    if level and not any(getattr(h, "_trainguard", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler._trainguard = True  # type: ignore[attr-defined]
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        root.setLevel(level.upper())
    return logger
