"""Choose the primary failure by scoring evidence, and build the analysis result.

Data flows one way: scan (matches, exit reports, progress) -> :func:`resolve` (ranks and nodes,
once) -> evidence scores -> verdict. Each root, confirmation and cascade match gets a score:

* its row's strength: the tier (30 specific cause, 25 confirmation, 20 generic, 10 weak marker
  such as an abort or a bare "does not exist"), 15 for a cascade symptom;
* its severity: a line the program itself logged at INFO is weak evidence (-10), WARNING -3;
* its relation to a process exit: printed by a rank (or pid) whose own process the launcher
  reports failed, +8;
* time order: a fault after which training went on and no process failed did not stop the job
  (-25), except scheduler and node events, which end the job by definition; a cancellation
  that follows a failed process exit is the launcher's teardown, not a person's decision (-20).

Selection, first that applies:

1. strong evidence (score >= 20): the highest score, then the earliest line;
2. a completion marker with no failed exit after it: ``completed``;
3. weak evidence and cascades (0 < score < 20): the earliest, so a collective timeout with
   nothing deeper becomes the primary and an abort after it stays its teardown;
4. failed process exits reported by any launcher: the earliest, category from
   :meth:`Registry.exit_category` (its code, or who sent its signal where the launcher's record
   says it), so a job whose launcher reports a failed exit never gets ``in_progress``; a process
   only stopped (SIGTERM, 143, a signal the launcher sent itself) is not a culprit, but a log
   that reports one is not ``in_progress`` either: ``unknown``;
5. a teardown line (ChildFailedError, ActorDiedError, a step being terminated, a Python
   traceback) with no progress after it: ``unknown`` -- a job being torn down is never
   ``in_progress``;
6. progress lines, or an in-process restart record: ``in_progress`` (or ``unknown`` when the
   caller says the job ended);
7. ``unknown``.

Failure lines followed in their file by an in-process restart record (``inprocess.Wrapper``'s
``restart N -> N+1``, NVRx's nested-restarter line) never take part: the scan sets them apart as
recovered, and the result lists them (``recovered``). A run that recovered and then completed is
``completed`` with decision CONTINUE (nothing to do), not the ``completed`` policy's STOP. A
verdict that rests on a process killed by a signal names the ranks killed that way (the exit
reports' ranks, even for ``unknown``, which otherwise names no rank) and the signal.

Culprit nodes come from the primary's lines (prefixes, named groups, the host of a failure record
such as Ray's actor record). A fault on a node (a category whose decision excludes nodes) that
names no node is placed on the host of its culprit rank(s) when a launcher placed them
(torchrun's failure record), else on the job's host when the job's framing names exactly one
host and no launcher says it spans more (``job 7 started on node-04``, submitit's
``hostname=…, node=0(1)``), else on the node where every failed process exit happened (plain
``srun``: ``srun: error: node-14: task 0: Exited with exit code 1``).

When no input file looks like text (see ``_scan.junk_fraction``) the result is ``unknown`` with
confidence 0 and decision STOP: a verdict, let alone a restart, cannot rest on unreadable input.

Follows: NVRx restart-agent L0 (confirmed root over cascades, cascades folded into counts);
unlike it, position alone never decides against a fault tied to a process exit.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.attribution._outcomes import (
    describe_exit,
    exit_ranks,
    failed_exits,
    recovered,
    recovered_note,
    signal_name,
)
from trainguard.attribution._registry import Registry
from trainguard.attribution._resolve import Resolution, resolve
from trainguard.attribution._result import AnalysisResult, Cascade, Evidence
from trainguard.attribution._scan import ExitEvent, Match, ScanState

__all__ = ["build_result"]

_UNREADABLE = ("no input file looks like a text log (see warnings), so nothing could be "
               "attributed and no automatic restart should rest on it; check the log paths")
_STRONG = 20.0
_OOM_HINT = ("; a SIGKILL with no error printed is the host OOM killer's signature (a kill -9 from "
             "outside looks the same: check the node's kernel log)")
_CANCEL = "user_cancelled"
_NATIVE = "framework_crash"  # a process's own view of a device fault it cannot name


@dataclass
class _Evidence:
    """What the scores need besides the match: resolution, failed exits, last progress."""

    state: ScanState
    reg: Registry
    res: Resolution
    failed: list[ExitEvent]

    def score(self, m: Match) -> float:
        p = m.pattern
        s = 15.0 if p.role == "cascade" else float(p.tier)
        s -= {"info": 10.0, "warning": 3.0}.get(m.level, 0.0)
        rank = self.res.match_rank(m, self.state)
        if (rank is not None and rank in self.res.failed_ranks) or (
                m.ctx.pid is not None and m.ctx.pid in self.res.failed_pids):
            s += 8.0
        if self._survived(m) and not self._ends_job(p.category):
            s -= 25.0
        if p.category == _CANCEL and any(e.order < m.order for e in self.failed):
            s -= 20.0
        return s

    def _survived(self, m: Match) -> bool:
        last = self.state.last_progress
        return not self.failed and last is not None and m.order < last[0]

    def _ends_job(self, category: str | None) -> bool:
        cat = self.reg.categories.get(category or "unknown")
        return cat is not None and (not cat.ranks or category == "node_failure")


def _all(state: ScanState, roles: set[str]) -> list[Match]:
    return [m for ms in state.matches.values() for m in ms if m.pattern.role in roles]


def _select(state: ScanState, ev: _Evidence,
            job_ended: bool) -> tuple[str, list[Match], str]:
    scored = [(ev.score(m), m) for m in _all(state, {"root", "confirmation", "cascade"})]
    strong = [(s, m) for s, m in scored if s >= _STRONG and m.pattern.role != "cascade"]
    if strong:
        top = max(s for s, _ in strong)
        m = min((m for s, m in strong if s == top), key=lambda m: m.order)
        basis = "strongest evidence (severity, row strength, tie to a failed exit), earliest"
        return m.pattern.category or "unknown", [m], basis
    done = [m for m in _all(state, {"completion"})
            if not any(e.order > m.order for e in ev.failed)]
    if done:
        return "completed", [min(done, key=lambda m: m.order)], \
            "the run reports normal completion and nothing failed"
    weak = [m for s, m in scored if 0.0 < s]
    if weak:
        m = min(weak, key=lambda m: m.order)
        return m.pattern.category or "unknown", [m], "no deeper cause; earliest failure symptom"
    if ev.failed:
        first = min(ev.failed, key=lambda e: e.order)
        exits = [m for m in state.matches.get(first.source, ()) if m.order == first.order]
        sent = {"outside": ", its signal sent from outside the launcher",
                "launcher": ", its signal sent by the launcher"}.get(first.sender or "", "")
        ranks = sorted(exit_ranks(state, ev.res, ev.failed, first))
        what = describe_exit(first, ranks)
        category = ev.reg.exit_category(first.code, first.sender) or "unknown"
        hint = _OOM_HINT if category == "host_oom" and signal_name(first.code) == "SIGKILL" \
            else ""
        return category, exits[:1], (f"only a launcher's report of a failed process exit "
                                     f"({what}: code {first.code}{sent}){hint}")
    if state.exits:  # only terminations (SIGTERM): whatever ran is not running any more
        first = min(state.exits, key=lambda e: e.order)
        exits = [m for m in state.matches.get(first.source, ()) if m.order == first.order]
        return "unknown", exits[:1], (f"a launcher reports a process terminated (code "
                                      f"{first.code}) and nothing in the log says why")
    if _ends_in_teardown(state):
        return "unknown", [], ("the log ends with the job being torn down (a launcher's or "
                               "runtime's failure report) and nothing in it says why")
    if state.last_progress is not None and not job_ended:
        return "in_progress", [], "training progress is logged and nothing has failed"
    if state.recoveries:
        if not job_ended:
            return "in_progress", [], ("the job restarted in-process after its fault(s) and "
                                       "nothing has failed since")
        return "unknown", [], ("the job restarted in-process after its fault(s) and nothing has "
                               "failed since, but the log does not say it completed")
    return "unknown", [], "no failure or progress evidence in the log"


def _ends_in_teardown(state: ScanState) -> bool:
    """A teardown line (ChildFailedError, ActorDiedError, "Terminating job step") with no
    training progress after it: whatever ran has stopped, so the job is not in progress."""
    end = state.last_teardown
    return end is not None and (state.last_progress is None or state.last_progress[0] < end)


def _primary_ids(state: ScanState, category: str, chosen: list[Match]) -> list[str]:
    if chosen and chosen[0].pattern.role in ("exit", "completion"):
        return [chosen[0].pattern.id]
    roles = {"root", "confirmation"} if chosen and chosen[0].pattern.role != "cascade" \
        else {"cascade"}
    return [pid for pid, ms in state.matches.items()
            if ms and ms[0].pattern.category == category and ms[0].pattern.role in roles]


def _culprit_ranks(state: ScanState, reg: Registry, res: Resolution, failed: list[ExitEvent],
                   category: str, ids: list[str], chosen: list[Match]) -> list[int] | None:
    first = [e for e in failed if chosen and chosen[0].pattern.role == "exit"
             and e.order == chosen[0].order]
    if first and signal_name(first[0].code) is not None:
        # the verdict is a process killed by a signal: whoever was killed that way (a plain
        # non-zero exit keeps its category's rule -- peers often exit 1 after another's fault)
        ranks = exit_ranks(state, res, failed, first[0])
        if ranks or not reg.categories[category].ranks:
            return _sorted_or_none(res, ranks)
    if not reg.categories[category].ranks:
        return None
    if category == "collective_timeout":
        ranks = _laggards(state)
    else:
        ranks = res.ranks_of(ids)
        nodes = res.nodes_of(ids) if reg.categories[category].nodes else set()
        # ranks are placed on hosts when a launcher or a prefix said where a rank ran
        placed = bool(state.rank_host) or any(e.node for e in state.exits)
        if not ranks and nodes and placed:  # a node's fault names no rank: ranks failing on it
            return _sorted_or_none(res, _failed_on(state, res, failed, nodes)
                                   or _ranks_on(state, res, nodes))
        if not ranks and reg.categories[category].nodes:  # unplaced: a rank's native crash
            ranks = _native_crash_ranks(state, res)
        if not ranks:  # the fault line names nobody: the processes the launchers saw fail
            ranks = set(res.failed_ranks)
    return _sorted_or_none(res, ranks)


def _sorted_or_none(res: Resolution, ranks: set[int]) -> list[int] | None:
    if not ranks or res.is_everyone(ranks):
        return None
    return sorted(ranks)


def _failed_on(state: ScanState, res: Resolution, failed: list[ExitEvent],
               nodes: set[str]) -> set[int]:
    """Ranks whose own process a launcher reports failed (in ``failed``) on one of ``nodes``."""
    return {r for e, r in zip(state.exits, res.exit_ranks) if r is not None
            and e in failed and e.node is not None and e.node in nodes}


def _native_crash_ranks(state: ScanState, res: Resolution) -> set[int]:
    """Ranks that printed a native crash (a CUDA or native error line): how a rank sees a
    device fault that the driver reports without naming the rank (Xid, ECC, off the bus)."""
    return {r for pid, ms in state.matches.items() if ms and ms[0].pattern.role == "root"
            and ms[0].pattern.category == _NATIVE for r in res.ranks.get(pid, ())}


def _ranks_on(state: ScanState, res: Resolution, nodes: set[str]) -> set[int]:
    """Ranks on ``nodes`` that printed any failure line (root, confirmation or cascade)."""
    failing = {r for pid, ms in state.matches.items() if ms and ms[0].pattern.role in
               ("root", "confirmation", "cascade") for r in res.ranks.get(pid, ())}
    return {r for r in failing if state.rank_host.get(r) in nodes}


def _named_hosts(state: ScanState, res: Resolution) -> set[str]:
    """Every host the log names: the job's framing, ranks' and tasks' hosts, process exits and
    the resolved culprit nodes."""
    named = set(state.job_hosts) | set(state.rank_host.values()) | \
        set(state.task_host.values()) | {e.node for e in state.exits if e.node}
    return named | (set().union(*res.nodes.values()) if res.nodes else set())


def _only_host(state: ScanState, res: Resolution) -> list[str]:
    """The host a single-node job ran on, when its framing names it (``job 7 started on
    node-04``, submitit's ``hostname=``), no launcher says the job spans more nodes, and no line
    names any other host; else nothing. A fault on a node (a GPU, the node itself) that the
    fault line does not place happened there."""
    if not state.job_hosts or state.nnodes > 1:
        return []
    named = _named_hosts(state, res)
    return sorted(named) if len(named) == 1 else []


def _failed_exit_host(state: ScanState, res: Resolution, failed: list[ExitEvent]) -> list[str]:
    """The node of the failed process exits, when every one names the same node and the log
    names no other host (plain ``srun``: ``srun: error: node-14: task 0: Exited with exit code
    1``): a node fault whose line names neither rank nor node happened where the process failed.
    Nothing when an exit names no node, the exits span several nodes, or any other host (the
    job's framing, a rank's host) or more than one node is named."""
    nodes = {e.node for e in failed}
    node = nodes.pop() if len(nodes) == 1 else None
    if node is None or state.nnodes > 1:
        return []
    named = _named_hosts(state, res)
    return [node] if named <= {node} else []


def _hosts_of(state: ScanState, ranks: list[int] | None) -> list[str]:
    """The hosts the culprit ``ranks`` ran on, when a launcher placed every one of them
    (torchrun's failure record ``host : node-03`` / ``rank : 1``, a ``[node-01] [rank3]:``
    prefix): a fault on a node whose line names only the rank (``RuntimeError: CUDA error:
    uncorrectable ECC error encountered``) happened on the culprit rank's host."""
    if not ranks or any(r not in state.rank_host for r in ranks):
        return []
    return sorted({state.rank_host[r] for r in ranks})


def _culprit_hosts(state: ScanState, res: Resolution, ranks: list[int] | None,
                   failed: list[ExitEvent]) -> list[str] | None:
    """Where the failure happened, as the launchers placed it (not a verdict against a host):
    the hosts of the culprit ``ranks`` when every one is placed (torchrun's failure record
    ``host : node-03`` / ``rank : 1``); else the hosts the launchers' failed-exit reports name
    (the same record, ``trainguard launch``'s ``node07:launcher:`` lines), of the culprit ranks'
    exits when ranks are named; else nothing."""
    if ranks and _hosts_of(state, ranks):
        return _hosts_of(state, ranks)
    return sorted({e.node for e, r in zip(state.exits, res.exit_ranks) if e.node and e in failed
                   and (not ranks or r in ranks)}) or None


def _laggards(state: ScanState) -> set[int]:
    """Ranks behind their peers: a lower last-enqueued collective, or named by gloo."""
    named = {int(v) for ms in state.matches.values() for m in ms for k, v in m.groups
             if k == "laggard"}
    if len(state.enqueued) < 2:
        return named
    top = max(state.enqueued.values())
    return named | {r for r, e in state.enqueued.items() if e < top}


def _cascades(state: ScanState, res: Resolution, primary: str,
              culprits: list[int] | None) -> list[Cascade]:
    """Secondary symptoms in *other* ranks (a culprit's own teardown is not a cascade)."""
    out: dict[str, Cascade] = {}
    for pid, ms in state.matches.items():
        if not ms or ms[0].pattern.role != "cascade" or ms[0].pattern.category == primary:
            continue
        ranks = res.ranks.get(pid, set())
        if culprits and not ranks - set(culprits):
            continue
        cat = ms[0].pattern.category or "unknown"
        c = out.setdefault(cat, Cascade(cat, 0, set(), set(), ms[0]))
        c.count += state.counts[pid]
        c.ranks |= ranks
        c.nodes |= res.nodes.get(pid, set())
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
    res = resolve(state, reg)
    failed = [e for e in state.exits if reg.exit_category(e.code, e.sender) is not None]
    unreadable = bool(state.non_text) and len(state.non_text) == state.nonempty
    chosen: list[Match]
    if unreadable:  # matches in binary data are noise; nothing can be attributed
        category, chosen, basis = "unknown", [], _UNREADABLE
    else:
        category, chosen, basis = _select(state, _Evidence(state, reg, res, failed), job_ended)
    cat = reg.categories[category]
    domain = chosen[0].pattern.domain if chosen and chosen[0].pattern.domain else cat.domain
    ids = _primary_ids(state, category, chosen)
    ranks = _culprit_ranks(state, reg, res, failed, category, ids, chosen)
    nodes = sorted(res.nodes_of(ids)) if cat.nodes else []
    if cat.nodes and not nodes and chosen and chosen[0].pattern.domain == "unknown":
        nodes = sorted(state.endpoints)  # an unreachable store the error line does not name
    if cat.decision == "RESTART_EXCLUDE_NODES" and not nodes:
        # a fault on a node: on its culprit ranks' hosts, else on a single-host job's host,
        # else on the one node where the launcher saw processes fail
        nodes = _hosts_of(state, ranks) or _only_host(state, res) \
            or _failed_exit_host(state, res, failed)
    decision = "STOP" if unreadable else cat.decision
    if decision == "RESTART_EXCLUDE_NODES" and not nodes:
        decision = "RESTART"  # a hardware fault we cannot place: plain bounded restart
    fixed, decision, basis = _after_recovery(state, res, category, decision, basis)
    flagged = list(state.flagged) + [f for f in state.non_text if f not in state.flagged]
    if flagged and not unreadable:  # README: input that is not a text log gets STOP
        decision = "STOP"
        basis += (f"; STOP because {len(flagged)} input(s) could not be read as a text log "
                  f"({', '.join(flagged)}): no automatic decision rests on partly unreadable "
                  "input -- remove or replace them and analyse again")
    cascades = _cascades(state, res, category, ranks)
    return AnalysisResult(
        primary_category=category, failure_domain=domain, culprit_ranks=ranks,
        culprit_nodes=nodes or None, cascades=cascades, decision=decision, basis=basis,
        evidence=_evidence(state, ids, cascades),
        confidence=0 if unreadable else _confidence(chosen, category, ids),
        fingerprint=f"{category}:{chosen[0].pattern.id}" if chosen else
        f"{category}:unreadable" if unreadable else category,
        last_step=state.last_progress[1] if state.last_progress else None,
        last_checkpoint_step=state.last_checkpoint[1] if state.last_checkpoint else None,
        checkpoint_saved=state.last_checkpoint is not None,
        files=list(state.files), warnings=list(state.warnings), flagged_inputs=flagged,
        bytes_read=state.bytes_read, lines=state.lines,
        culprit_hosts=_culprit_hosts(state, res, ranks, failed),
        failed_exits=failed_exits(state, res, reg), recovered=fixed)


def _after_recovery(state: ScanState, res: Resolution, category: str, decision: str,
                    basis: str) -> tuple[list[dict], str, str]:
    """The faults an in-process restart recovered from (reported, never the primary), and the
    decision: a run that restarted in-process and then completed is ``completed`` like any
    finished run (STOP: there is nothing left to do, per the logs README), its basis saying
    that the faults were recovered, so the STOP never reads as "the fault is fatal"."""
    fixed = recovered(state, res)
    if not fixed:
        return fixed, decision, basis
    basis += "; " + recovered_note(fixed, state.recovery_count)
    if category == "completed":
        basis += " -- the wrapped call then completed: nothing left to do"
    return fixed, decision, basis
    basis += "; " + recovered_note(fixed, state.recovery_count)
    if category == "completed" and decision == "STOP":
        decision = "CONTINUE"
        basis += " -- the wrapped call then completed, so nothing needs doing"
    return fixed, decision, basis
