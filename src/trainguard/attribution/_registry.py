"""Pattern registry: the YAML rows that map log lines to failure categories and roles.

The registry is data (``patterns/default.yaml``); the engine never branches on a category name
except through the per-category attributes declared there (domain, decision, nodes, ranks).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from trainguard.attribution.errors import AttributionError

__all__ = ["CATEGORIES", "Category", "Pattern", "ProgressPattern", "Registry", "load_registry"]

#: The category contract (``shared/data/logs/README.md``); a registry may not invent others.
CATEGORIES = (
    "cuda_oom", "host_oom", "gpu_hardware", "network", "collective_timeout", "time_limit",
    "preemption", "node_failure", "user_cancelled", "nan_or_inf", "config_error", "missing_path",
    "permission_denied", "storage_full", "checkpoint_error", "code_exception", "framework_crash",
    "completed", "in_progress", "unknown",
)
_ROLES = {"root", "confirmation", "cascade", "exit", "benign", "teardown", "diagnostic",
          "identity", "checkpoint", "completion", "launcher", "recovery"}
_DOMAINS = {"workload", "infrastructure", "unknown", "none"}
_DECISIONS = {"RESTART", "RESTART_EXCLUDE_NODES", "STOP", "CONTINUE"}
_WITHIN = {"loaded_checkpoint"}
#: exit codes that mean "stopped by the launcher", not "failed by itself" (SIGTERM, 128+15, and
#: DeepSpeed's -1 for a process it terminated)
TEARDOWN_CODES = frozenset({-15, 143, -1})
#: who sent a signal, as a launcher's exit record says (an exit row's ``sender`` group):
#: ``launcher`` -- the launcher or its monitor (hang detection, teardown); ``outside`` -- not
#: the launcher (an operator, a node agent, the kernel); a record that does not say: ``None``
SENDERS = frozenset({"launcher", "outside"})


@dataclass(frozen=True)
class Category:
    """Per-category policy: failure domain, default decision, and how culprits are named."""

    name: str
    domain: str
    decision: str
    nodes: bool = False  # hardware/connectivity categories name culprit nodes
    ranks: bool = True  # False: not tied to the ranks that print it (scheduler events)


@dataclass(frozen=True)
class Pattern:
    """One registry row, compiled."""

    id: str
    role: str
    category: str | None
    tier: int
    priority: int
    triggers: tuple[str, ...]
    regex: re.Pattern[str]
    domain: str | None = None  # overrides the category's domain when this row is the primary
    #: a condition on the row's ``path`` group: ``loaded_checkpoint`` -- the path lies inside a
    #: checkpoint directory the log has already shown a file being loaded from
    within: str | None = None


@dataclass(frozen=True)
class ProgressPattern:
    id: str
    trigger: bytes
    regex: re.Pattern[str]


@dataclass
class Registry:
    """Compiled registry: categories, line patterns (by role) and progress patterns."""

    categories: dict[str, Category]
    patterns: list[Pattern]
    progress: list[ProgressPattern]
    exit_codes: dict[int, str] = field(default_factory=dict)
    signal_senders: dict[str, str] = field(default_factory=dict)
    triggers: tuple[bytes, ...] = field(default=())

    def __post_init__(self) -> None:
        seen: list[bytes] = []
        for pat in self.patterns:
            for trig in pat.triggers:
                enc = trig.encode()
                if enc not in seen:
                    seen.append(enc)
        # Drop triggers containing a shorter trigger: the shorter one already finds the line.
        self.triggers = tuple(t for t in seen if not any(o != t and o in t for o in seen))

    def exit_category(self, code: int, sender: str | None = None) -> str | None:
        """What one process exit means on its own: the single decision for every launcher.

        ``None``: a teardown, not a failure -- the process was stopped (SIGTERM, 143, -1) or
        the launcher's record says it sent the signal itself (``sender`` ``"launcher"``: its
        hang detection or teardown; the record's own row then carries the cause). Otherwise the
        category a failed exit gives when nothing else in the log says why: for a signal whose
        sender the launcher's record names (``"outside"``: not the launcher), the registry's
        ``signal_senders`` entry; else the ``exit_codes`` table by code (a SIGKILL with no
        sender named: the host OOM killer's signature); else ``unknown``.
        """
        if code in TEARDOWN_CODES or sender == "launcher":
            return None
        if code < 0 and sender is not None and sender in self.signal_senders:
            return self.signal_senders[sender]
        return self.exit_codes.get(code, "unknown")


def _bad(path: str, what: str) -> AttributionError:
    return AttributionError(f"pattern registry {path}: {what}")


def _compile_pattern(row: dict, path: str, categories: dict[str, Category]) -> Pattern:
    pid = row.get("id")
    role = row.get("role")
    if not pid or role not in _ROLES:
        raise _bad(path, f"row {row!r} needs an id and a role in {sorted(_ROLES)}")
    category = row.get("category")
    if role in {"root", "confirmation", "cascade", "exit", "diagnostic"} and \
            category not in categories:
        raise _bad(path, f"pattern {pid!r} has category {category!r}; use one of {CATEGORIES}")
    triggers = tuple(str(t).lower() for t in row.get("any") or ())
    if not triggers:
        raise _bad(path, f"pattern {pid!r} needs at least one lowercase trigger in 'any'")
    try:
        regex = re.compile(row["regex"], re.IGNORECASE)
    except (KeyError, re.error) as exc:
        raise _bad(path, f"pattern {pid!r} has no valid regex: {exc}") from exc
    tier = int(row.get("tier", 0))
    default_priority = 25 if role == "cascade" else tier
    domain = row.get("domain")
    if domain is not None and domain not in _DOMAINS:
        raise _bad(path, f"pattern {pid!r} has domain {domain!r}; use one of {sorted(_DOMAINS)}")
    within = row.get("within")
    if within is not None and (within not in _WITHIN or "path" not in regex.groupindex):
        raise _bad(path, f"pattern {pid!r} has within {within!r}; use one of {sorted(_WITHIN)}, "
                         "with a named group 'path' in its regex")
    return Pattern(pid, role, category, tier, int(row.get("priority", default_priority)),
                   triggers, regex, domain, within)


def _load_categories(doc: dict, path: str) -> dict[str, Category]:
    cats: dict[str, Category] = {}
    for name, attrs in (doc.get("categories") or {}).items():
        if name not in CATEGORIES:
            raise _bad(path, f"unknown category {name!r}; the contract allows {CATEGORIES}")
        domain, decision = attrs.get("domain"), attrs.get("decision")
        if domain not in _DOMAINS or decision not in _DECISIONS:
            raise _bad(path, f"category {name!r} needs domain in {_DOMAINS} and decision in "
                             f"{_DECISIONS}")
        cats[name] = Category(name, domain, decision, bool(attrs.get("nodes", False)),
                              bool(attrs.get("ranks", True)))
    missing = set(CATEGORIES) - set(cats)
    if missing:
        raise _bad(path, f"categories missing: {sorted(missing)}; a registry that replaces the "
                         "shipped one must declare every category (to add rows to the shipped "
                         "registry, pass it with --registry instead of --registry-replace)")
    return cats


def parse_registry(text: str, path: str = "<string>") -> Registry:
    """Build a :class:`Registry` from YAML text.

    Raises:
        AttributionError: the YAML is malformed or a row is invalid (the message names the row).
    """
    return _build(_yaml(text, path), path)


def _build(doc: dict, path: str) -> Registry:
    cats = _load_categories(doc, path)
    patterns = [_compile_pattern(row, path, cats) for row in doc.get("patterns") or ()]
    progress = []
    for row in doc.get("progress") or ():
        try:
            progress.append(ProgressPattern(row["id"], str(row["any"]).lower().encode(),
                                            re.compile(row["regex"], re.IGNORECASE)))
        except (KeyError, re.error) as exc:
            raise _bad(path, f"progress row {row!r} is invalid: {exc}") from exc
    exit_codes = {int(k): str(v) for k, v in (doc.get("exit_codes") or {}).items()}
    bad = sorted(set(exit_codes.values()) - set(CATEGORIES))
    if bad:
        raise _bad(path, f"exit_codes map to unknown categories {bad}")
    senders = {str(k): str(v) for k, v in (doc.get("signal_senders") or {}).items()}
    bad = sorted(set(senders) - set(SENDERS - {"launcher"}))
    if bad:
        raise _bad(path, f"signal_senders has unknown sender(s) {bad}; use "
                         f"{sorted(SENDERS - {'launcher'})} (a signal the launcher sent itself "
                         "is a teardown, never a category)")
    bad = sorted(set(senders.values()) - set(CATEGORIES))
    if bad:
        raise _bad(path, f"signal_senders map to unknown categories {bad}")
    return Registry(cats, patterns, progress, exit_codes, senders)


def load_registry(path: str | None = None, *, replace: bool = False) -> Registry:
    """Load the shipped registry, extended by (or, with ``replace``, replaced by) ``path``.

    Extending merges the YAML at ``path`` on top of the shipped ``default.yaml``: a
    ``categories`` entry overrides that category's policy, a ``patterns`` or ``progress`` row
    whose ``id`` exists replaces the shipped row in place, a row with a new ``id`` is added
    before the shipped rows (so it wins ties), and ``exit_codes`` entries override by code.
    Replacing uses only the file, which must then declare every category. Cached per path.

    Args:
        path: a YAML registry file, or ``None`` for the shipped one alone.
        replace: use ``path`` instead of the shipped registry rather than on top of it.

    Raises:
        AttributionError: the file cannot be read or is invalid (the message names the row).
    """
    return _load(os.path.abspath(path) if path else None, bool(replace and path))


_TOP_KEYS = {"categories", "patterns", "progress", "exit_codes", "signal_senders"}


def _shipped_text() -> str:
    return resources.files("trainguard.attribution").joinpath(
        "patterns/default.yaml").read_text(encoding="utf-8")


def _yaml(text: str, path: str) -> dict:
    try:
        doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise _bad(path, f"not valid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise _bad(path, "top level must be a mapping with 'categories' and 'patterns'")
    return doc


def _merge_rows(base: list, extra: list, path: str, key: str) -> list:
    """Rows of ``extra`` replace same-id rows of ``base`` in place; new ids go first."""
    if not isinstance(extra, list) or not all(isinstance(r, dict) and r.get("id")
                                              for r in extra):
        raise _bad(path, f"'{key}' must be a list of rows, each with an 'id'")
    by_id = {r["id"]: r for r in extra}
    merged = [by_id.pop(r.get("id"), r) for r in base]
    return [r for r in extra if r["id"] in by_id] + merged


def merge_registry_docs(base: dict, extra: dict, path: str) -> dict:
    """The registry document ``base`` with the overlay ``extra`` (from ``path``) merged on top.

    Raises:
        AttributionError: ``extra`` has an unknown top-level key or malformed rows.
    """
    unknown = sorted(set(extra) - _TOP_KEYS)
    if unknown:
        raise _bad(path, f"unknown top-level key(s) {unknown}; use {sorted(_TOP_KEYS)}")
    out = dict(base)
    for key in ("categories", "exit_codes", "signal_senders"):
        if extra.get(key) is not None:
            if not isinstance(extra[key], dict):
                raise _bad(path, f"'{key}' must be a mapping")
            out[key] = dict(base.get(key) or {})
            for name, value in extra[key].items():
                prev = out[key].get(name)  # a category overlay may set only some attributes
                both = isinstance(prev, dict) and isinstance(value, dict)
                out[key][name] = {**prev, **value} if both else value
    for key in ("patterns", "progress"):
        if extra.get(key) is not None:
            out[key] = _merge_rows(list(base.get(key) or ()), extra[key], path, key)
    return out


@lru_cache(maxsize=8)
def _load(path: str | None, replace: bool = False) -> Registry:
    if path is None:
        return parse_registry(_shipped_text(), "default.yaml")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise _bad(path, f"cannot read: {exc}") from exc
    if replace:
        return parse_registry(text, path)
    doc = merge_registry_docs(_yaml(_shipped_text(), "default.yaml"), _yaml(text, path), path)
    return _build(doc, f"{path} (merged onto the shipped default.yaml)")
