"""Fault-tolerance options of ``trainguard launch``: defaults < YAML section < ``--ft-*`` flags.

Every duration is in seconds (float); ``None`` (``none``/``null``/empty in YAML or on the command
line) disables that timeout. Hang detection is on by default:

* ``auto_heartbeat_timeout`` (600 s) needs no code change: the worker bootstrap stamps the slot
  from the main thread between bytecodes, so a main thread stuck in a C call or holding the GIL
  stops stamping;
* ``initial_rank_heartbeat_timeout`` (900 s) / ``rank_heartbeat_timeout`` (600 s) apply to ranks
  that call ``RankMonitorClient.init_workload_monitoring()``;
* section and out-of-section timeouts apply when configured.

Follows: NVRx ``FaultToleranceConfig`` (same field names, same YAML ``fault_tolerance:`` section
found at any depth); differences: timeouts on by default, a 0.1 s check interval (shared-memory
heartbeats make it cheap), SIGTERM then SIGKILL after a per-rank grace instead of a bare SIGKILL.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Mapping
from typing import Any

from trainguard.fault_tolerance.errors import LaunchConfigError

__all__ = ["FaultToleranceConfig", "check_timeout_chain", "load_yaml_section", "parse_seconds"]

_OPTIONAL_S = (
    "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout",
    "auto_heartbeat_timeout", "checkpoint_iteration_file",
)


@dataclasses.dataclass(frozen=True)
class FaultToleranceConfig:
    """Fault-tolerance settings (durations in seconds; ``None`` disables a timeout).

    Raises (constructor):
        LaunchConfigError: a duration is negative, zero or not finite, a signal name is unknown,
            or an exit code is outside 1..255.
    """

    workload_check_interval: float = 0.1
    initial_rank_heartbeat_timeout: float | None = 900.0
    rank_heartbeat_timeout: float | None = 600.0
    rank_section_timeouts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    auto_heartbeat_timeout: float | None = 600.0
    safety_factor: float = 5.0
    rank_termination_signal: str = "SIGTERM"
    rank_termination_grace: float = 5.0
    workers_stop_timeout: float = 15.0
    term_timeout: float = 30.0
    forward_signals: tuple[str, ...] = ("SIGTERM", "SIGINT")
    max_no_progress_cycles: int = 3
    min_progress_iterations: int = 1
    checkpoint_iteration_file: str | None = None
    no_restart_exit_code: int = 93
    #: multi-node: distinct node failures (a lapsed lease, a failed health check, an
    #: exclusion) the job tolerates; one more ends it everywhere with ``no_restart_exit_code``.
    #: ``None``: no limit (``--max-restarts`` still bounds the restarts).
    max_node_failures: int | None = None
    warm_restart: bool = True
    preload: tuple[str, ...] = ()
    attribution: bool = True
    attrsvc_url: str | None = None
    attribution_stop_action: str = "log"
    pg_timeout: float = 1800.0
    #: names of the options the user set (YAML or CLI): only explicitly configured client
    #: timeouts make "no worker ever connected" an error
    explicit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _positive("workload_check_interval", self.workload_check_interval)
        for name in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
                     "rank_out_of_section_timeout", "auto_heartbeat_timeout"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        for section, value in self.rank_section_timeouts.items():
            _positive(f"rank_section_timeouts[{section}]", value)
        if len(self.rank_section_timeouts) > 32:
            raise LaunchConfigError("at most 32 sections can have timeouts; merge some sections")
        for name in ("rank_termination_grace", "workers_stop_timeout", "term_timeout"):
            if getattr(self, name) < 0:
                raise LaunchConfigError(f"--ft-{name.replace('_', '-')} must be >= 0 seconds, "
                                        f"got {getattr(self, name)}")
        _positive("safety_factor", self.safety_factor)
        _positive("pg_timeout", self.pg_timeout)
        for name in (self.rank_termination_signal, *self.forward_signals):
            signal_number(name)
        if not 1 <= self.no_restart_exit_code <= 255:
            raise LaunchConfigError(
                f"--ft-no-restart-exit-code must be 1..255, got {self.no_restart_exit_code}")
        if self.attribution_stop_action not in ("log", "no-restart"):
            raise LaunchConfigError("--ft-attribution-stop-action must be 'log' or 'no-restart', "
                                    f"got {self.attribution_stop_action!r}")
        if self.max_node_failures is not None and self.max_node_failures < 0:
            raise LaunchConfigError("--ft-max-node-failures must be >= 0 (node failures the job "
                                    f"tolerates) or 'none', got {self.max_node_failures}")
        if self.max_no_progress_cycles < 0 or self.min_progress_iterations < 1:
            raise LaunchConfigError("--ft-max-no-progress-cycles must be >= 0 and "
                                    "--ft-min-progress-iterations >= 1")

    @property
    def section_names(self) -> list[str]:
        """Configured sections in slot order (sorted by name, identical in every process)."""
        return sorted(self.rank_section_timeouts)

    def client_timeouts_explicit(self) -> bool:
        """True when the user configured a client timeout (heartbeat, section, out-of-section)."""
        keys = {"initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
                "rank_section_timeouts", "rank_out_of_section_timeout"}
        return bool(self.explicit & keys)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rank_section_timeouts"] = dict(self.rank_section_timeouts)
        out["explicit"] = sorted(self.explicit)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FaultToleranceConfig:
        data = dict(data)
        data["forward_signals"] = tuple(data.get("forward_signals", ()))
        data["preload"] = tuple(data.get("preload", ()))
        data["explicit"] = frozenset(data.get("explicit", ()))
        return cls(**data)

    @classmethod
    def merged(cls, yaml_values: Mapping[str, Any], cli_values: Mapping[str, Any]
               ) -> FaultToleranceConfig:
        """Defaults, then ``yaml_values``, then ``cli_values`` (``None`` = flag not given).

        Raises:
            LaunchConfigError: an unknown key or an invalid value.
        """
        fields = {f.name for f in dataclasses.fields(cls)} - {"explicit"}
        values: dict[str, Any] = {}
        for source, mapping in (("YAML", yaml_values), ("CLI", cli_values)):
            for key, raw in mapping.items():
                key = key.replace("-", "_")
                if key not in fields:
                    raise LaunchConfigError(
                        f"unknown fault_tolerance option {key!r} in the {source}; valid: "
                        f"{', '.join(sorted(fields))}")
                if source == "CLI" and raw is None:
                    continue
                values[key] = _coerce(key, raw)
        return cls(**values, explicit=frozenset(values))


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value <= 0:
        raise LaunchConfigError(
            f"--ft-{name.replace('_', '-')} must be a positive number of seconds, got {value!r}")


def signal_number(name: str) -> int:
    """``"SIGTERM"`` / ``"TERM"`` / ``"15"`` -> 15. Raises LaunchConfigError on unknown names."""
    text = str(name).strip().upper()
    if text.isdigit():
        return int(text)
    try:
        return int(signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])
    except (KeyError, ValueError):
        raise LaunchConfigError(f"unknown signal {name!r}; use a name such as SIGTERM") from None


def parse_seconds(name: str, raw: Any) -> float | None:
    """A duration in seconds from a flag or YAML value; ``none``/``null``/empty -> None.

    Raises:
        LaunchConfigError: not a number.
    """
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
        return None
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise LaunchConfigError(f"--ft-{name.replace('_', '-')}: {raw!r} is not a number of "
                                "seconds (use e.g. 300, or 'none' to disable)") from None


def _coerce(key: str, raw: Any) -> Any:
    if key == "rank_section_timeouts":
        items: list[Any]
        if isinstance(raw, Mapping):
            items = list(raw.items())
        else:
            items = [part.split(":", 1) for part in str(raw).split(",") if part.strip()]
            if any(len(p) != 2 for p in items):
                raise LaunchConfigError(
                    f"--ft-rank-section-timeouts: {raw!r} must look like 'step:30,ckpt:120'")
        out = {}
        for name, value in items:
            seconds = parse_seconds(f"rank_section_timeouts[{name}]", value)
            if seconds is not None:
                out[str(name).strip()] = seconds
        return out
    if key in ("forward_signals", "preload"):
        parts: list[Any] = list(raw) if isinstance(raw, (list, tuple)) else str(raw).split(",")
        return tuple(str(i).strip() for i in parts if str(i).strip())
    if key in _OPTIONAL_S[:4] or key in ("workload_check_interval", "safety_factor",
                                          "rank_termination_grace", "workers_stop_timeout",
                                          "term_timeout", "pg_timeout"):
        return parse_seconds(key, raw)
    if key in ("max_no_progress_cycles", "min_progress_iterations", "no_restart_exit_code"):
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise LaunchConfigError(f"--ft-{key.replace('_', '-')}: {raw!r} is not an integer"
                                    ) from None
    if key == "max_node_failures":
        if raw is None or str(raw).strip().lower() in ("", "none", "null"):
            return None
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise LaunchConfigError(f"--ft-max-node-failures: {raw!r} is not an integer (node "
                                    "failures the job tolerates) or 'none'") from None
    if key in ("warm_restart", "attribution"):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise LaunchConfigError(f"--ft-{key.replace('_', '-')}: {raw!r} is not a boolean")
        return text in ("1", "true", "yes", "on")
    if key == "checkpoint_iteration_file" and raw is not None:
        return str(raw)
    return raw


def load_yaml_section(path: str) -> dict[str, Any]:
    """The first ``fault_tolerance:`` mapping at any depth of the YAML file (an empty section
    gives ``{}``).

    Raises:
        LaunchConfigError: the file is missing, unreadable or not valid YAML, or it has no
            ``fault_tolerance:`` section (a misspelt name must not run the job on defaults).
    """
    import yaml

    if not os.path.isfile(path):
        raise LaunchConfigError(f"--ft-cfg-path: no such file {path!r}")
    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise LaunchConfigError(f"--ft-cfg-path: cannot read {path!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise LaunchConfigError(_yaml_error_line(path, exc)) from None
    found = _find_section(doc)
    if found is _MISSING:  # a typo in the section name must not run the job on silent defaults
        keys = sorted(str(k) for k in doc) if isinstance(doc, Mapping) else []
        has = f" (top-level keys: {', '.join(keys)})" if keys else " (the file is empty or not " \
            "a mapping)"
        raise LaunchConfigError(f"--ft-cfg-path: {path}: no 'fault_tolerance:' section{has}; "
                                "put the options under 'fault_tolerance:'")
    if found is None:  # "fault_tolerance:" with nothing under it
        return {}
    if not isinstance(found, Mapping):
        raise LaunchConfigError(f"{path}: 'fault_tolerance' must be a mapping of options")
    return dict(found)


def _yaml_error_line(path: str, exc: Exception) -> str:
    """One line for a YAML syntax error: file, line, column (1-based) and what to fix."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return (f"--ft-cfg-path: {where}: invalid YAML ({problem}); fix the syntax there "
            "(check indentation, ':' after each key, matching quotes/brackets)")


_MISSING = object()


def _find_section(doc: Any) -> Any:
    """The value of the first ``fault_tolerance`` key at any depth; ``_MISSING`` if none."""
    if isinstance(doc, Mapping):
        if "fault_tolerance" in doc:
            return doc["fault_tolerance"]
        values: Any = doc.values()
    elif isinstance(doc, list):
        values = doc
    else:
        return _MISSING
    for value in values:
        found = _find_section(value)
        if found is not _MISSING:
            return found
    return _MISSING


def check_timeout_chain(cfg: FaultToleranceConfig, rdzv_timeout_s: float | None = None
                        ) -> list[str]:
    """Violated timing inequalities, one line each with the fix (empty: the chain holds).

    Checked: the check interval is well below every timeout; hang timeouts fire before the
    process-group timeout (otherwise a hang surfaces as a peer's collective error and the root
    cause is mis-attributed); the initial heartbeat timeout is not shorter than the subsequent
    one; the rendezvous timeout covers a restart (worker-stop grace); some hang timeout is on.
    """
    out: list[str] = []
    hang = {
        "rank_heartbeat_timeout": cfg.rank_heartbeat_timeout,
        "auto_heartbeat_timeout": cfg.auto_heartbeat_timeout,
        "rank_out_of_section_timeout": cfg.rank_out_of_section_timeout,
        **{f"rank_section_timeouts[{k}]": v for k, v in cfg.rank_section_timeouts.items()},
    }
    active = {k: v for k, v in hang.items() if v is not None}
    for name, value in active.items():
        if value < 2 * cfg.workload_check_interval:
            out.append(f"{name} ({value:g} s) < 2 x workload_check_interval "
                       f"({cfg.workload_check_interval:g} s): detection would be late; lower "
                       "--ft-workload-check-interval")
        if value >= cfg.pg_timeout:
            out.append(f"{name} ({value:g} s) >= process-group timeout ({cfg.pg_timeout:g} s): a "
                       "hang would surface as a peer's collective timeout; lower the hang timeout "
                       "or raise the PG timeout (init_process_group(timeout=...), --ft-pg-timeout)")
    if (cfg.initial_rank_heartbeat_timeout is not None and cfg.rank_heartbeat_timeout is not None
            and cfg.initial_rank_heartbeat_timeout < cfg.rank_heartbeat_timeout):
        out.append(f"initial_rank_heartbeat_timeout ({cfg.initial_rank_heartbeat_timeout:g} s) < "
                   f"rank_heartbeat_timeout ({cfg.rank_heartbeat_timeout:g} s): startup is "
                   "slower than a step; raise --ft-initial-rank-heartbeat-timeout")
    if rdzv_timeout_s is not None and rdzv_timeout_s <= cfg.workers_stop_timeout:
        out.append(f"rendezvous timeout ({rdzv_timeout_s:g} s) <= workers_stop_timeout "
                   f"({cfg.workers_stop_timeout:g} s): a restart could outlast the rendezvous; "
                   "raise --rdzv-conf timeout= or lower --ft-workers-stop-timeout")
    if not active:
        out.append("no hang timeout is active: hangs will not be detected; set "
                   "--ft-auto-heartbeat-timeout or --ft-rank-heartbeat-timeout")
    return out
