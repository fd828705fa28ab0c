"""torchelastic's JSON error file (``error.json``) as the text its traceback would be in a log.

A worker whose entry point carries torchelastic's ``@record`` writes its uncaught exception to
``$TORCHELASTIC_ERROR_FILE`` (torchrun: ``<log-dir>/<run>/attempt_<N>/<local_rank>/error.json``)::

    {"message": {"message": "FileNotFoundError: ...",
                 "extraInfo": {"py_callstack": "Traceback (most recent call last):\\n...",
                               "timestamp": "1796175442"}}}

Older writers (and custom error handlers) put a string in ``message``, with ``timestamp`` beside
it. :func:`error_file_text` returns the traceback (``py_callstack``; else the message), so the
scanner reads it line by line exactly like the same traceback in a log: line numbers cited
for such a file count the lines of that traceback.

Follows: torch ``distributed/elastic/multiprocessing/errors`` (``ErrorHandler`` writes the file,
``ProcessFailure`` reads both layouts).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_ERROR_FILE_BYTES", "error_file_text", "looks_like_error_file"]

#: larger files are not read as error files (a traceback of that size is a log, read as one)
MAX_ERROR_FILE_BYTES = 16 << 20


def looks_like_error_file(head: bytes) -> bool:
    """``head`` (a file's first bytes) opens a JSON object with a ``message`` key."""
    start = head.lstrip()
    return start.startswith(b"{") and b'"message"' in start[:4096]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def error_file_text(raw: bytes) -> str | None:
    """The traceback (else the message) an error file records, newline-terminated; ``None``
    when ``raw`` is not such a file (not JSON, or no ``message`` of either layout). Never
    raises."""
    try:
        data = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = _text(extra.get("py_callstack")) if isinstance(extra, dict) else None
        text = stack or _text(message.get("message"))
    else:
        text = _text(message)
    if text is None:
        return None
    return text if text.endswith("\n") else text + "\n"
