"""Streaming log scanner: constant memory, stable line numbers, registry-driven.

Each file is read in 1 MiB chunks. Only lines containing one of the registry's lowercase trigger
substrings are decoded and matched (one Aho-Corasick pass per chunk with ``ahocorasick_rs``, else
one ``bytes.find`` pass per trigger), and progress is looked
up from the end of each chunk, since only the last iteration matters. Everything kept is bounded:
at most ``_KEEP`` matches per pattern plus per-pattern sets of who printed them.

Facts kept besides matches: identity maps (rank -> host, pid -> rank, ip -> host), the
launchers' exit reports, where the last teardown line is (a log that ends tearing the job down
is not a running job), the job's framing host(s) and node count, the checkpoint files the log
shows being loaded (a row may require its ``path`` to lie inside one: ``within:
loaded_checkpoint``), and the host of an open failure record (Ray's ``ip:``), which the record's
reason line is about.

In-process restarts (see :class:`Recovery`): failure lines wait in a per-file bucket; an
in-process restart record (``inprocess.Wrapper``'s ``restart N -> N+1: cause=...``, NVRx's
nested-restarter line) moves them to that recovery, the end of the file makes them stand. The
Wrapper's WARNING ``iteration N raised; restarting all ranks:`` (its one line at the default log
level) announces a recovery: the traceback after it from the same printer is that fault (a
chained exception included); a later record of the same or a higher iteration, or the call's
completion, confirms it, and a rank leaving the restart loop (``RestartAbort``) before that
revokes it, so its fault stands.

A torchelastic error file (``error.json``, see ``_errfile``) is read as the traceback it records.
The first 64 KiB of each file are sniffed: NUL bytes are an error (binary), and more than 10%
undecodable or control characters make a warning and mark the file as not text.
"""

from __future__ import annotations

import codecs
import io
import os
import posixpath
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache

try:  # optional accelerator: multi-substring search in one pass (Rust Aho-Corasick)
    import ahocorasick_rs as _ac
except ImportError:  # pragma: no cover - the bytes.find fallback gives identical results
    _ac = None  # type: ignore[assignment]

from trainguard.attribution._context import LineContext, is_launcher_log, parse_prefix, severity
from trainguard.attribution._errfile import (
    MAX_ERROR_FILE_BYTES,
    error_file_text,
    looks_like_error_file,
)
from trainguard.attribution._registry import Pattern, Registry
from trainguard.attribution.errors import LogInputError

__all__ = ["ExitEvent", "Match", "Recovery", "ScanState", "scan_files"]

_CHUNK = 1 << 20
_MAX_LINE = 1 << 16  # longer lines are split; their tail is matched as its own line
_KEEP = 64
_TAIL = 1 << 16
_MAX_KEYS = 4096
_TEXT = 400
_FAILURE_ROLES = {"root", "confirmation", "cascade", "diagnostic"}
_MAX_EXITS = 256
_MAX_RECOVERIES = 64  # in-process restarts kept (later ones are counted only)
_RECOVERED_KEEP = 32  # failure lines kept per in-process restart
_CAUGHT_SPAN = 400  # lines after the Wrapper's "raised; restarting" warning its traceback may span
#: lines after a failure record's host field (Ray's ``ip:``) within which the first failure line
#: is taken as the record's reason (room for a few unrelated lines interleaved by other processes)
_RECORD_SPAN = 12
_MAX_CKPT_FILES = 64
_PATH_TRIM = "'\".,:;)]"  # quotes and punctuation around a path named in a message
#: signal names and launcher words for a process killed by a signal -> the negative exit code
_SIGNALS = {"SIGKILL": -9, "KILLED": -9, "OUT OF MEMORY": -9, "SIGSEGV": -11,
            "SEGMENTATION FAULT": -11, "SIGABRT": -6, "ABORTED": -6, "SIGBUS": -7,
            "BUS ERROR": -7, "SIGILL": -4, "ILLEGAL INSTRUCTION": -4, "SIGTERM": -15}
_SNIFF = 1 << 16  # bytes of each file judged for text-likeness
_MAX_JUNK = 0.10  # above this fraction of undecodable/control characters a file is not text
_TEXT_CONTROLS = frozenset("\t\n\r\f\v\b\x1b")  # tabs, progress bars, ANSI colours


@dataclass(frozen=True)
class Match:
    """One matched line: pattern, position, context and named groups."""

    pattern: Pattern
    file: int
    line: int
    text: str
    ctx: LineContext
    groups: tuple[tuple[str, str], ...]
    level: str = "other"  # the line's own severity marker: info, warning or other

    @property
    def order(self) -> tuple[int, int]:
        return (self.file, self.line)

    def group(self, prefix: str) -> list[str]:
        return [v for k, v in self.groups if k.startswith(prefix)]


@dataclass(frozen=True)
class ExitEvent:
    """A launcher's report that one process (or several) ended, normalised across launchers.

    ``code`` is the exit code, or ``-N`` for death by signal N. ``rank`` is set only where the
    launcher names the failed process itself (torchrun's failure record, mpirun, ``mp.spawn``),
    never from launchers that always print the last spawned rank (DeepSpeed, torch 1.x
    ``launch.py``); ``task`` is an srun task number, ``pid``/``local_rank`` torchrun's.
    ``sender`` is who sent the killing signal where the launcher's record says it (``launcher``
    or ``outside``, see ``_registry.SENDERS``), else ``None``; what the exit means is decided
    once, by :meth:`Registry.exit_category`.
    """

    order: tuple[int, int]
    code: int
    source: str
    rank: int | None = None
    task: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    node: str | None = None
    sender: str | None = None


@dataclass
class Recovery:
    """An in-process restart the log records (``inprocess.Wrapper``'s ``restart N -> N+1:
    cause=... ranks=[...]``, NVRx's ``[NestedRestarter] ... state=handling stage=completed``):
    the failure lines printed in the same file since the previous one were recovered from.

    ``iteration`` is the restart iteration that failed, ``cause`` and ``ranks`` what the restart
    record says about the fault (``exception``, ``[1]``), ``faults`` the failure lines it recovered
    from (the first :data:`_RECOVERED_KEEP`, in log order; empty when another rank's record of the
    same restart already took them).
    """

    order: tuple[int, int]
    text: str
    pattern: str
    iteration: int | None
    cause: str | None
    ranks: set[int] = field(default_factory=set)
    faults: list[Match] = field(default_factory=list)
    #: a restart record (or a later iteration's warning, or the call's completion) shows the
    #: restart happened; a warning alone is revoked when the rank then leaves the restart loop
    confirmed: bool = True


def _keep(m: Match, matches: dict[str, list[Match]], counts: dict[str, int],
          who: dict[str, set]) -> None:
    """Count ``m`` and keep it (at most ``_KEEP`` per pattern) and who printed it (at most
    ``_MAX_KEYS`` per pattern)."""
    pid = m.pattern.id
    counts[pid] += 1
    if len(matches[pid]) < _KEEP:
        matches[pid].append(m)
    printers = who[pid]
    if len(printers) < _MAX_KEYS:
        printers.add((m.ctx, m.groups))


@dataclass
class _Bucket:
    """Failure matches of the current file since its last in-process restart record, with the
    same bounds as :class:`ScanState`'s own (they join it when the file ends without one)."""

    matches: dict[str, list[Match]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    who: dict[str, set] = field(default_factory=lambda: defaultdict(set))

    def add(self, m: Match) -> None:
        _keep(m, self.matches, self.counts, self.who)

    def clear(self) -> None:
        self.matches.clear()
        self.counts.clear()
        self.who.clear()


@dataclass
class ScanState:
    """Everything the verdict needs, accumulated over all files."""

    files: list[str] = field(default_factory=list)
    bytes_read: int = 0
    lines: int = 0
    warnings: list[str] = field(default_factory=list)
    non_text: list[str] = field(default_factory=list)  # files that do not look like text logs
    launcher_files: set[int] = field(default_factory=set)  # ``trainguard launch`` cycle logs
    flagged: list[str] = field(default_factory=list)  # inputs not read: binary, unreadable
    nonempty: int = 0
    matches: dict[str, list[Match]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    who: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    task_ranks: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    task_host: dict[int, str] = field(default_factory=dict)
    rank_host: dict[int, str] = field(default_factory=dict)
    pid_rank: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    ip_host: dict[str, str] = field(default_factory=dict)
    endpoints: set[str] = field(default_factory=set)  # configured store/rendezvous hosts
    job_hosts: set[str] = field(default_factory=set)  # hosts the job's framing says it ran on
    nnodes: int = 0  # the most nodes any launcher line says the job spans (0: not said)
    ckpt_files: set[str] = field(default_factory=set)  # checkpoint files the log shows loading
    world_size: int | None = None
    exit_records: list[tuple[int, str | None, int]] = field(default_factory=list)
    exits: list[ExitEvent] = field(default_factory=list)
    pid_global: dict[int, int] = field(default_factory=dict)  # pid -> global rank (torchrun)
    ranks_seen: set[int] = field(default_factory=set)
    per_node_launcher: bool = False  # torchrun/DeepSpeed/accelerate ran one agent per node
    enqueued: dict[int, int] = field(default_factory=dict)
    first_progress: tuple | None = None
    last_progress: tuple | None = None
    last_checkpoint: tuple | None = None
    #: (file, line) of the last teardown line (a launcher's or runtime's report that the job is
    #: being torn down: ChildFailedError, ActorDiedError, "Terminating job step", SIGTERM sent)
    last_teardown: tuple[int, int] | None = None
    _record_host: str | None = None
    _record_rank: int | None = None
    _record_node: tuple[int, int, str] | None = None  # (file, line, host) of a record's subject
    _record_open: tuple[int, int] | None = None  # (file, line) of a record's first field
    #: in-process restarts, in log order (at most ``_MAX_RECOVERIES``; ``recovery_count`` all)
    recoveries: list[Recovery] = field(default_factory=list)
    recovery_count: int = 0
    pending: _Bucket = field(default_factory=_Bucket)
    #: the traceback a rank prints with inprocess.Wrapper's "iteration N raised; restarting all
    #: ranks:" warning, by printer (file, context): the recovery it belongs to, the warning's
    #: line, and whether its exception line has been seen (a chained exception reopens it)
    caught: dict[tuple[int, LineContext], list] = field(default_factory=dict)

    def add(self, m: Match) -> None:
        _keep(m, self.matches, self.counts, self.who)

    def flush_pending(self) -> None:
        """The current file ended: its failure lines since its last in-process restart stand."""
        self.caught.clear()
        p = self.pending
        for pid, n in p.counts.items():
            self.counts[pid] += n
            kept = self.matches[pid]  # (a revoked recovery's lines rejoin out of order)
            kept.extend(sorted(p.matches[pid], key=lambda m: m.order)[: max(0, _KEEP - len(kept))])
            who = self.who[pid]
            for key in p.who[pid]:
                if len(who) >= _MAX_KEYS:
                    break
                who.add(key)
        p.clear()

    def recover(self, rec: Recovery, take_pending: bool = True) -> Recovery:
        """An in-process restart record: the failure lines pending in this file were recovered
        from (``take_pending``); another rank's record of the same restart (same iteration)
        joins the last one. Returns the recovery the record joined."""
        faults: list[Match] = []
        if take_pending:
            faults = sorted((m for ms in self.pending.matches.values() for m in ms),
                            key=lambda m: m.order)[:_RECOVERED_KEEP]
            self.pending.clear()
        for prev in self.recoveries:  # a later iteration's record: the earlier ones restarted
            if prev.order[0] == rec.order[0] and rec.iteration is not None and \
                    prev.iteration is not None and prev.iteration < rec.iteration:
                prev.confirmed = True
        last = self.recoveries[-1] if self.recoveries else None
        if last is not None and rec.iteration is not None and last.iteration == rec.iteration \
                and last.order[0] == rec.order[0]:
            last.ranks |= rec.ranks
            last.faults = (last.faults + faults)[:_RECOVERED_KEEP]
            last.confirmed = last.confirmed or rec.confirmed
            return last
        self.recovery_count += 1
        rec.faults = faults
        if len(self.recoveries) < _MAX_RECOVERIES:
            self.recoveries.append(rec)
        return rec

    def give_up(self, file: int) -> None:
        """A rank left the restart loop (the Wrapper's ``RestartAbort``): the last restart this
        file only announced (a warning, no record that it happened) did not happen -- its
        fault stands."""
        last = self.recoveries[-1] if self.recoveries else None
        if last is None or last.confirmed or last.order[0] != file:
            return
        self.recoveries.pop()
        self.recovery_count -= 1
        for m in last.faults:
            self.pending.add(m)
        self.caught = {k: w for k, w in self.caught.items() if w[0] is not last}

    def confirm_all(self) -> None:
        """The wrapped call completed: every restart before it happened."""
        for rec in self.recoveries:
            rec.confirmed = True

    def catch(self, m: Match, body: str) -> bool:
        """``m`` belongs to a traceback the Wrapper printed as caught (see ``caught``): add it
        to that recovery and return True. The traceback ends at its exception line (a line at
        column 0), unless a chained exception follows (``The above exception ...``)."""
        key = (m.file, m.ctx)
        win = self.caught.get(key)
        if win is None:
            return False
        rec, opened, ended = win
        if ended or m.line - opened > _CAUGHT_SPAN:
            del self.caught[key]
            return False
        if len(rec.faults) < _RECOVERED_KEEP:
            rec.faults.append(m)
        win[2] = not body[:1].isspace()
        return True


def _decode(raw: bytes, state: ScanState, name: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
        note = f"{name}: not valid UTF-8; decoded as latin-1"
        if note not in state.warnings:
            state.warnings.append(note)
    return text.rstrip("\r")


def junk_fraction(head: bytes) -> float:
    """Fraction of the characters of ``head`` that are undecodable or non-printable controls.

    UTF-8 with replacement (an incomplete sequence at the end is ignored); tab, backspace,
    carriage return, form feed and ESC (ANSI colours) count as text.
    """
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(head, final=False)
    if not text:
        return 0.0
    junk = sum(1 for c in text if c == "\ufffd" or (
        (c < " " or "\x7f" <= c <= "\x9f") and c not in _TEXT_CONTROLS))
    return junk / len(text)


def _sniff(head: bytes, path: str, state: ScanState) -> None:
    frac = junk_fraction(head)
    if frac > _MAX_JUNK:
        state.non_text.append(path)
        state.warnings.append(
            f"{path}: does not look like a text log ({frac:.0%} of its first {len(head)} bytes "
            "are undecodable or non-printable); pass the text stdout/stderr of the job")


def _fact(pat: Pattern, groups: dict[str, str], ctx: LineContext, state: ScanState, pos) -> None:
    """Feed identity/checkpoint facts into the maps, keyed by the row's named groups."""
    g = {k: v for k, v in groups.items() if v is not None}
    if "world" in g:
        state.world_size = max(state.world_size or 0, int(g["world"]))
    if "ip" in g and ctx.node:
        state.ip_host.setdefault(g["ip"], ctx.node)
    if "endpoint" in g and len(state.endpoints) < 16:
        state.endpoints.add(g["endpoint"])
    _node_facts(g, state)
    if "ckpt_file" in g and len(state.ckpt_files) < _MAX_CKPT_FILES:
        state.ckpt_files.add(_norm_path(g["ckpt_file"]))
    if "record_open" in g:
        state._record_open = pos[0]
    if "record_node" in g and _in_record(pos[0], state):
        state._record_node = (pos[0][0], pos[0][1], g["record_node"])
    if "record_host" in g:
        state._record_host = g["record_host"]
    if "record_rank" in g:
        state._record_rank = int(g["record_rank"])
        if state._record_host:
            state.rank_host.setdefault(state._record_rank, state._record_host)
    if "record_exit" in g and state._record_rank is not None:
        code, rank = int(g["record_exit"]), state._record_rank
        state.exit_records.append((rank, state._record_host, code))
        pid = int(g["record_pid"]) if "record_pid" in g else None
        if pid is not None:
            state.pid_global.setdefault(pid, rank)
        if code != 0 and len(state.exits) < _MAX_EXITS:
            state.exits.append(ExitEvent(pos[0], code, pat.id, rank=rank, pid=pid,
                                         node=state._record_host))
        state._record_rank = None
    if "rank" in g:
        _rank_fact(int(g["rank"]), g, ctx, state)
    if pat.role == "checkpoint":
        step = g.get("step") or g.get("step2")
        state.last_checkpoint = (pos, int(step) if step else None)


def _in_record(at: tuple[int, int], state: ScanState) -> bool:
    """``at`` is a field of the failure record opened just before (its first field within
    ``_RECORD_SPAN`` lines): a bare ``ip: …`` line elsewhere is not a record's host."""
    opened = state._record_open
    return opened is not None and opened[0] == at[0] and 0 < at[1] - opened[1] <= _RECORD_SPAN


def _norm_path(path: str) -> str:
    """``path`` as named in a message, without quotes, trailing dots or ``./`` segments."""
    return posixpath.normpath(path.strip().strip(_PATH_TRIM))


def _in_loaded_checkpoint(groups: dict[str, str | None], state: ScanState) -> bool:
    """The row's ``path`` lies in the directory of a checkpoint file the log showed being loaded
    (or below it), and is not that file: a checkpoint that exists and was partly read misses a
    file. A missing top-level path (the file or directory the job was told to load) is not."""
    named = [v for k, v in groups.items() if k.startswith("path") and v]
    if not named or not state.ckpt_files:
        return False
    path = _norm_path(named[0])
    for f in state.ckpt_files:
        parent = posixpath.dirname(f)
        if f != path and parent not in ("", ".", "/") and path.startswith(parent + "/"):
            return True
    return False


def _node_facts(g: dict[str, str], state: ScanState) -> None:
    """Hosts named by the job's framing (``job 7 started on node-04``, submitit's
    ``hostname=``) and the node count its launcher was given (``--nnodes``, ``nnodes=``,
    submitit's ``node=0(2)``, DeepSpeed's list of workers)."""
    for k, v in g.items():
        if k.startswith("job_host") and len(state.job_hosts) < 16:
            state.job_hosts.add(v)
        elif k.startswith("nnodes"):
            state.nnodes = max(state.nnodes, int(v))
        elif k == "workers":
            state.nnodes = max(state.nnodes, len([w for w in v.split(",") if w]))


def _rank_fact(rank: int, g: dict[str, str], ctx: LineContext, state: ScanState) -> None:
    if "world" in g and ctx.node and ctx.pid is not None:
        # NCCL communicator init on host:pid; the widest communicator gives the global rank
        prev = state.pid_rank.get((ctx.node, ctx.pid))
        if prev is None or int(g["world"]) >= prev[0]:
            state.pid_rank[(ctx.node, ctx.pid)] = (int(g["world"]), rank)
        return
    if ctx.task is not None:
        state.task_ranks[ctx.task].add(rank)
    if "host" in g:
        state.rank_host.setdefault(rank, g["host"])
        if ctx.task is not None:
            state.task_host.setdefault(ctx.task, g["host"])


def _handle_line(raw: bytes, pos: tuple[int, int], reg: Registry, state: ScanState) -> None:
    text = _decode(raw, state, state.files[pos[0]])
    ctx, body = parse_prefix(text, pos[0] in state.launcher_files)
    low = body.lower()
    best: tuple[Pattern, dict] | None = None
    best_exit: tuple[Pattern, dict] | None = None
    quiet = False
    for pat in reg.patterns:
        if not any(t in low for t in pat.triggers):
            continue
        m = pat.regex.search(body)
        if m is None:
            continue
        if pat.within is not None and not _in_loaded_checkpoint(m.groupdict(), state):
            continue  # the only condition so far: "loaded_checkpoint"
        if pat.role in ("benign", "teardown"):
            quiet = True
            win = state.caught.get((pos[0], ctx))
            if pat.role == "teardown" and win is None:  # a caught traceback ends nothing
                state.last_teardown = pos
            elif win is not None and m.groupdict().get("chain"):
                win[2] = False  # a chained exception: its traceback continues
        elif pat.role == "exit":
            if best_exit is None or pat.priority > best_exit[0].priority:
                best_exit = (pat, m.groupdict())
        elif pat.role in _FAILURE_ROLES:
            if best is None or pat.priority > best[0].priority:
                best = (pat, m.groupdict())
        elif pat.role == "launcher":
            state.per_node_launcher = True
        else:
            _fact(pat, m.groupdict(), ctx, state, (pos, text[:_TEXT]))
            if pat.role == "completion":
                state.add(Match(pat, pos[0], pos[1], text[:_TEXT], ctx, ()))
                state.confirm_all()
            elif pat.role == "recovery":
                _recovery(pat, m.groupdict(), pos, (text, ctx), state)
    if ctx.rank is not None and len(state.ranks_seen) < _MAX_KEYS:
        state.ranks_seen.add(ctx.rank)
        if ctx.node is not None and ctx.pid is None:  # "[node-01] [rank3]:", Ray "ip=... [Rank 3]"
            state.rank_host.setdefault(ctx.rank, ctx.node)
    level = severity(body) if best or best_exit else "other"
    if best_exit is not None:  # a launcher's exit report counts even inside a teardown line
        _record(best_exit, pos, text, ctx, level, state)
    if best is not None and not quiet:
        _record(best, pos, text, ctx, level, state, body)


def _subject(pos: tuple[int, int], ctx: LineContext, state: ScanState) -> LineContext:
    """The context of a failure line that closes a multi-line failure record: Ray's actor record
    (``class_name:`` ... ``pid:`` ... ``ip: 10.0.0.3``) is followed by its reason ("The actor is
    dead because its node has died"), which is about the record's process on the record's host,
    not about whoever printed it (a ``(BackendExecutor pid=…, ip=…)`` prefix names the reporter).
    The first failure line after the record (within ``_RECORD_SPAN`` lines) is its reason and
    closes it.
    """
    rec = state._record_node
    if rec is None:
        return ctx
    state._record_node = None
    if rec[0] != pos[0] or not 0 < pos[1] - rec[1] <= _RECORD_SPAN:
        return ctx
    return replace(ctx, node=rec[2], pid=None)


def _record(found: tuple[Pattern, dict], pos: tuple[int, int], text: str, ctx: LineContext,
            level: str, state: ScanState, body: str = "") -> None:
    pat, groups = found
    if pat.role != "exit":
        ctx = _subject(pos, ctx, state)
    kept = tuple((k, v) for k, v in groups.items() if v is not None)
    match = Match(pat, pos[0], pos[1], text[:_TEXT], ctx, kept, level)
    if pat.role in _FAILURE_ROLES:  # stands unless an in-process restart record follows
        if not state.catch(match, body):
            state.pending.add(match)
    else:
        state.add(match)
    _side_facts(match, state)
    if pat.role == "exit":
        _exit_event(match, state)


def _recovery(pat: Pattern, groups: dict[str, str | None], pos: tuple[int, int],
              line: tuple[str, LineContext], state: ScanState) -> None:
    """An in-process restart record: what failed before it in this file was recovered from,
    and a teardown line (the fault's traceback) before it did not end the job. A record with a
    ``caught`` group (the Wrapper's "iteration N raised; restarting all ranks:" warning, the one
    line it prints at the default WARNING level) is about the traceback that follows it from the
    same printer instead."""
    text, ctx = line
    if groups.get("gave_up"):
        state.give_up(pos[0])
        return
    ranks = {int(r) for r in (groups.get("ranks") or "").replace(",", " ").split() if r.isdigit()}
    it = groups.get("iteration")
    caught = bool(groups.get("caught"))
    rec = state.recover(Recovery(pos, text[:_TEXT], pat.id, int(it) if it else None,
                                 groups.get("cause") or ("exception" if caught else None),
                                 ranks, confirmed=not caught), take_pending=not caught)
    if caught:
        state.caught[(pos[0], ctx)] = [rec, pos[1], False]
    elif state.last_teardown is not None and state.last_teardown[0] == pos[0]:
        state.last_teardown = None


def _exit_event(m: Match, state: ScanState) -> None:
    """Normalise one launcher exit line into an :class:`ExitEvent` (code 0 is no failure)."""
    g = dict(m.groups)
    if g.get("code") is not None:
        code = int(g["code"])
    elif g.get("signal"):
        code = _SIGNALS.get(g["signal"].upper(), 1)
    elif g.get("signum"):
        code = -int(g["signum"])
    else:
        code = 1  # "terminated with the following error": a Python exception
    if code == 0 or len(state.exits) >= _MAX_EXITS:
        return
    num = {k: int(g[k]) for k in ("rank", "task", "local_rank", "pid") if g.get(k)}
    if "rank" not in num and g.get("rank2"):  # a row with two wordings names the rank twice
        num["rank"] = int(g["rank2"])
    sender = g.get("sender")
    if sender is None and "outside" in g:  # the row's wording means "not the launcher"
        sender = "outside"
    state.exits.append(ExitEvent(m.order, code, m.pattern.id, num.get("rank"), num.get("task"),
                                 num.get("local_rank"), num.get("pid"),
                                 g.get("node") or m.ctx.node,
                                 None if not sender else
                                 "outside" if "outside" in sender.lower() else "launcher"))


def _side_facts(m: Match, state: ScanState) -> None:
    groups = dict(m.groups)
    if "task" in groups and "node" in groups:
        state.task_host.setdefault(int(groups["task"]), groups["node"])
    if "enqueued" in groups and m.ctx.rank is not None:
        state.enqueued[m.ctx.rank] = int(groups["enqueued"])


def _last_progress(chunk: bytes, low: bytes, lo: int, hi: int, reg: Registry):
    """(line start, step, text) of the last progress line of ``low[lo:hi]``, or None."""
    best = None
    for pp in reg.progress:
        end = hi
        for _ in range(4):  # the last few occurrences of the trigger
            i = low.rfind(pp.trigger, lo, end)
            if i < 0:
                break
            start = low.rfind(b"\n", 0, i) + 1
            stop = low.find(b"\n", i, hi)
            line = chunk[start:stop].decode("utf-8", "replace")
            m = pp.regex.search(line)
            if m and m.groupdict().get("step") and (best is None or start > best[0]):
                best = (start, int(m.group("step")), line[:_TEXT])
                break
            end = start
    return best


def _progress(chunk: bytes, low: bytes, span: tuple[int, int], end_line: int, file: int,
              reg: Registry, state: ScanState) -> None:
    """Record the last progress line of ``chunk[lo:hi]``; ``end_line`` is the line count after
    it."""
    lo, hi = span
    # the chunk's tail nearly always holds the last progress line; search it first
    best = _last_progress(chunk, low, max(lo, hi - _TAIL), hi, reg)
    if best is None and hi - lo > _TAIL:
        best = _last_progress(chunk, low, lo, hi, reg)
    if best is None:
        return
    lineno = end_line - chunk.count(b"\n", best[0], hi) + 1  # counted from the (near) end
    fact = ((file, lineno), best[1], best[2])
    state.last_progress = fact
    if state.first_progress is None:
        state.first_progress = fact


def _trigger_hits(low: bytes, lo: int, hi: int, reg: Registry) -> set[int]:
    """Start offsets of the lines of ``low[lo:hi]`` that contain a registry trigger."""
    starts: set[int] = set()
    matcher = _matcher(reg.triggers)
    if matcher is not None:  # one Aho-Corasick pass over the span (a view: no copy)
        for _, i, _ in matcher.find_matches_as_indexes(memoryview(low)[lo:hi]):
            starts.add(low.rfind(b"\n", lo, lo + i) + 1 or lo)
        return starts
    for trig in reg.triggers:  # fallback: one bytes.find pass per trigger
        i = low.find(trig, lo, hi)
        while i >= 0:
            starts.add(low.rfind(b"\n", lo, i) + 1 or lo)
            nl = low.find(b"\n", i, hi)
            i = low.find(trig, nl, hi) if nl >= 0 else -1
    return starts


@lru_cache(maxsize=8)
def _matcher(triggers: tuple[bytes, ...]):
    if _ac is None:
        return None
    # a full DFA: about twice the search speed of the default NFA for ~160 short triggers
    # (bench/attribution.py), for a few hundred KiB built once per registry
    return _ac.BytesAhoCorasick(list(triggers), matchkind=_ac.MatchKind.LeftmostFirst,
                                implementation=_ac.Implementation.DFA)


def _chunk(chunk: bytes, base: int, file: int, reg: Registry, state: ScanState,
           span: tuple[int, int] | None = None, low: bytes | None = None) -> int:
    """Scan the whole lines of ``chunk[lo:hi]`` (``span``, default all of it), which start after
    line ``base``; returns their newline count. ``low`` is ``chunk.lower()`` when the caller
    has it already."""
    lo, hi = span or (0, len(chunk))
    low = chunk.lower() if low is None else low
    line, prev = base, lo
    for start in sorted(_trigger_hits(low, lo, hi, reg)):
        line += chunk.count(b"\n", prev, start)
        prev = start
        stop = chunk.find(b"\n", start, hi)
        raw = chunk[start:stop if stop >= 0 else hi]
        _handle_line(raw[:_MAX_LINE], (file, line + 1), reg, state)
    total = line - base + chunk.count(b"\n", prev, hi)
    _progress(chunk, low, (lo, hi), base + total, file, reg, state)
    return total


def _scan_file(path: str, file: int, reg: Registry, state: ScanState) -> None:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below; we need errors from open itself
    except OSError as exc:
        raise LogInputError(f"cannot read log {path!r}: {exc.strerror or exc}") from exc
    with fh:
        head = fh.read(_SNIFF)
        if b"\x00" in head[:8192]:
            raise LogInputError(f"log {path!r} looks binary (NUL bytes in its first 8 KiB); "
                                "pass the text stdout/stderr of the job")
        if not head:
            state.warnings.append(f"{path}: empty log")
            return
        state.nonempty += 1
        _sniff(head, path, state)
        if is_launcher_log(head[:16384].decode("utf-8", "replace")):
            state.launcher_files.add(file)
        fh.seek(0)
        try:
            base = _read_blocks(_error_file(fh, head) or fh, file, reg, state)
        finally:
            state.flush_pending()
        state.lines += base


def _error_file(fh, head: bytes) -> io.BytesIO | None:
    """The traceback a torchelastic error file (``error.json``) records, as a stream to scan
    like a log (see ``_errfile``); ``None`` (``fh`` rewound) for anything else."""
    if not looks_like_error_file(head):
        return None
    raw = fh.read(MAX_ERROR_FILE_BYTES + 1)
    text = error_file_text(raw) if len(raw) <= MAX_ERROR_FILE_BYTES else None
    fh.seek(0)
    return io.BytesIO(text.encode("utf-8")) if text is not None else None


def _read_blocks(fh, file: int, reg: Registry, state: ScanState) -> int:
    """Scan ``fh`` block by block without copying the blocks: the whole lines of each block are
    scanned in place, and only a line split across two blocks is joined. Returns the line
    count."""
    base, carry = 0, b""
    while True:
        block = fh.read(_CHUNK)
        if not block:
            break
        state.bytes_read += len(block)
        first = block.find(b"\n")
        if first < 0:  # no line ends in this block
            carry += block
            if len(carry) >= _MAX_LINE:  # an endless line: scan what we have as one line
                base += _chunk(carry, base, file, reg, state)
                carry = b""
            continue
        start = 0
        if carry:  # the line that began in the previous block ends here
            base += _chunk(carry + block[:first + 1], base, file, reg, state)
            start = first + 1
        last = block.rfind(b"\n")
        if last >= start:
            base += _chunk(block, base, file, reg, state, (start, last + 1), block.lower())
        carry = block[last + 1:]
    if carry:
        base += _chunk(carry + b"\n", base, file, reg, state)
    return base


def scan_files(paths: list[str], reg: Registry) -> ScanState:
    """Scan ``paths`` in order and return the accumulated :class:`ScanState`.

    An input that cannot be read as a text log (missing, unreadable, a directory, binary) is
    skipped with a warning and listed in ``ScanState.flagged`` when another input could be read.

    Raises:
        LogInputError: no paths, or no input could be read (each missing, unreadable, a
            directory, binary or empty); the message names every one.
    """
    if not paths:
        raise LogInputError("no log files given; pass at least one path")
    state = ScanState(files=[str(p) for p in paths])
    errors: list[LogInputError] = []
    for i, path in enumerate(state.files):
        try:
            if os.path.isdir(path):
                raise LogInputError(f"{path!r} is a directory; pass the log files inside it")
            _scan_file(path, i, reg, state)
        except LogInputError as exc:  # one bad input must not lose the others' analysis
            errors.append(exc)
            state.flagged.append(path)
            state.warnings.append(f"{path}: not analysed: {exc}")
    if state.bytes_read == 0:
        if len(errors) == 1 and len(state.files) == 1:
            raise errors[0]
        if errors:
            raise LogInputError("no input could be analysed: " + "; ".join(map(str, errors)))
        raise LogInputError(f"every log is empty ({', '.join(state.files)}); nothing to analyse")
    return state
