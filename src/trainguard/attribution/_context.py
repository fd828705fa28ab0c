"""Launcher line prefixes: who printed a line (srun task, rank, node, NCCL host:pid).

Recognised prefixes, outermost first: ``srun -l`` task (``3: ``), node (``[node-01] ``),
torchrun ``[rank3]:`` / ``--tee`` ``[default3]:``, NCCL ``host:pid:tid [dev] ``, and syslog/dmesg
``Mon DD HH:MM:SS host kernel:``. The body left after stripping is what patterns see.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LineContext", "parse_prefix"]

_SRUN = re.compile(r"^\s{0,3}(\d{1,6}): ")
_NODE = re.compile(r"^\[([A-Za-z][\w.-]*\d[\w.-]*)\]:?\s")
_RANK = re.compile(r"^\[rank(\d+)\]:\s?")
_TEE = re.compile(r"^\[default(\d+)\]:\s?")
_NCCL = re.compile(r"^([A-Za-z][\w.-]*):(\d+):(\d+) \[(\d+)\] ")
_SYSLOG = re.compile(
    r"^(?:[A-Z][a-z]{2}\s+\d+\s+[\d:]+|\d{4}-\d\d-\d\dT\S+)\s+([\w.-]+)\s+kernel:\s*(?:\[\s*[\d.]+\]\s*)?")
_INLINE_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]")
_NOT_HOSTS = re.compile(r"^(?:rank|default|pg|info|warning|error|debug)\d*$", re.IGNORECASE)


@dataclass(frozen=True)
class LineContext:
    """Where a line came from, as far as its prefixes say."""

    task: int | None = None
    rank: int | None = None  # global rank
    local_rank: int | None = None
    node: str | None = None
    pid: int | None = None


def parse_prefix(text: str) -> tuple[LineContext, str]:
    """Split ``text`` into its :class:`LineContext` and the body patterns match against."""
    task = rank = local = pid = None
    node = None
    m = _SRUN.match(text)
    if m:
        task, text = int(m.group(1)), text[m.end():]
    m = _NODE.match(text)
    if m and not _NOT_HOSTS.match(m.group(1)):
        node, text = m.group(1), text[m.end():]
    m = _RANK.match(text)
    if m:
        rank, text = int(m.group(1)), text[m.end():]
    else:
        m = _TEE.match(text)
        if m:
            local, text = int(m.group(1)), text[m.end():]
    m = _NCCL.match(text)
    if m:
        node, pid, text = m.group(1), int(m.group(2)), text[m.end():]
    else:
        m = _SYSLOG.match(text)
        if m:
            node, text = m.group(1), text[m.end():]
    if rank is None:
        m = _INLINE_RANK.search(text)
        if m:
            rank = int(m.group(1))
    return LineContext(task, rank, local, node, pid), text
