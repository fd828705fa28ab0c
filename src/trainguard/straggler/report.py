"""What one scored window says: :class:`Report`, :class:`StragglerInfo`, :class:`StragglerId`.

Follows: NVRx ``attribution.straggler`` ``Report`` / ``StragglerId`` / ``identify_stragglers``
(same field names and threshold semantics: a score is ``reference / this rank's median``, 1.0 is
best, a score strictly below a threshold is flagged, NaN never is). Differences: the relative
reference is the *median* over ranks (NVRx: the minimum), the individual reference is a rolling
baseline (NVRx: the historical minimum), section times exclude time spent in collectives, and the
report adds per-rank metrics, classified stragglers with their estimated cost, missing ranks and
explicit warnings.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

__all__ = ["KINDS", "Report", "StragglerId", "StragglerInfo"]

# compute: own work slow; data: data-loader wait; communication: step slowed by collectives
# while compute is unchanged; node: every rank of one node; imbalance: slow since the start.
KINDS = ("compute", "data", "communication", "node", "imbalance")


@dataclasses.dataclass(frozen=True)
class StragglerId:
    """A rank and the node it runs on (NVRx-compatible)."""

    rank: int
    node: str


@dataclasses.dataclass(frozen=True)
class StragglerInfo:
    """One flagged rank in one window.

    Attributes:
        kind: one of :data:`KINDS`.
        score: median over ranks of (compute + data) / this rank's (1.0 = typical, lower = slower).
        ratio: 1 / score; compared with ``ratio_threshold``.
        lateness_ms: ``max over ranks(wait) - own wait`` (window medians): how late this rank
            arrives at collectives.
        est_loss_ms / est_loss_pct: what the job would gain per step without this straggler
            (``own work - median work``), in ms and in % of the median step time.
        windows_flagged: consecutive windows this rank has been flagged, this one included.
        section: the named section with the worst relative score on this rank, if any.
    """

    rank: int
    node: str
    kind: str
    score: float
    ratio: float
    lateness_ms: float
    est_loss_ms: float
    est_loss_pct: float
    windows_flagged: int
    section: str | None = None


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


@dataclasses.dataclass(frozen=True)
class Report:
    """Scores and stragglers of one window (all times in ms).

    NVRx fields: ``gpu_relative_perf_scores`` / ``gpu_individual_perf_scores`` (empty without a
    kernel timer, e.g. on CPU), ``section_relative_perf_scores`` /
    ``section_individual_perf_scores`` (``{section: {rank: score}}``), ``rank_to_node``,
    ``local_section_summaries`` (this rank's ``{section: {median, mad, p90, count}}``),
    ``local_kernel_summaries``, ``generate_report_elapsed_time`` (ms), ``gather_on_rank0``,
    ``rank``.
    """

    window: int
    steps: int
    step_ms_median: float
    stragglers: tuple[StragglerInfo, ...]
    per_rank: dict[int, dict[str, float]]
    missing_ranks: tuple[int, ...]
    warnings: tuple[str, ...]
    events: tuple[dict[str, Any], ...]
    warmup: bool
    rank_relative_perf_scores: dict[int, float]
    rank_individual_perf_scores: dict[int, float]
    section_relative_perf_scores: dict[str, dict[int, float]]
    section_individual_perf_scores: dict[str, dict[int, float]]
    rank_to_node: dict[int, str]
    gpu_relative_perf_scores: dict[int, float] = dataclasses.field(default_factory=dict)
    gpu_individual_perf_scores: dict[int, float] = dataclasses.field(default_factory=dict)
    local_section_summaries: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    local_kernel_summaries: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    generate_report_elapsed_time: float = 0.0
    gather_on_rank0: bool = True
    rank: int = 0

    def identify_stragglers(
        self,
        gpu_rel_threshold: float = 0.75,
        section_rel_threshold: float = 0.75,
        gpu_indiv_threshold: float = 0.75,
        section_indiv_threshold: float = 0.75,
    ) -> dict[str, Any]:
        """Ranks whose scores are strictly below the thresholds (NaN never flagged).

        Returns NVRx's four keys ``straggler_gpus_relative`` / ``straggler_gpus_individual``
        (``set[StragglerId]``) and ``straggler_sections_relative`` /
        ``straggler_sections_individual`` (``{section: set[StragglerId]}``), plus
        ``straggler_ranks_relative`` / ``straggler_ranks_individual`` from the per-rank compute
        scores, thresholded with the relative and individual *section* thresholds.

        Follows: NVRx ``Report.identify_stragglers``; it never blocks and is not a collective.
        """

        def below(scores: dict[int, float], thr: float) -> set[StragglerId]:
            return {StragglerId(r, self.rank_to_node.get(r, "?"))
                    for r, s in scores.items() if s < thr}  # NaN < thr is False

        return {
            "straggler_gpus_relative": below(self.gpu_relative_perf_scores, gpu_rel_threshold),
            "straggler_gpus_individual": below(self.gpu_individual_perf_scores,
                                               gpu_indiv_threshold),
            "straggler_sections_relative": {
                s: below(v, section_rel_threshold)
                for s, v in self.section_relative_perf_scores.items()},
            "straggler_sections_individual": {
                s: below(v, section_indiv_threshold)
                for s, v in self.section_individual_perf_scores.items()},
            "straggler_ranks_relative": below(self.rank_relative_perf_scores,
                                              section_rel_threshold),
            "straggler_ranks_individual": below(self.rank_individual_perf_scores,
                                                section_indiv_threshold),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN becomes null, rank keys become strings)."""
        out = dataclasses.asdict(self)
        out["stragglers"] = [dataclasses.asdict(s) for s in self.stragglers]
        return dict(_nan_to_none(out))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def summary_line(self) -> str:
        """One human line: the window and each straggler with its kind and cost."""
        if self.warmup:
            return f"window {self.window}: warm-up ({self.steps} steps)"
        if not self.stragglers:
            extra = f"; warnings: {len(self.warnings)}" if self.warnings else ""
            return (f"window {self.window}: no stragglers among {len(self.per_rank)} ranks "
                    f"(step {self.step_ms_median:.2f} ms){extra}")
        parts = [f"rank {s.rank} on node {s.node}: {s.kind}, {s.ratio:.2f}x, costs "
                 f"{s.est_loss_pct:.1f}% of throughput ({s.est_loss_ms:.2f} ms/step, "
                 f"{s.windows_flagged} windows)" for s in self.stragglers]
        return f"window {self.window}: stragglers: " + "; ".join(parts)
