"""Choose the primary failure deterministically and build the analysis result.

Selection order (first that applies):

1. decisive root candidates (tier >= 20): the highest tier, then the earliest line;
2. a completion marker: ``completed``;
3. weak roots (cancellation, C++ terminate) and cascades (watchdog timeouts, peer errors): the
   earliest, so a collective timeout with nothing deeper becomes the primary;
4. launcher exit records (exit code/signal only): the earliest;
5. progress lines: ``in_progress`` (or ``unknown`` when the caller says the job ended);
6. ``unknown``.

When no input file looks like text (see ``_scan.junk_fraction``) the result is ``unknown`` with
confidence 0 and decision STOP: a verdict, let alone a restart, cannot rest on unreadable input.

Follows: NVRx restart-agent L0 (earliest confirmed root, cascades folded into counts).
"""

from __future__ import annotations

from trainguard.attribution._registry import Registry
from trainguard.attribution._resolve import nodes_of, ranks_of
from trainguard.attribution._result import AnalysisResult, Cascade, Evidence
from trainguard.attribution._scan import Match, ScanState

__all__ = ["build_result"]

_UNREADABLE = ("no input file looks like a text log (see warnings), so nothing could be "
               "attributed and no automatic restart should rest on it; check the log paths")

def _first(state: ScanState, roles: set[str], pred=lambda p: True) -> list[Match]:
    out = []
    for ms in state.matches.values():
        if ms and ms[0].pattern.role in roles and pred(ms[0].pattern):
            out.append(ms[0])
    return out


def _select(state: ScanState, reg: Registry, job_ended: bool) -> tuple[str, list[Match], str]:
    decisive = _first(state, {"root", "confirmation"}, lambda p: p.tier >= 20)
    if decisive:
        top = max(m.pattern.tier for m in decisive)
        m = min((m for m in decisive if m.pattern.tier == top), key=lambda m: m.order)
        return m.pattern.category or "unknown", [m], "earliest root candidate of the highest tier"
    done = _first(state, {"completion"})
    if done:
        return "completed", done, "the run reports normal completion and nothing failed"
    weak = _first(state, {"root", "confirmation", "cascade"})
    if weak:
        m = min(weak, key=lambda m: m.order)
        return m.pattern.category or "unknown", [m], "no deeper cause; earliest failure symptom"
    exits = _first(state, {"exit"})
    if exits:
        m = min(exits, key=lambda m: m.order)
        code = int(dict(m.groups).get("code", 0))
        return reg.exit_codes.get(code, "unknown"), [m], "only a launcher exit record"
    if state.last_progress is not None and not job_ended:
        return "in_progress", [], "training progress is logged and nothing has failed"
    return "unknown", [], "no failure or progress evidence in the log"


def _primary_ids(state: ScanState, category: str, chosen: list[Match]) -> list[str]:
    if chosen and chosen[0].pattern.role in ("exit", "completion"):
        return [chosen[0].pattern.id]
    cascade_only = not chosen or chosen[0].pattern.role == "cascade"
    roles = {"cascade"} if cascade_only else {"root", "confirmation"}
    return [pid for pid, ms in state.matches.items()
            if ms and ms[0].pattern.category == category and ms[0].pattern.role in roles]


def _culprit_ranks(state: ScanState, reg: Registry, category: str, ids: list[str]) -> list | None:
    if not reg.categories[category].ranks:
        return None
    ranks = ranks_of(state, ids)
    if category == "collective_timeout":
        ranks = _laggards(state)
    elif not ranks and reg.categories[category].domain == "workload":
        # torchrun record: a rank that exited with its own error code (not a signal) raised it
        ranks = {r for r, _, code in state.exit_records if code > 0}
    if not ranks:
        return None
    everyone = set(range(state.world_size)) if state.world_size else set()
    if everyone and everyone <= ranks:
        return None
    return sorted(ranks)


def _laggards(state: ScanState) -> set[int]:
    """Ranks whose last enqueued collective is behind their peers' (they never joined)."""
    if len(state.enqueued) < 2:
        return set()
    top = max(state.enqueued.values())
    return {r for r, e in state.enqueued.items() if e < top}


def _cascades(state: ScanState, primary: str, culprits: list[int] | None) -> list[Cascade]:
    """Secondary symptoms in *other* ranks (a culprit's own teardown is not a cascade)."""
    out: dict[str, Cascade] = {}
    for pid, ms in state.matches.items():
        if not ms or ms[0].pattern.role != "cascade" or ms[0].pattern.category == primary:
            continue
        if culprits and not ranks_of(state, [pid]) - set(culprits):
            continue
        cat = ms[0].pattern.category or "unknown"
        c = out.setdefault(cat, Cascade(cat, 0, set(), set(), ms[0]))
        c.count += state.counts[pid]
        c.ranks |= ranks_of(state, [pid])
        c.nodes |= nodes_of(state, [pid])
        if ms[0].order < c.first.order:
            c.first = ms[0]
    return [out[k] for k in sorted(out)]


def _evidence(state: ScanState, ids: list[str], cascades: list[Cascade]) -> list[Evidence]:
    prim = sorted((m for pid in ids for m in state.matches.get(pid, ())), key=lambda m: m.order)
    ev = [Evidence.of(m, state.files) for m in prim[:5]]
    ev += [Evidence.of(c.first, state.files) for c in cascades]
    return ev


def _confidence(chosen: list[Match], category: str, ids: list[str]) -> int:
    if not chosen:
        return 60 if category == "in_progress" else 20
    tier = chosen[0].pattern.tier
    role = chosen[0].pattern.role
    base = {"completion": 90, "exit": 35, "cascade": 50}.get(role, 0) or (
        90 if tier >= 30 else 80 if tier >= 25 else 70 if tier >= 20 else 45)
    return min(99, base + 3 * (len(ids) - 1))


def build_result(state: ScanState, reg: Registry, job_ended: bool = False) -> AnalysisResult:
    """Turn a finished scan into an :class:`AnalysisResult` (decision from category policy)."""
    unreadable = bool(state.non_text) and len(state.non_text) == state.nonempty
    chosen: list[Match]
    if unreadable:  # matches in binary data are noise; nothing can be attributed
        category, chosen, basis = "unknown", [], _UNREADABLE
    else:
        category, chosen, basis = _select(state, reg, job_ended)
    cat = reg.categories[category]
    ids = _primary_ids(state, category, chosen)
    ranks = _culprit_ranks(state, reg, category, ids)
    nodes = sorted(nodes_of(state, ids)) if cat.nodes else []
    decision = "STOP" if unreadable else cat.decision
    if decision == "RESTART_EXCLUDE_NODES" and not nodes:
        decision = "RESTART"  # a hardware fault we cannot place: plain bounded restart
    cascades = _cascades(state, category, ranks)
    return AnalysisResult(
        primary_category=category, failure_domain=cat.domain, culprit_ranks=ranks,
        culprit_nodes=nodes or None, cascades=cascades, decision=decision, basis=basis,
        evidence=_evidence(state, ids, cascades),
        confidence=0 if unreadable else _confidence(chosen, category, ids),
        fingerprint=f"{category}:{chosen[0].pattern.id}" if chosen else
        f"{category}:unreadable" if unreadable else category,
        last_step=state.last_progress[1] if state.last_progress else None,
        last_checkpoint_step=state.last_checkpoint[1] if state.last_checkpoint else None,
        checkpoint_saved=state.last_checkpoint is not None,
        files=list(state.files), warnings=list(state.warnings),
        bytes_read=state.bytes_read, lines=state.lines)
