"""The demo's fault schedule: ``KIND@rankR:stepS`` items separated by commas, or ``none``.

Ranks are *initial* ranks (the process index the launcher gave, ``0 .. ranks+reserve-1``), so a
fault stays attached to one process even after restarts renumber the active ranks. A fault fires
at the start of global step ``S`` (1-based: the S-th optimizer update), before that step runs.
"""

from __future__ import annotations

import dataclasses
import re

from trainguard.errors import ConfigError

__all__ = ["DEFAULT_FAULTS", "FAULT_KINDS", "FaultSpec", "parse_faults", "validate_faults"]

# kind -> what it does in the rank (shown in --help and in error messages)
FAULT_KINDS: dict[str, str] = {
    "exception": "raise a Python exception in the training loop",
    "hang": "block the main thread in a C call (time.sleep(3600)) until the wrapper interrupts it",
    "sigkill": "the rank sends itself SIGKILL (process dies without cleanup)",
}
DEFAULT_FAULTS = "exception@rank1:step40,hang@rank2:step80,sigkill@rank3:step120"

_ITEM = re.compile(r"^(?P<kind>[a-z]+)@rank(?P<rank>\d+):step(?P<step>\d+)$")


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """One scheduled fault.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        rank: initial rank (process index) that injects it.
        step: 1-based global training step at whose start it fires.
    """

    kind: str
    rank: int
    step: int

    @property
    def label(self) -> str:
        return f"{self.kind}@rank{self.rank}:step{self.step}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> FaultSpec:
        return cls(kind=str(data["kind"]), rank=int(data["rank"]), step=int(data["step"]))


def parse_faults(text: str) -> list[FaultSpec]:
    """Parse a schedule string such as ``"exception@rank1:step40,sigkill@rank3:step120"``.

    ``"none"`` (or an empty string) means no faults. Whitespace around items is ignored.

    Raises:
        ConfigError: an item is malformed, names an unknown kind, or a (rank, step) pair repeats.
    """
    text = text.strip()
    if text.lower() in ("", "none"):
        return []
    faults: list[FaultSpec] = []
    for raw in text.split(","):
        item = raw.strip()
        match = _ITEM.match(item)
        if match is None:
            raise ConfigError(
                f"bad fault {item!r}: expected KIND@rankR:stepS, e.g. 'exception@rank1:step40' "
                f"(KIND one of {', '.join(FAULT_KINDS)}), items separated by commas, or 'none'"
            )
        kind = match["kind"]
        if kind not in FAULT_KINDS:
            raise ConfigError(
                f"bad fault {item!r}: unknown kind {kind!r}; use one of {', '.join(FAULT_KINDS)}"
            )
        spec = FaultSpec(kind=kind, rank=int(match["rank"]), step=int(match["step"]))
        if spec.step < 1:
            raise ConfigError(f"bad fault {item!r}: steps are numbered from 1")
        if any((f.rank, f.step) == (spec.rank, spec.step) for f in faults):
            raise ConfigError(
                f"bad fault {item!r}: rank {spec.rank} already has a fault at step {spec.step}"
            )
        faults.append(spec)
    return faults


def validate_faults(faults: list[FaultSpec], *, ranks: int, reserve: int, steps: int) -> None:
    """Check a parsed schedule against the run's shape.

    Rules: the rank must exist; the step must be one the run executes; some rank must survive
    all the ``sigkill`` faults. (Killing initial rank 0 is fine: the wrapper hosts the store in
    that rank's monitor process, which outlives it.)

    Raises:
        ConfigError: naming the offending fault and how to fix it.
    """
    total = ranks + reserve
    for f in faults:
        if f.rank >= total:
            raise ConfigError(
                f"fault {f.label}: rank {f.rank} does not exist (ranks are 0..{total - 1} with "
                f"--ranks {ranks} --reserve-ranks {reserve})"
            )
        if f.step > steps:
            raise ConfigError(
                f"fault {f.label}: step {f.step} is past the last step ({steps}); raise --steps"
            )
    killed = {f.rank: f.step for f in sorted(faults, key=lambda f: -f.step) if f.kind == "sigkill"}
    for f in faults:
        if f.rank in killed and f.step > killed[f.rank]:
            raise ConfigError(
                f"fault {f.label}: rank {f.rank} is killed at step {killed[f.rank]}, so a later "
                "fault on it can never fire"
            )
    if len(killed) >= total:
        raise ConfigError(f"sigkill faults would remove all {total} ranks; add reserve ranks")
