"""Flight-recorder analysis: which ranks never joined, which joined but never completed.

Two verdicts per process group (PG), matched across ranks by the PG's global name:

* **counters** (``pg_status``): a member whose ``last_enqueued`` is below the group's maximum
  never joined a collective its peers issued (a hung CPU thread, e.g. a held GIL); a member whose
  ``last_completed`` is below a peer's although it enqueued that collective joined but never saw
  it complete (its GPU stopped, e.g. a GPU error). NVRx's analyzer only checks the first kind and
  misses GPU-faulted ranks that keep enqueuing work.
* **entries** (torchfrtrace-style): entries with the same ``collective_seq_id`` must agree on op
  type, dtypes and, for ops that require it, sizes.

Counters of PGs that carry point-to-point traffic are not comparable (pipeline stages send
different numbers of messages), so those PGs are judged by send/recv peers instead: a peer that
is awaited but has no pending work at all is missing.

Follows: NVRx ``CollectiveAnalyzer`` (pg_status wavefront) and PyTorch ``torchfrtrace`` matching.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainguard.attribution._fr_load import load_dumps

__all__ = ["FlightRecorderReport", "analyze_flight_recorder"]

_PEER = re.compile(r"(\d+)\s*(?:->|<-)\s*(\d+)")
_SIZE_MUST_MATCH = ("all_reduce", "broadcast", "reduce", "_all_gather_base", "all_gather",
                    "_reduce_scatter_base", "reduce_scatter", "allreduce")


@dataclass
class FlightRecorderReport:
    """Verdict over one job's dumps; all ranks are global ranks."""

    ranks: list[int]
    faulty_ranks: list[int]
    missing_ranks: list[int]
    incomplete_ranks: list[int]
    no_dump_ranks: list[int]
    mismatches: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    first_stuck: dict[str, Any] | None
    version: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["process_group"] = self.first_stuck["pg_desc"] if self.first_stuck else None
        return out


def _members(cfg: dict) -> list[int]:
    ranks = cfg.get("ranks", [])
    if isinstance(ranks, str):
        try:
            ranks = ast.literal_eval(ranks)
        except (ValueError, SyntaxError):
            return []
    return [int(r) for r in ranks] if isinstance(ranks, (list, tuple)) else []


def _is_p2p(entry: dict) -> bool:
    return bool(entry.get("is_p2p")) or any(
        k in str(entry.get("profiling_name", "")) for k in ("send", "recv"))


def _pg_index(dumps: dict[int, dict]):
    """status[pg][rank] = (enqueued, completed); members[pg] = (desc, ranks); p2p pg names."""
    status: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    members: dict[str, tuple[str, list[int]]] = {}
    p2p: set[str] = set()
    notes = []
    for rank, dump in dumps.items():
        ids = {str(e.get("pg_id")): str(e["process_group"][0]) for e in dump["entries"]}
        p2p |= {str(e["process_group"][0]) for e in dump["entries"] if _is_p2p(e)}
        names, keys = list(dump["pg_config"]), list(dump.get("pg_status", {}))
        if all(n.isdigit() for n in names) and all(k.isdigit() for k in keys) \
                and len(names) == len(keys):
            # both number PGs in creation order: align them where entries do not say
            for k, n in zip(sorted(keys, key=int), sorted(names, key=int)):
                ids.setdefault(k, n)
        elif keys:
            notes.append(f"rank {rank}: pg_status ids not all mappable to PG names")
        for key, st in dump.get("pg_status", {}).items():
            if key in ids and isinstance(st, dict):
                status[ids[key]][rank] = (int(st.get("last_enqueued_collective", -1)),
                                          int(st.get("last_completed_collective", -1)))
        for name, cfg in dump["pg_config"].items():
            if isinstance(cfg, dict):
                members[str(name)] = (str(cfg.get("desc", "")), _members(cfg))
    return status, members, p2p, notes


def _judge_counters(status, members, p2p) -> list[dict[str, Any]]:
    groups = []
    for name in sorted(status, key=lambda n: (len(n), n)):
        st = status[name]
        desc, ranks = members.get(name, ("", sorted(st)))
        if name in p2p or len(st) < 2:
            continue
        max_enq = max(e for e, _ in st.values())
        max_comp = max(c for _, c in st.values())
        missing = sorted(r for r, (e, _) in st.items() if e < max_enq)
        incomplete = sorted(r for r, (e, c) in st.items() if c < min(e, max_comp))
        if missing or incomplete:
            groups.append({"pg_name": name, "pg_desc": desc, "ranks": ranks,
                           "missing": missing, "incomplete": incomplete,
                           "stuck_seq": min(c for _, c in st.values()) + 1,
                           "status": {r: list(v) for r, v in sorted(st.items())}})
    return groups


def _judge_p2p(dumps: dict[int, dict], members) -> dict[int, list[str]]:
    idle = {r for r, d in dumps.items() if not d["entries"]}
    awaited: dict[int, list[str]] = defaultdict(list)
    for dump in dumps.values():
        for e in dump["entries"]:
            if not _is_p2p(e):
                continue
            name = str(e["process_group"][0])
            ranks = members.get(name, ("", []))[1]
            m = _PEER.search(str(e.get("profiling_name", "")))
            if not m or not ranks:
                continue
            for local in (int(m.group(1)), int(m.group(2))):
                if local < len(ranks) and ranks[local] in idle:
                    awaited[ranks[local]].append(name)
    return awaited


def _mismatches(dumps: dict[int, dict]) -> list[dict[str, Any]]:
    by_seq: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for rank, dump in dumps.items():
        for e in dump["entries"]:
            if not _is_p2p(e) and e.get("collective_seq_id") is not None:
                by_seq[(str(e["process_group"][0]), int(e["collective_seq_id"]))][rank] = e
    out = []
    for (pg, seq), per_rank in sorted(by_seq.items()):
        if len(per_rank) < 2:
            continue
        checks = [("op_type", "profiling_name"), ("input_dtypes", "input_dtypes"),
                  ("output_dtypes", "output_dtypes")]
        op = str(next(iter(per_rank.values())).get("profiling_name", ""))
        if op.split(":")[-1] in _SIZE_MUST_MATCH:
            checks.append(("input_sizes", "input_sizes"))
        for kind, key in checks:
            values = {r: e.get(key) for r, e in sorted(per_rank.items())}
            if len({repr(v) for v in values.values()}) > 1:
                out.append({"pg_name": pg, "collective_seq_id": seq, "kind": kind,
                            "values": {r: v for r, v in values.items()}})
                break
    return out


def _first_stuck(dumps, groups, members) -> dict[str, Any] | None:
    best = None
    for g in groups:
        for rank, dump in dumps.items():
            for e in dump["entries"]:
                if str(e["process_group"][0]) == g["pg_name"] and \
                        e.get("collective_seq_id") == g["stuck_seq"]:
                    key = (e.get("time_created_ns") or 0, rank)
                    if best is None or key < best[0]:
                        best = (key, g, e)
    if best is None:
        if not groups:
            return None
        g = groups[0]
        return {"pg_name": g["pg_name"], "pg_desc": g["pg_desc"], "collective_seq_id":
                g["stuck_seq"], "op": None, "input_sizes": None, "input_dtypes": None,
                "ranks": g["ranks"]}
    _, g, e = best
    return {"pg_name": g["pg_name"], "pg_desc": g["pg_desc"], "collective_seq_id": g["stuck_seq"],
            "op": e.get("profiling_name"), "input_sizes": e.get("input_sizes"),
            "input_dtypes": e.get("input_dtypes"), "ranks": members[g["pg_name"]][1]
            if g["pg_name"] in members else g["ranks"]}


def analyze_flight_recorder(path: str, within: list[str] | None = None) -> FlightRecorderReport:
    """Analyse one job's flight-recorder dumps (directory, file prefix, or single file).

    ``within``: real directories the dumps must resolve into (used by the service).

    Raises:
        FlightRecorderError: no dumps, an unsafe or malformed dump, or dumps of different jobs.
    """
    dumps = load_dumps(path, within)
    status, members, p2p, notes = _pg_index(dumps)
    groups = _judge_counters(status, members, p2p)
    awaited = _judge_p2p(dumps, members)
    missing = {r for g in groups for r in g["missing"]} | set(awaited)
    incomplete = {r for g in groups for r in g["incomplete"]}
    world = max((len(r) for _, r in members.values()), default=0)
    no_dump = sorted(set(range(world)) - set(dumps)) if world else []
    version = next(iter(dumps.values())).get("version")
    return FlightRecorderReport(
        ranks=sorted(dumps), faulty_ranks=sorted(missing | incomplete | set(no_dump)),
        missing_ranks=sorted(missing), incomplete_ranks=sorted(incomplete),
        no_dump_ranks=no_dump, mismatches=_mismatches(dumps), groups=groups,
        first_stuck=_first_stuck(dumps, groups, members),
        version=str(version) if version is not None else None, notes=notes)
