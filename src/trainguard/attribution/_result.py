"""Result types of a log analysis and their JSON form (keys follow the label schema)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AnalysisResult", "Cascade", "Evidence"]

_RECOMMEND = {
    "RESTART": "Restart the job; it resumes from its last checkpoint.",
    "RESTART_EXCLUDE_NODES": "Restart the job without the implicated node(s).",
    "STOP": "Do not restart: the same job would fail the same way (or has nothing left to do).",
    "CONTINUE": "Nothing to do: the job is still making progress.",
}

_RECOVERED_DONE = ("Nothing to do: the job recovered in-process from its fault(s) and finished; "
                   "look at the recovered faults if they recur.")


@dataclass(frozen=True)
class Evidence:
    """One cited log line."""

    file: str
    line: int
    text: str
    pattern: str
    role: str
    category: str | None

    @classmethod
    def of(cls, match, files: list[str]) -> Evidence:
        p = match.pattern
        return cls(files[match.file], match.line, match.text, p.id, p.role, p.category)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Cascade:
    """A secondary symptom folded into the primary: how often, where, first occurrence."""

    category: str
    count: int
    ranks: set[int]
    nodes: set[str]
    first: Any

    def to_dict(self) -> dict[str, Any]:
        return {"category": self.category, "count": self.count, "ranks": sorted(self.ranks),
                "nodes": sorted(self.nodes), "first_line": self.first.line}


@dataclass
class AnalysisResult:
    """What failed, where, whose fault, and whether restarting can help."""

    primary_category: str
    failure_domain: str
    culprit_ranks: list[int] | None
    culprit_nodes: list[str] | None
    cascades: list[Cascade]
    decision: str
    basis: str
    evidence: list[Evidence]
    confidence: int
    fingerprint: str
    last_step: int | None = None
    last_checkpoint_step: int | None = None
    checkpoint_saved: bool = False
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    bytes_read: int = 0
    lines: int = 0
    reason: str = ""
    flight_recorder: dict[str, Any] | None = None
    flagged_inputs: list[str] = field(default_factory=list)  # inputs not read as text logs
    #: where the culprit ranks ran, as a launcher placed them (torchrun's failure record ``host :
    #: node-03``, a ``[node-01] [rank3]:`` prefix); unlike ``culprit_nodes`` not a verdict against
    #: those hosts (a code exception on node-03 is not node-03's fault)
    culprit_hosts: list[str] | None = None
    #: every failed process exit the launchers report (rank, code, signal name, sender, node)
    failed_exits: list[dict[str, Any]] = field(default_factory=list)
    #: faults an in-process restart recovered from (iteration, cause, ranks, category, line);
    #: reported here, never as the primary failure
    recovered: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.reason:
            self.reason = self.describe()

    @property
    def cascade_categories(self) -> list[str]:
        return [c.category for c in self.cascades]

    @property
    def recommendation(self) -> str:
        if self.recovered and self.primary_category == "completed" and \
                self.decision == "CONTINUE":
            return _RECOVERED_DONE
        return _RECOMMEND[self.decision]

    def describe(self) -> str:
        """One sentence: the root cause, where it is, what followed, and the decision."""
        where = ""
        if self.culprit_ranks:
            where += f" on rank(s) {', '.join(map(str, self.culprit_ranks))}"
        if self.culprit_nodes:
            where += f" (node(s) {', '.join(self.culprit_nodes)})"
        cite = f" at {self.evidence[0].file}:{self.evidence[0].line}" if self.evidence else ""
        folded = ""
        if self.cascades:
            parts = [f"{c.count} {c.category} message(s)" for c in self.cascades]
            folded = f"; {', '.join(parts)} follow from it"
        return (f"{self.primary_category} ({self.failure_domain}){where}{cite}: {self.basis}"
                f"{folded}; decision {self.decision}.")

    def to_dict(self) -> dict[str, Any]:
        out = {
            "primary_category": self.primary_category, "failure_domain": self.failure_domain,
            "culprit_ranks": self.culprit_ranks, "culprit_nodes": self.culprit_nodes,
            "culprit_hosts": self.culprit_hosts,
            "cascade_categories": self.cascade_categories, "decision": self.decision,
            "reason": self.reason, "recommendation": self.recommendation,
            "confidence": self.confidence, "fingerprint": self.fingerprint,
            "evidence": [e.to_dict() for e in self.evidence],
            "cascades": [c.to_dict() for c in self.cascades],
            "progress": {"last_step": self.last_step, "checkpoint_saved": self.checkpoint_saved,
                         "last_checkpoint_step": self.last_checkpoint_step},
            "files": self.files, "warnings": self.warnings,
            "flagged_inputs": self.flagged_inputs,
            "bytes_read": self.bytes_read, "lines": self.lines,
            "failed_exits": self.failed_exits, "recovered": self.recovered,
        }
        if self.flight_recorder is not None:
            out["flight_recorder"] = self.flight_recorder
        return out
