"""Load PyTorch flight-recorder dumps safely (one per rank): one loader for every capability.

A dump is untrusted input: the unpickler can build only what the pickle opcodes themselves build
(dict, list, tuple, set, str, bytes, int, float, bool, None). Any global lookup (classes,
functions, ``__reduce__`` payloads) or persistent id is refused, so loading never runs code.

Users: ``trainguard.attribution`` (which rank stopped issuing collectives) and
``trainguard.straggler`` (per-collective arrival lateness). :func:`own_dump` reads this process's
recorder in memory (``TORCH_FR_BUFFER_SIZE`` > 0; works on gloo and NCCL in torch 2.13).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections import Counter

from trainguard.errors import TrainguardError

__all__ = ["FlightRecorderError", "load_dump", "load_dumps", "own_dump"]


class FlightRecorderError(TrainguardError, ValueError):
    """A flight-recorder dump is unsafe, malformed, or inconsistent with its siblings (each
    capability re-raises it as its own error type)."""

_MAX_DUMP_BYTES = 256 << 20
_RANK_SUFFIX = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?:\.json|\.pkl)?$")


class _PlainUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global: only opcode-built containers and scalars."""

    def find_class(self, module: str, name: str):
        raise FlightRecorderError(
            f"refusing to load {module}.{name}: a flight-recorder dump may only contain plain "
            "containers and scalars (this file would construct or call arbitrary objects)")

    def persistent_load(self, pid):
        raise FlightRecorderError("refusing a pickle persistent id in a flight-recorder dump")


def load_dump(path: str) -> dict:
    """Load one dump (pickle, or JSON when the name ends in ``.json``) without executing code.

    Raises:
        FlightRecorderError: unreadable, too large, not a dump, or it asks for a global.
    """
    try:
        size = os.path.getsize(path)
        if size > _MAX_DUMP_BYTES:
            raise FlightRecorderError(f"{path}: {size} bytes exceeds the {_MAX_DUMP_BYTES} limit")
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise FlightRecorderError(f"cannot read flight-recorder dump {path}: {exc}") from exc
    try:
        if path.endswith(".json"):
            dump = json.loads(data.decode("utf-8"))
        else:
            dump = _PlainUnpickler(io.BytesIO(data)).load()
    except FlightRecorderError as exc:
        raise FlightRecorderError(f"{path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any malformed pickle/JSON: report, never crash
        raise FlightRecorderError(f"{path} is not a readable flight-recorder dump "
                                  f"({type(exc).__name__}: {exc})") from None
    _validate(dump, path)
    return dump


def _validate(dump, path: str) -> None:
    if not isinstance(dump, dict):
        raise FlightRecorderError(f"{path}: top level is {type(dump).__name__}, expected a dict")
    for key, kind in (("entries", list), ("pg_config", dict)):
        if not isinstance(dump.get(key), kind):
            raise FlightRecorderError(f"{path}: missing {key!r} ({kind.__name__}); not a "
                                      "flight-recorder dump")
    if not isinstance(dump.get("pg_status", {}), dict):
        raise FlightRecorderError(f"{path}: 'pg_status' must be a dict")
    for i, entry in enumerate(dump["entries"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("process_group"),
                                                         (list, tuple)):
            raise FlightRecorderError(f"{path}: entry {i} lacks a 'process_group' pair")


def _candidates(path: str) -> list[tuple[int, str]]:
    if os.path.isfile(path):
        m = _RANK_SUFFIX.match(os.path.basename(path))
        return [(int(m.group("rank")) if m else 0, path)]
    if os.path.isdir(path):
        folder, names = path, os.listdir(path)
        wanted = None
    else:  # a prefix like /tmp/nccl_trace_rank_
        folder, wanted = os.path.split(path)
        folder = folder or "."
        if not os.path.isdir(folder):
            raise FlightRecorderError(f"flight-recorder path {path!r} does not exist")
        names = os.listdir(folder)
    by_prefix: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        m = _RANK_SUFFIX.match(name)
        full = os.path.join(folder, name)
        if not m or not os.path.isfile(full) or (wanted and m.group("prefix") != wanted):
            continue
        by_prefix.setdefault(m.group("prefix"), []).append((int(m.group("rank")), full))
    if not by_prefix:
        raise FlightRecorderError(f"no flight-recorder dumps (<prefix><rank>) under {path!r}")
    prefix = max(by_prefix, key=lambda p: (len(by_prefix[p]), p))
    return sorted(by_prefix[prefix])


def load_dumps(path: str, within: list[str] | None = None) -> dict[int, dict]:
    """Load every rank's dump under ``path`` (directory, single file, or file prefix).

    The rank is the number at the end of each file name; when a directory mixes prefixes the
    most common one is used. With ``within`` (real directory paths), a dump whose real path
    (symlinks resolved) lies outside all of them is refused.

    Raises:
        FlightRecorderError: nothing found, a dump is unsafe/malformed, or the dumps disagree
            (different versions or process-group layouts: they come from different jobs).
    """
    found = _candidates(os.fspath(path))
    if within is not None:
        for _, p in found:
            real = os.path.realpath(p)
            if not any(os.path.commonpath([real, root]) == root for root in within):
                raise FlightRecorderError(f"dump {p!r} resolves outside the allowed roots")
    dumps = {rank: load_dump(p) for rank, p in found}
    _check_same_job(dumps)
    return dumps


def _check_same_job(dumps: dict[int, dict]) -> None:
    versions = Counter(str(d.get("version")) for d in dumps.values())
    if len(versions) > 1:
        raise FlightRecorderError(
            f"dumps have different versions {dict(versions)}; they come from different jobs "
            "or PyTorch builds: analyse one job's dumps at a time")
    seen: dict[str, tuple[int, object]] = {}
    for rank, dump in sorted(dumps.items()):
        for name, cfg in dump["pg_config"].items():
            key = (cfg.get("desc"), str(cfg.get("ranks"))) if isinstance(cfg, dict) else cfg
            if name in seen and seen[name][1] != key:
                raise FlightRecorderError(
                    f"process group {name!r} is {seen[name][1]} in rank {seen[name][0]}'s dump "
                    f"but {key} in rank {rank}'s: the directory mixes dumps of different jobs")
            seen.setdefault(name, (rank, key))


def own_dump(stack_traces: bool = False) -> dict:
    """This process's flight-recorder contents, parsed with the same restricted unpickler.

    Args:
        stack_traces: include each entry's symbolized stack (seconds: torch symbolizes the C++
            frames of every entry; measured 10-13 s for 50 gloo entries on a loaded 2-core VM).

    Blocks for the dump itself (milliseconds without stack traces).

    Raises:
        FlightRecorderError: torch has no flight recorder, or it is off (set
            ``TORCH_FR_BUFFER_SIZE``, e.g. 2000, before the process group is created).
    """
    try:
        import torch._C._distributed_c10d as c10d

        # (include collectives, include stack traces, only active entries)
        raw = c10d._dump_fr_trace(True, stack_traces, False)  # type: ignore[attr-defined]
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise FlightRecorderError(f"no flight recorder in this torch build ({exc})") from None
    try:
        dump = _PlainUnpickler(io.BytesIO(raw)).load()
    except FlightRecorderError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed dump: report, never crash
        raise FlightRecorderError(f"unreadable in-memory flight-recorder dump ({exc})") from None
    _validate(dump, "<this process>")
    if not dump["entries"]:
        raise FlightRecorderError("the flight recorder holds no entries: set TORCH_FR_BUFFER_SIZE "
                                  "(e.g. 2000) before init_process_group")
    return dump
