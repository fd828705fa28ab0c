"""Launcher line prefixes: who printed a line, and at which severity.

Recognised prefixes, outermost first (each optional; several may stack):

* a Kubernetes ``kubectl logs --prefix`` tag (``[pod/worker-1/pytorch] ``): the pod is the node;
* a syslog/journal date or an mpirun ``--timestamp-output`` date;
* a stream tag (``stdout: `` / ``stderr: ``), as ``accelerate test`` and other subprocess
  wrappers print their child's output;
* the trainguard launcher's ``{node}:{rank}: `` (``node07:1: ``, ``gpu-a.example.org:3: ``,
  ``10.0.0.2:0: ``): node and global rank; its own records use ``{node}:launcher: `` (node only);
* ``srun -l`` task (``3: ``), mpirun ``--tag-output`` (``[1,30]<stderr>:``), pdsh/DeepSpeed
  multi-node host (``10.0.0.2: `` or ``node-01: ``), node (``[node-01] ``), Ray
  (``(RayTrainWorker pid=12, ip=10.0.0.3) ``);
* torchrun ``[rank3]:`` (torch 2.6 repeats it: ``[rank3]:[rank3]:``) / ``--tee``
  ``[default3]:``, Lightning ``[rank: 3]``;
* NCCL ``host:pid:tid [dev] ``, syslog/dmesg ``Mon DD HH:MM:SS host kernel:``.

The body left after stripping is what patterns see. A rank named inside the body
(``[PG 0 Rank 3]``, ``[Rank 3]``, ``[rank 3]``) is taken when no prefix named one, unless it is
a rank in a process group other than the default one
(``[PG ID 5 PG GUID 83(TENSOR_MODEL_PARALLEL_GROUP) Rank 1]`` is rank 1 of a tensor-parallel
group, not global rank 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LineContext", "is_launcher_log", "parse_prefix", "severity"]

#: ``kubectl logs --prefix``: ``[pod/<pod>/<container>] `` (the pod stands for its node)
_K8S = re.compile(r"^\[pod/([\w.-]+)/[\w.-]+\] ?")
_STREAM = re.compile(r"^(?:stdout|stderr): ?")
#: ``trainguard launch``'s cycle log: ``{node}:{rank}: `` per worker line, ``{node}:launcher: ``
#: for the launcher's own records (see ``trainguard.fault_tolerance._logs``); a relative source
#: path (``train.py:12: UserWarning``) is not a host
_TG_LAUNCH = re.compile(
    r"^(\d{1,3}(?:\.\d{1,3}){3}|[A-Za-z][\w-]*(?:\.[A-Za-z][\w-]*)*):(\d{1,6}|launcher): ")
_SOURCE_EXT = re.compile(r"\.(?:py|pyx|pyi|c|cc|cpp|cxx|h|hpp|cu|cuh|rs|go|java|sh|so|txt|log)$",
                         re.IGNORECASE)
_SRUN = re.compile(r"^\s{0,3}(\d{1,6}): ")
_MPI = re.compile(r"^(?:[A-Z][a-z]{2} [A-Z][a-z]{2} +\d+ [\d:]+ \d{4})?\[\d+,(\d+)\]<std\w+>:\s?")
_PDSH = re.compile(r"^(\d{1,3}(?:\.\d{1,3}){3}|[A-Za-z][\w-]*\d[\w-]*): (?=\S)")
_NODE = re.compile(r"^\[([A-Za-z][\w.-]*\d[\w.-]*)\]:?\s")
_RAY = re.compile(r"^\((?:[\w.:-]+ )?pid=(\d+)(?:, ip=([\d.]+))?\)\s?")
#: torchrun's rank prefix; torch 2.6 prints it twice (``[rank0]:[rank0]: ``), both are stripped
_RANK = re.compile(r"^\[rank(\d+)\]:(?:\[rank\1\]:)*\s?")
_TEE = re.compile(r"^\[default(\d+)\]:\s?")
_PL_RANK = re.compile(r"^\[rank: (\d+)\]\s")
_NCCL = re.compile(r"^([A-Za-z][\w.-]*):(\d+):(\d+) \[(\d+)\] ")
_SYSLOG = re.compile(
    r"^(?:[A-Z][a-z]{2}\s+\d+\s+[\d:]+|\d{4}-\d\d-\d\dT\S+)\s+([\w.-]+)\s+kernel:\s*(?:\[\s*[\d.]+\]\s*)?")
#: a rank named in the body: ``[Rank 3]``, ``[PG 0 Rank 3]``, ``[PG ID 0 PG GUID 0 Rank 3]``; a
#: rank in another process group than the default one (PG ID > 0) is local to that group
_INLINE_RANK = re.compile(r"\[(?:PG (?:ID )?(\d+)[^\]]*?)?[Rr]ank (\d+)\]")
_NOT_HOSTS = re.compile(r"^(?:rank|default|pg|info|warning|error|debug|mlx)\d*$", re.IGNORECASE)
_SEVERITY = re.compile(r"(?:^|[\s\[|(])(INFO|WARNING|WARN|DEBUG|ERROR|CRITICAL)(?=[\]|:\s])")
_GLOG = re.compile(r"^\[?([IWEF])\d{4} [\d:.]+ ")
_NCCL_SEV = re.compile(r"\bNCCL (INFO|WARN)\b")
_WEAK = {"INFO": "info", "DEBUG": "info", "I": "info", "WARNING": "warning", "WARN": "warning",
         "W": "warning"}


@dataclass(frozen=True)
class LineContext:
    """Where a line came from, as far as its prefixes say."""

    task: int | None = None
    rank: int | None = None  # global rank
    local_rank: int | None = None
    node: str | None = None
    pid: int | None = None


def _tg_launch(text: str) -> re.Match[str] | None:
    m = _TG_LAUNCH.match(text)
    if m and not _SOURCE_EXT.search(m.group(1)) and not _NOT_HOSTS.match(m.group(1)):
        return m
    return None


def is_launcher_log(head: str, min_share: float = 0.5, lines: int = 40) -> bool:
    """Whether ``head`` (the start of a file) is a ``trainguard launch`` cycle log: at least
    ``min_share`` of its first ``lines`` non-empty lines carry the ``{node}:{rank}: `` or
    ``{node}:launcher: `` prefix. Only such files get that prefix read as node and rank, so a
    ``step:100: ...`` or ``logger:120: ...`` line elsewhere is not taken for one."""
    rows = [ln for ln in head.splitlines()[: lines * 4] if ln.strip()][:lines]
    return bool(rows) and sum(_tg_launch(ln) is not None for ln in rows) >= min_share * len(rows)


def _outer(text: str, launcher: bool = False
           ) -> tuple[int | None, int | None, str | None, int | None, str]:
    """Strip the launcher prefixes (trainguard when ``launcher``, srun, mpirun, pdsh, node, Ray);
    (task, rank, node, pid)."""
    task = rank = pid = None
    node = None
    m = _K8S.match(text)
    if m:
        node, text = m.group(1), text[m.end():]
    m = _STREAM.match(text)
    if m:
        text = text[m.end():]
    tg = _tg_launch(text) if launcher else None
    if tg:
        node, text = tg.group(1), text[tg.end():]
        if tg.group(2) != "launcher":
            rank = int(tg.group(2))
    m = _MPI.match(text)
    if m:
        rank, text = int(m.group(1)), text[m.end():]
    m = _SRUN.match(text)
    if m:
        task, text = int(m.group(1)), text[m.end():]
    m = _PDSH.match(text)
    if m and not _NOT_HOSTS.match(m.group(1)):
        node, text = m.group(1), text[m.end():]
    m = _NODE.match(text)
    if m and not _NOT_HOSTS.match(m.group(1)):
        node, text = m.group(1), text[m.end():]
    m = _RAY.match(text)
    if m:
        pid, text = int(m.group(1)), text[m.end():]
        node = m.group(2) or node
    return task, rank, node, pid, text


def parse_prefix(text: str, launcher: bool = False) -> tuple[LineContext, str]:
    """Split ``text`` into its :class:`LineContext` and the body patterns match against
    (``launcher``: the line is from a ``trainguard launch`` cycle log, see
    :func:`is_launcher_log`)."""
    task, rank, node, pid, text = _outer(text, launcher)
    local = None
    m = _RANK.match(text) or _PL_RANK.match(text)
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
        if m and m.group(1) in (None, "0"):
            rank = int(m.group(2))
    return LineContext(task, rank, local, node, pid), text


def severity(body: str) -> str:
    """``info``, ``warning`` or ``other`` from a line's own level marker (after its prefixes).

    Reads the common level markers: ``[INFO]`` (DeepSpeed, HF), glog ``I0101``/``W0101``,
    ``[I file:1]``, ``| INFO |`` (fairseq, loguru) and NCCL ``INFO``/``WARN``. A line without a
    marker (a traceback, an exception) is ``other``.
    """
    m = _GLOG.match(body)
    if m:
        return _WEAK.get(m.group(1), "other")
    m = _SEVERITY.search(body[:48])
    if m:
        return _WEAK.get(m.group(1), "other")
    m = _NCCL_SEV.search(body)
    if m:
        return _WEAK[m.group(1)]
    return "other"
