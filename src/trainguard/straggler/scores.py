"""Scoring window summaries: relative to the median rank, individual against a rolling baseline.

Pure functions of the summaries plus per-rank state; runs on the aggregator (a background thread
of rank 0 by default, or any process that reads the transport). Never blocks, never communicates.

Rules, per window after warm-up (``work`` = compute + data-loader wait, window medians in ms):

* relative: ``ratio = work / median over ranks(work)``; a window is *above* when
  ``ratio > ratio_threshold`` and ``work - median > floor`` (``floor = max(floor_ms, floor_pct %
  of the median step)``), *below* when ``ratio < clear_ratio`` or the gap is under the floor.
  ``consecutive`` windows above flag the rank; ``clear_windows`` windows below clear it
  (hysteresis: the band in between holds the state);
* individual: the same test of ``work`` against the median of the rank's last
  ``baseline_windows`` unflagged windows (a rolling baseline, not the historical minimum), unless
  the median rank changed as much (a job-wide change such as machine load is not a straggler);
* communication: the step slowed against its own baseline while work did not and the collectives
  themselves got slower: the *smallest* wait over ranks (the last arriver's, i.e. the transfer
  without waiting for peers) grew by more than the floor and to more than twice
  ``ratio_threshold`` times its baseline, while work stayed under ``clear_ratio`` times its own; a
  compute straggler makes the others wait longer but not the
  last arriver; reported only while no rank is relatively slow (that would explain the waits);
* kind: ``data`` when the data-loader excess dominates, ``node`` when every rank of a node with
  two or more ranks is flagged (and not every rank of the job), ``imbalance`` when the rank has
  been above since the first scored window, else ``compute``;
* cost: ``est_loss_ms = work - median(work)``, ``est_loss_pct`` = that over the median step;
* reported: a flagged rank appears in ``Report.stragglers`` only for a window whose own figures
  (the displayed ``ratio`` and cost) pass the hold test, ``ratio >= clear_ratio`` and
  ``work - median > floor``: a reported straggler always costs more than ``floor_pct`` % (and
  ``floor_ms``) of the median step. A flag held by hysteresis over a window back at ~1.0x stays
  in the state (and its ``cleared`` event still comes after ``clear_windows``) but is not shown.

Follows: launcher-research.md §C5 (GREYHOUND-style change points, ByteDance what-if cost).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from trainguard.straggler._stats import median
from trainguard.straggler.errors import StragglerConfigError
from trainguard.straggler.report import Report, StragglerInfo

__all__ = ["Scorer", "ScoringConfig"]

_NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class ScoringConfig:
    """Thresholds of the scorer (ratios are slow/typical, times in ms).

    Raises:
        StragglerConfigError: a value out of range, or ``clear_ratio > ratio_threshold``.
    """

    ratio_threshold: float = 1.2
    clear_ratio: float = 1.1
    floor_ms: float = 2.0
    floor_pct: float = 2.0
    consecutive: int = 3
    clear_windows: int = 2
    warmup_windows: int = 2
    baseline_windows: int = 8
    exclude_ratio: float = 1.5
    exclude_windows: int = 10

    def __post_init__(self) -> None:
        if not self.ratio_threshold > 1.0:
            raise StragglerConfigError(
                f"ratio_threshold must be > 1.0 (slow/typical), got {self.ratio_threshold}; "
                "e.g. 1.2 flags a rank 20 % slower than the median rank")
        if not 1.0 <= self.clear_ratio <= self.ratio_threshold:
            raise StragglerConfigError(
                f"clear_ratio must be in [1.0, ratio_threshold={self.ratio_threshold}], got "
                f"{self.clear_ratio}")
        for name in ("floor_ms", "floor_pct", "warmup_windows"):
            if getattr(self, name) < 0:
                raise StragglerConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("consecutive", "clear_windows", "baseline_windows", "exclude_windows"):
            if getattr(self, name) < 1:
                raise StragglerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.exclude_ratio < self.ratio_threshold:
            raise StragglerConfigError(
                f"exclude_ratio ({self.exclude_ratio}) must be >= ratio_threshold "
                f"({self.ratio_threshold})")


class _Hysteresis:
    """k windows above to turn on, m windows below to turn off; the band between holds."""

    __slots__ = ("above", "below", "on", "windows_on")

    def __init__(self) -> None:
        self.above = self.below = self.windows_on = 0
        self.on = False

    def update(self, is_above: bool, is_below: bool, k: int, m: int) -> str | None:
        if is_above:
            self.above, self.below = self.above + 1, 0
        elif is_below:
            self.above, self.below = 0, self.below + 1
        else:
            self.above = 0
        event = None
        if not self.on and self.above >= k:
            self.on, self.windows_on, event = True, 0, "flagged"
        elif self.on and self.below >= m:
            self.on, event = False, "cleared"
        if self.on:
            self.windows_on += 1
        return event


@dataclasses.dataclass
class _RankState:
    rel: _Hysteresis = dataclasses.field(default_factory=_Hysteresis)
    ind: _Hysteresis = dataclasses.field(default_factory=_Hysteresis)
    comm: _Hysteresis = dataclasses.field(default_factory=_Hysteresis)
    base_work: collections.deque = dataclasses.field(default_factory=collections.deque)
    base_step: collections.deque = dataclasses.field(default_factory=collections.deque)
    base_wait: collections.deque = dataclasses.field(default_factory=collections.deque)
    base_sections: dict[str, collections.deque] = dataclasses.field(default_factory=dict)
    above_since_start: bool = True
    exclude_run: int = 0


def _metric(summary: dict[str, Any], name: str) -> float:
    value = summary.get("metrics", {}).get(name)
    return float(value[0]) if value and value[0] is not None else _NAN


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else _NAN


class Scorer:
    """Stateful scorer of consecutive windows; one instance per aggregator, one thread."""

    def __init__(self, config: ScoringConfig, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.rank_to_node: dict[int, str] = {}
        self._state: dict[int, _RankState] = collections.defaultdict(_RankState)
        self._excluded_nodes: set[str] = set()

    def floor(self, step_ms: float) -> float:
        pct = self.config.floor_pct / 100.0 * step_ms if math.isfinite(step_ms) else 0.0
        return max(self.config.floor_ms, pct)

    def score(self, window: int, summaries: dict[int, dict[str, Any]], rank: int = 0,
              gather_on_rank0: bool = True) -> Report:
        """Score ``window`` from the summaries that arrived; missing ranks are reported."""
        warnings: list[str] = []
        missing = tuple(r for r in range(self.world_size) if r not in summaries)
        if missing:
            warnings.append(f"window {window}: no summary from rank(s) {list(missing)} "
                            "(hung, dead or late); scored the others")
        per_rank = self._per_rank(window, summaries, warnings)
        for r, s in summaries.items():
            self.rank_to_node.setdefault(r, str(s.get("node", "?")))
        ref = {m: median([v[m] for v in per_rank.values()])
               for m in ("work", "step", "compute", "data", "wait")}
        # the last arriver's wait is the collective's own duration (no waiting for peers)
        ref["wait_min"] = min((v["wait"] for v in per_rank.values()), default=_NAN)
        floor = self.floor(ref["step"])
        warm = window < self.config.warmup_windows
        events: list[dict[str, Any]] = []
        rel_scores, ind_scores = {}, {}
        # a change every rank shares (machine load, an eval step) is not a per-rank change point
        ref["job_individual_ratio"] = median([
            _ratio(v["work"], median(self._state[r].base_work)) for r, v in per_rank.items()])
        for r, v in per_rank.items():
            v["ratio"] = _ratio(v["work"], ref["work"])
            v["lateness_ms"] = max(x["wait"] for x in per_rank.values()) - v["wait"]
            v["wait_min"] = ref["wait_min"]
            rel_scores[r] = _ratio(ref["work"], v["work"])
            ind_scores[r] = self._update_rank(window, r, v, ref, floor, warm, events)
        sec_rel, sec_ind = self._section_scores(summaries, warm)
        stragglers = () if warm else self._stragglers(per_rank, ref, sec_rel)
        return Report(
            window=window, steps=int(max((v["steps"] for v in per_rank.values()), default=0)),
            step_ms_median=ref["step"], stragglers=stragglers, per_rank=per_rank,
            missing_ranks=missing, warnings=tuple(warnings), events=tuple(events), warmup=warm,
            rank_relative_perf_scores=rel_scores, rank_individual_perf_scores=ind_scores,
            section_relative_perf_scores=sec_rel, section_individual_perf_scores=sec_ind,
            rank_to_node=dict(self.rank_to_node),
            local_section_summaries=_local_sections(summaries.get(rank)),
            gather_on_rank0=gather_on_rank0, rank=rank)

    def _per_rank(self, window: int, summaries: dict[int, dict[str, Any]],
                  warnings: list[str]) -> dict[int, dict[str, float]]:
        per_rank: dict[int, dict[str, float]] = {}
        for r in sorted(summaries):
            s = summaries[r]
            v = {m: _metric(s, m) for m in ("step", "compute", "wait", "data")}
            steps = int(s.get("steps", 0))
            if steps == 0 or not all(math.isfinite(x) for x in v.values()):
                warnings.append(f"window {window}: rank {r} sent an empty or NaN window "
                                f"({steps} steps): it cannot be scored; check that "
                                "Detector.step() (or generate_report_if_interval_elapsed) runs "
                                "every step")
                continue
            v["work"] = v["compute"] + v["data"]
            v["steps"] = steps
            per_rank[r] = v
        if not per_rank:
            warnings.append(f"window {window}: no usable data from any rank: cannot tell "
                            "whether there are stragglers")
        return per_rank

    def _update_rank(self, window: int, r: int, v: dict[str, float], ref: dict[str, float],
                     floor: float, warm: bool, events: list[dict[str, Any]]) -> float:
        cfg, st = self.config, self._state[r]
        base = {k: median(st_q) for k, st_q in
                (("work", st.base_work), ("step", st.base_step), ("wait", st.base_wait))}
        ind_ratio = _ratio(v["work"], base["work"])
        v["individual_ratio"] = ind_ratio
        if warm:
            self._push_baseline(st, v)
            return _ratio(base["work"], v["work"])
        gap = v["work"] - ref["work"]
        above = v["ratio"] > cfg.ratio_threshold and gap > floor
        below = not above and (v["ratio"] < cfg.clear_ratio or gap <= floor)
        st.above_since_start = st.above_since_start and above
        node = self.rank_to_node.get(r, "?")
        for name, hyst, a, b in (
            ("relative", st.rel, above, below),
            ("individual", st.ind, *self._ind_test(ind_ratio, v["work"] - base["work"], floor,
                                                   ref["job_individual_ratio"])),
            ("communication", st.comm, *self._comm_test(v, base, floor)),
        ):
            event = hyst.update(a, b, cfg.consecutive, cfg.clear_windows)
            if event:
                events.append({"event": event, "test": name, "rank": r, "node": node,
                               "window": window})
        if not (st.ind.on or st.ind.above or st.comm.on or st.comm.above):
            self._push_baseline(st, v)
        st.exclude_run = st.exclude_run + 1 if (v["ratio"] > cfg.exclude_ratio
                                                and gap > floor) else 0
        if st.exclude_run >= cfg.exclude_windows and node not in self._excluded_nodes:
            self._excluded_nodes.add(node)
            events.append({"event": "exclude", "rank": r, "node": node, "window": window,
                           "ratio": v["ratio"]})
        return _ratio(base["work"], v["work"])

    def _ind_test(self, ratio: float, gap: float, floor: float,
                  job_ratio: float) -> tuple[bool, bool]:
        job_changed = job_ratio > self.config.clear_ratio  # NaN (no baseline yet) is False
        above = ratio > self.config.ratio_threshold and gap > floor and not job_changed
        return above, not above and (ratio < self.config.clear_ratio or gap <= floor)

    def _comm_test(self, v: dict[str, float], base: dict[str, float],
                   floor: float) -> tuple[bool, bool]:
        thr = self.config.ratio_threshold
        step_up = _ratio(v["step"], base["step"]) > thr and v["step"] - base["step"] > floor
        # unchanged work, also in ratio: CPU starvation stretches compute as well as collectives
        work_same = _ratio(v["work"], base["work"]) < self.config.clear_ratio
        wait_up = (v["wait_min"] - base["wait"] > floor
                   and _ratio(v["wait_min"], base["wait"]) > 2 * thr)
        above = step_up and work_same and wait_up
        return above, not above and not step_up

    def _push_baseline(self, st: _RankState, v: dict[str, float]) -> None:
        n = self.config.baseline_windows
        for q, key in ((st.base_work, "work"), (st.base_step, "step"),
                       (st.base_wait, "wait_min")):
            q.append(v[key])
            while len(q) > n:
                q.popleft()

    def _section_scores(self, summaries: dict[int, dict[str, Any]], warm: bool
                        ) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
        meds: dict[str, dict[int, float]] = collections.defaultdict(dict)
        for r, s in summaries.items():
            for name, stats in s.get("sections", {}).items():
                if stats and stats[3] and stats[0] is not None:
                    meds[name][r] = float(stats[0])
        rel: dict[str, dict[int, float]] = {}
        ind: dict[str, dict[int, float]] = {}
        for name, by_rank in meds.items():
            ref = median(list(by_rank.values()))
            rel[name] = {r: _ratio(ref, m) for r, m in by_rank.items()}
            ind[name] = {}
            for r, m in by_rank.items():
                q = self._state[r].base_sections.setdefault(name, collections.deque())
                base = median(q)
                ind[name][r] = _ratio(base, m)
                if warm or not ind[name][r] < 1.0 / self.config.ratio_threshold:
                    q.append(m)
                    while len(q) > self.config.baseline_windows:
                        q.popleft()
        return rel, ind

    def _stragglers(self, per_rank: dict[int, dict[str, float]], ref: dict[str, float],
                    sec_rel: dict[str, dict[int, float]]) -> tuple[StragglerInfo, ...]:
        floor = self.floor(ref["step"])
        # hysteresis holds the state, but a rank is *reported* only while this window's own
        # figures (the ones displayed) still pass the hold test: ratio >= clear_ratio and a gap
        # over the floor, i.e. it costs more than floor_pct % of the median step; a held flag
        # on a window back at ~1.00x is not shown (issue 10/11: "rank 1 ... 1.00x, costs 0.1%")
        flagged = {r for r in per_rank if self._state[r].rel.on
                   and per_rank[r]["ratio"] >= self.config.clear_ratio
                   and per_rank[r]["work"] - ref["work"] > floor}
        # a rank that is slow relative to the others explains why everyone waits longer (a
        # throttled rank is also frozen inside collectives): no communication verdict then
        explained = flagged or any(self._state[r].rel.above or self._state[r].rel.on
                                   for r in per_rank)
        comm = set() if explained else {r for r in per_rank if self._state[r].comm.on}
        node_ranks: dict[str, list[int]] = collections.defaultdict(list)
        for r in per_rank:
            node_ranks[self.rank_to_node.get(r, "?")].append(r)
        whole = {n for n, rs in node_ranks.items()
                 if len(rs) >= 2 and set(rs) <= flagged and len(node_ranks) > 1}
        out = []
        for r in sorted(flagged | comm):
            v, st, node = per_rank[r], self._state[r], self.rank_to_node.get(r, "?")
            if r in comm:
                kind, windows = "communication", st.comm.windows_on
            else:
                kind, windows = self._kind(v, ref, st, node in whole), st.rel.windows_on
            gap = max(0.0, v["work"] - ref["work"])
            worst = min(((sc[r], name) for name, sc in sec_rel.items()
                         if r in sc and math.isfinite(sc[r])), default=(1.0, None))
            out.append(StragglerInfo(
                rank=r, node=node, kind=kind, score=_ratio(ref["work"], v["work"]),
                ratio=v["ratio"], lateness_ms=v["lateness_ms"], est_loss_ms=gap,
                est_loss_pct=100.0 * _ratio(gap, ref["step"]) if gap else 0.0,
                windows_flagged=windows, section=worst[1] if worst[0] < 1.0 else None))
        return tuple(out)

    @staticmethod
    def _kind(v: dict[str, float], ref: dict[str, float], st: _RankState, whole: bool) -> str:
        if whole:
            return "node"
        if v["data"] - ref["data"] > v["compute"] - ref["compute"]:
            return "data"
        if st.above_since_start:
            return "imbalance"
        return "compute"


def _local_sections(summary: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    if not summary:
        return {}
    out = {}
    for name, stats in summary.get("sections", {}).items():
        if stats:
            out[name] = {"median": stats[0], "mad": stats[1], "p90": stats[2], "count": stats[3]}
    return out
