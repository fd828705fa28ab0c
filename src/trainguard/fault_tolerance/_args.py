"""Command line of ``trainguard launch``: torch 2.13 torchrun flags, ``PET_*`` variables,
``--ft-*``.

Precedence: command line > ``PET_<DEST>`` environment variable > default (as torchrun's
``argparse_util.env``). Everything after the training script (or after ``--``) reaches the script
verbatim: launcher flags are parsed only from the arguments before the script, so a script flag is
never swallowed by prefix matching (torchrun and NVRx do; launcher-research.md A1).

Follows: ``torch.distributed.run.get_args_parser`` (torch 2.13); differences: ``--ft-*`` options,
the default rendezvous is a launcher-chosen free port, script arguments are never parsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from trainguard._core.cli import ArgumentParser
from trainguard.fault_tolerance._identity import NodeIdentity, resolve_identity, slurm_nnodes
from trainguard.fault_tolerance.config import FaultToleranceConfig, load_yaml_section
from trainguard.fault_tolerance.errors import LaunchConfigError

__all__ = ["LaunchSpec", "build_parser", "parse_launch_args"]

_log = logging.getLogger("trainguard.fault_tolerance")

# torchrun flags: (option strings, dest, default, kind); kind: str | int | float | flag
_TORCHRUN: list[tuple[tuple[str, ...], str, Any, str, str]] = [
    (("--nnodes",), "nnodes", "1:1", "str",
     "number of nodes or MIN:MAX (nodes beyond MAX park as hot spares)"),
    (("--nproc-per-node", "--nproc_per_node"), "nproc_per_node", "1", "str",
     "workers per node: an integer, 'cpu', 'gpu' or 'auto'"),
    (("--rdzv-backend", "--rdzv_backend"), "rdzv_backend", "static", "str",
     "rendezvous backend: static (one node) or trainguard/c10d (default when --nnodes > 1)"),
    (("--rdzv-endpoint", "--rdzv_endpoint"), "rdzv_endpoint", "", "str", "host:port of the store"),
    (("--rdzv-id", "--rdzv_id"), "rdzv_id", "none", "str",
     ("job id (TORCHELASTIC_RUN_ID; default: PET_RDZV_ID, SLURM_ARRAY_JOB_ID, SLURM_JOB_ID, "
      "TORCHELASTIC_RUN_ID, else tg<launcher pid>)")),
    (("--rdzv-conf", "--rdzv_conf"), "rdzv_conf", "", "str",
     "key=value,...: join_timeout, last_call_timeout (s), store_type=tcp|file, is_host=0|1"),
    (("--standalone",), "standalone", False, "flag", "single node, free local ports"),
    (("--max-restarts", "--max_restarts"), "max_restarts", 0, "int",
     "restart cycles of the whole job before giving up (global count)"),
    (("--monitor-interval", "--monitor_interval"), "monitor_interval", 0.1, "float",
     "seconds between worker-state checks"),
    (("--start-method", "--start_method"), "start_method", "spawn", "str",
     "accepted for compatibility; workers are forked from a torch-preloaded server or spawned"),
    (("--event-log-handler", "--event_log_handler"), "event_log_handler", "null", "str",
     "accepted for compatibility (ignored)"),
    (("--role",), "role", "default", "str", "worker role name"),
    (("-m", "--module"), "module", False, "flag", "run the script as a module (python -m)"),
    (("--no-python", "--no_python"), "no_python", False, "flag", "exec the script directly"),
    (("--run-path", "--run_path"), "run_path", False, "flag", "run with runpy.run_path"),
    (("--log-dir", "--log_dir"), "log_dir", None, "str",
     ("directory for per-cycle rank logs, written to LOG_DIR/RUN_ID/cycle_N.log (default: a "
      "new /tmp/trainguard_RUN_ID_* directory, kept after the run and named in the final "
      "table)")),
    (("-r", "--redirects"), "redirects", "0", "str",
     "redirect worker streams to log files only: 0 none, 1 out, 2 err, 3 both; or 0:1,1:2"),
    (("-t", "--tee"), "tee", "0", "str", "copy worker streams to log files and console"),
    (("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter", "", "str",
     "comma-separated local ranks whose output reaches the console"),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "duplicate_stdout_filters",
     "", "str", "accepted for compatibility (ignored)"),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "duplicate_stderr_filters",
     "", "str", "accepted for compatibility (ignored)"),
    (("--node-rank", "--node_rank"), "node_rank", None, "int",
     "identity of this node (multi-node: unique per live launcher; default 0 on one node)"),
    (("--master-addr", "--master_addr"), "master_addr", "127.0.0.1", "str", "MASTER_ADDR"),
    (("--master-port", "--master_port"), "master_port", None, "int",
     "MASTER_PORT (default: a free port reserved by the launcher, fresh every cycle)"),
    (("--local-addr", "--local_addr"), "local_addr", None, "str", "address of this node"),
    (("--logs-specs", "--logs_specs"), "logs_specs", None, "str",
     "accepted for compatibility (ignored)"),
    (("--numa-binding", "--numa_binding"), "numa_binding", None, "str",
     "accepted for compatibility (ignored)"),
    (("--signals-to-handle", "--signals_to_handle"), "signals_to_handle",
     "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "str", "signals forwarded to the workers"),
    (("--shutdown-timeout", "--shutdown_timeout"), "shutdown_timeout", None, "int",
     "seconds between the forwarded signal and SIGKILL (default --ft-term-timeout)"),
    (("--virtual-local-rank", "--virtual_local_rank"), "virtual_local_rank", False, "flag",
     "set LOCAL_RANK=0 in every worker"),
]

# --ft-* options: (name, help). Values are parsed by FaultToleranceConfig.merged.
_FT: list[tuple[str, str]] = [
    ("workload_check_interval", "seconds between hang checks by each rank monitor (0.1)"),
    ("initial_rank_heartbeat_timeout", "seconds from client init to the first heartbeat (900)"),
    ("rank_heartbeat_timeout", "seconds between client heartbeats (600; none disables)"),
    ("rank_section_timeouts", "name:seconds,... no progress in an open section for that long"),
    ("rank_out_of_section_timeout", "seconds with no section open (none)"),
    ("auto_heartbeat_timeout", "seconds the main thread may not run Python bytecode (600)"),
    ("safety_factor", "automatic timeout = factor x longest observed (5)"),
    ("rank_termination_signal", "signal sent to a hung rank before SIGKILL (SIGTERM)"),
    ("rank_termination_grace", "seconds between that signal and SIGKILL (5)"),
    ("workers_stop_timeout", "seconds workers get to exit when a cycle ends (15)"),
    ("term_timeout", "seconds workers get after a forwarded SIGTERM/SIGINT (30)"),
    ("forward_signals", "signals forwarded to each rank's main process (SIGTERM,SIGINT)"),
    ("max_no_progress_cycles", "cycles without progress before exiting with the no-restart code"),
    ("min_progress_iterations", "iterations a cycle must add to count as progress (1)"),
    ("checkpoint_iteration_file", "file holding the latest checkpointed iteration"),
    ("no_restart_exit_code", "exit code for verdicts a restart will not fix (93)"),
    ("max_node_failures", ("multi-node: node failures (lapsed lease, failed health check, "
                           "exclusion) the job tolerates; one more ends every launcher with "
                           "the no-restart code (default: no limit)")),
    ("warm_restart", "fork workers from a torch-preloaded server (true)"),
    ("preload", "modules the fork server imports besides torch (comma-separated)"),
    ("attribution", "run trainguard.attribution on each failed cycle's log (true)"),
    ("attrsvc_url", "post cycle logs to a running 'trainguard attrsvc' instead"),
    ("attribution_stop_action", "log | no-restart: what a STOP verdict does (log)"),
    ("pg_timeout", "process-group timeout of the workers, for the timeout-chain check (1800)"),
]

_DEFAULT_RDZV_PORT = 29400  # torchrun's default for --rdzv-backend c10d

# multi-node options outside FaultToleranceConfig: (flag, dest, default seconds, help)
_LEASE: list[tuple[str, str, float | None, str]] = [
    ("--ft-lease-s", "lease_s", 5.0,
     ("multi-node: seconds without a lease renewal after which a launcher counts as lost "
      "(peers open the next round; the launcher itself stops its workers and exits 75)")),
    ("--ft-lease-interval-s", "lease_interval_s", None,
     "multi-node: seconds between lease renewals (default lease / 5)"),
]


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Everything ``trainguard launch`` was asked to do (validated)."""

    nproc_per_node: int
    max_restarts: int
    monitor_interval_s: float
    role: str
    run_id: str
    module: bool
    no_python: bool
    log_dir: str | None
    redirects: dict[int, int]
    tee: dict[int, int]
    local_ranks_filter: frozenset[int] | None
    node_rank: int
    master_addr: str
    master_port: int | None
    virtual_local_rank: bool
    rdzv_timeout_s: float | None
    shutdown_timeout_s: float | None
    signals_to_handle: tuple[str, ...]
    script: str
    script_args: tuple[str, ...]
    ft: FaultToleranceConfig
    nnodes_min: int = 1
    nnodes_max: int = 1
    node_rank_given: bool = False
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    local_addr: str | None = None
    lease_s: float = 5.0
    lease_interval_s: float = 1.0

    @property
    def multinode(self) -> bool:
        """True when the job spans nodes (``--nnodes`` > 1 or a trainguard/c10d backend)."""
        return self.nnodes_max > 1 or self.rdzv_backend in ("trainguard", "c10d")
    identity: NodeIdentity | None = None  # _identity: node rank / run id and their sources
    health_port: int | None = None  # --health-port (None: no endpoint)
    health_check: str = ""  # --ft-health-check: 'module:function,...' or 'off'
    health_check_timeout_s: float = 30.0  # --ft-health-check-timeout
    dry_run: bool = False  # --dry-run / --print-env
    nnodes_source: str = "default"  # --nnodes | PET_NNODES | SLURM_NNODES | default


def _check_module(name: str) -> None:
    """``-m NAME``: its top-level package must be importable from the cwd or ``sys.path``.

    Only the top-level name is looked up (``importlib.util.find_spec`` on a dotted name would
    import, i.e. run, the parent packages); a finder that errors is not held against the name.

    Raises:
        LaunchConfigError: no top-level module or package of that name exists.
    """
    import importlib.machinery
    import importlib.util

    top = name.split(".", 1)[0]
    if not top.isidentifier():
        raise LaunchConfigError(f"-m {name!r}: not a module name (use dotted Python "
                                "identifiers, e.g. -m pkg.train)")
    try:
        found = importlib.util.find_spec(top) is not None or \
            importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None
    except Exception:  # noqa: BLE001 - a broken finder: leave the verdict to the worker
        return
    if not found:
        raise LaunchConfigError(f"-m {name!r}: no module named {top!r} in the cwd "
                                f"({os.getcwd()}) or on sys.path; check the name or PYTHONPATH")


def _with_default(help_: str, default: Any) -> str:
    """``help_`` plus ``(default: X)``; nothing added when the text already names its default
    or there is no value to show (an empty or unset default)."""
    if default in (None, "") or "default" in help_:
        return help_
    return f"{help_} (default: {default})"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(  # one-line errors (_core.cli)
        prog="trainguard launch", allow_abbrev=True,
        description="torchrun-compatible launcher with hang detection and fast in-job restart. "
                    "Every torchrun flag is also read from PET_<FLAG> (CLI > env > default).",
    )
    for opts, dest, default, kind, help_ in _TORCHRUN:
        if kind == "flag":
            parser.add_argument(*opts, dest=dest, action="store_true", default=None, help=help_)
        else:
            parser.add_argument(*opts, dest=dest, default=None, help=_with_default(help_, default))
    for flag, dest, default, help_ in _LEASE:
        parser.add_argument(flag, "--" + flag[2:].replace("-", "_"), dest=dest, default=None,
                            help=_with_default(help_, default))
    parser.add_argument("--ft-cfg-path", "--ft_cfg_path", dest="ft_cfg_path", default=None,
                        help="YAML file with a 'fault_tolerance:' section (any depth)")
    for name, help_ in _FT:
        flag = name.replace("_", "-")
        parser.add_argument(f"--ft-{flag}", f"--ft_{name}", dest=f"ft_{name}", default=None,
                            help=help_)
    _add_node_flags(parser)
    return parser


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    """Health checks, the health endpoint and --dry-run (see ``health`` and ``_identity``)."""
    parser.add_argument("--health-port", "--health_port", dest="health_port", default=None,
                        help="serve GET /health on this TCP port (a liveness probe; "
                             "env PET_HEALTH_PORT; default: off)")
    parser.add_argument("--ft-health-check", "--ft_health_check", dest="ft_health_check",
                        default=None, help="extra node health checks run before every cycle: "
                        "module:function,... ; 'off' skips every check, defaults included")
    parser.add_argument("--ft-health-check-timeout", "--ft_health_check_timeout",
                        dest="ft_health_check_timeout", default=None,
                        help="seconds all health checks of a cycle may take together (30)")
    parser.add_argument("--dry-run", "--print-env", dest="dry_run", action="store_true",
                        default=None, help="print the resolved identity, ranks, endpoint and run "
                        "id as JSON and exit 0 (nothing is started)")


def _split(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Split at the training script: launcher args before it, script args after (verbatim)."""
    takes_value = {s for a in parser._actions for s in a.option_strings
                   if a.nargs is None and not isinstance(a, argparse._StoreTrueAction)}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        if "=" not in arg and _expand(arg, takes_value, parser) in takes_value:
            i += 1  # the value of this flag
        i += 1
    return list(argv), []


def _expand(arg: str, takes_value: set[str], parser: argparse.ArgumentParser) -> str:
    if arg in takes_value:
        return arg
    matches = [s for a in parser._actions for s in a.option_strings if s.startswith(arg)]
    return matches[0] if len({_dest(parser, m) for m in matches}) == 1 else arg


def _dest(parser: argparse.ArgumentParser, opt: str) -> str:
    return next(a.dest for a in parser._actions if opt in a.option_strings)


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def parse_launch_args(argv: Sequence[str]) -> LaunchSpec:
    """Parse and validate ``argv`` (without the program name).

    Raises:
        LaunchConfigError: unknown or invalid flags, a missing script or config file.
        SystemExit: ``--help`` (exit 0).
    """
    parser = build_parser()
    launcher_args, rest = _split(argv, parser)
    ns, unknown = parser.parse_known_args(launcher_args)
    if unknown:
        raise LaunchConfigError(f"unknown launcher flag(s) {' '.join(unknown)}; see "
                                "'trainguard launch --help' (script flags go after the script)")
    if not rest:
        raise LaunchConfigError("no training script given: trainguard launch [flags] script.py "
                                "[script args]")
    values = {dest: _resolve(ns, dest, default, kind)
              for _, dest, default, kind, _ in _TORCHRUN}
    values["nnodes_source"] = _nnodes_default(ns, values)
    ft = _ft_config(ns)
    values["lease_s"], values["lease_interval_s"] = ns.lease_s, ns.lease_interval_s
    values.update(_node_values(ns))
    values["master_addr_given"] = ns.master_addr is not None or "PET_MASTER_ADDR" in os.environ
    values["identity"] = _identity(ns, values)
    return _spec(values, rest[0], tuple(rest[1:]), ft)


def _nnodes_default(ns: argparse.Namespace, values: dict[str, Any]) -> str:
    """Where ``--nnodes`` came from; takes ``SLURM_NNODES`` when neither the flag nor
    ``PET_NNODES`` was given (see ``_identity.slurm_nnodes``) and logs it."""
    if ns.nnodes is not None:
        return "--nnodes"
    if os.environ.get("PET_NNODES") is not None:
        return "PET_NNODES"
    slurm = slurm_nnodes(os.environ)
    if not slurm:
        return "default"
    values["nnodes"] = str(slurm)
    _log.info("--nnodes %d taken from SLURM_NNODES (one launcher per node); give --nnodes to "
              "override", slurm)
    return "SLURM_NNODES"


def _node_values(ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "health_port": _resolve(ns, "health_port", None, "int"),
        "dry_run": bool(_resolve(ns, "dry_run", False, "flag")),
        "health_check": str(ns.ft_health_check or "").strip(),
    }
    port = out["health_port"]
    if port is not None and not 0 < port < 65536:
        raise LaunchConfigError(f"--health-port must be 1..65535, got {port}")
    raw = ns.ft_health_check_timeout
    try:
        timeout = 30.0 if raw is None else float(raw)
    except ValueError:
        raise LaunchConfigError(f"--ft-health-check-timeout: {raw!r} is not seconds") from None
    if timeout <= 0:
        raise LaunchConfigError(f"--ft-health-check-timeout must be > 0 seconds, got {timeout}")
    out["health_check_timeout"] = timeout
    return out


def _identity(ns: argparse.Namespace, v: dict[str, Any]) -> NodeIdentity:
    """Node rank, run id and default rendezvous host from the CLI and the engine's env."""
    try:
        cli_rank = None if ns.node_rank is None else int(ns.node_rank)
    except ValueError:
        raise LaunchConfigError(f"--node-rank: {ns.node_rank!r} is not a valid int") from None
    endpoint = str(v["rdzv_endpoint"] or "")
    host: str | None = endpoint.rpartition(":")[0] or endpoint or None
    if host and "/" in host:
        host = None  # a file-store path (store_type=file): no host
    if host is None and (ns.master_addr is not None or os.environ.get("PET_MASTER_ADDR")):
        host = str(v["master_addr"])
    top = str(v["nnodes"]).split(":")[-1].strip()
    return resolve_identity(cli_rank, ns.rdzv_id, os.environ, host, os.getpid(),
                            int(top) if top.isdigit() else 1)


def _resolve(ns: argparse.Namespace, dest: str, default: Any, kind: str) -> Any:
    raw = getattr(ns, dest)
    if raw is None:
        raw = os.environ.get(f"PET_{dest.upper()}")
        if raw is None:
            return default
        if kind == "flag":
            return raw.strip().lower() in ("1", "true", "yes", "on")
    if kind == "flag":
        return bool(raw)
    try:
        return {"int": int, "float": float}.get(kind, str)(raw)
    except ValueError:
        flag = "--" + dest.replace("_", "-")
        raise LaunchConfigError(f"{flag}: {raw!r} is not a valid {kind}") from None


def _ft_config(ns: argparse.Namespace) -> FaultToleranceConfig:
    yaml_values = load_yaml_section(ns.ft_cfg_path) if ns.ft_cfg_path else {}
    cli = {name: getattr(ns, f"ft_{name}") for name, _ in _FT}
    return FaultToleranceConfig.merged(yaml_values, cli)


def _nproc(raw: str) -> int:
    text = str(raw).strip().lower()
    if text in ("cpu", "auto", "gpu"):
        if text != "cpu":
            try:
                import torch

                if torch.cuda.is_available():
                    return torch.cuda.device_count()
            except ImportError:
                pass
            if text == "gpu":
                raise LaunchConfigError("--nproc-per-node gpu: no CUDA device is available")
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise LaunchConfigError(f"--nproc-per-node: {raw!r} must be an integer, 'cpu', 'gpu' "
                                "or 'auto'") from None
    if value < 1:
        raise LaunchConfigError(f"--nproc-per-node must be >= 1, got {value}")
    return value


def _streams(flag: str, raw: str, nproc: int) -> dict[int, int]:
    """torchrun's Std spec: '3' for all ranks or '0:1,1:2' per local rank."""
    text = str(raw).strip()
    try:
        if ":" not in text:
            value = int(text)
            out = dict.fromkeys(range(nproc), value)
        else:
            out = {int(k): int(v) for k, v in (p.split(":") for p in text.split(","))}
    except ValueError:
        raise LaunchConfigError(f"{flag}: {raw!r} must be 0-3 or 'local_rank:0-3,...'") from None
    if any(v not in (0, 1, 2, 3) for v in out.values()):
        raise LaunchConfigError(f"{flag}: stream values are 0 none, 1 out, 2 err, 3 both")
    return out


def _spec(v: dict[str, Any], script: str, args: tuple[str, ...], ft: FaultToleranceConfig
          ) -> LaunchSpec:
    nmin, nmax = _nnodes(str(v["nnodes"]))
    backend = str(v["rdzv_backend"]).strip().lower()
    if nmax > 1 and backend == "static":
        backend = "trainguard"
    if backend not in ("static", "trainguard", "c10d"):
        raise LaunchConfigError(f"--rdzv-backend {backend!r}: use static (one node) or "
                                "trainguard/c10d (several nodes)")
    multinode = backend != "static"
    lease_s, interval_s = _lease(v.get("lease_s"), v.get("lease_interval_s"))
    nproc = _nproc(v["nproc_per_node"])
    if v["max_restarts"] < 0:
        raise LaunchConfigError(f"--max-restarts must be >= 0, got {v['max_restarts']}")
    if v["monitor_interval"] <= 0:
        raise LaunchConfigError(f"--monitor-interval must be > 0 seconds, got "
                                f"{v['monitor_interval']}")
    if not v["module"] and not v["no_python"] and not os.path.isfile(script):
        raise LaunchConfigError(f"training script {script!r} not found (cwd {os.getcwd()}); "
                                "use -m for a module")
    if v["module"] and not v["no_python"]:
        _check_module(script)
    master_port = v["master_port"]
    if master_port is not None and not 0 <= int(master_port) <= 65535:
        raise LaunchConfigError(f"--master-port {master_port}: a TCP port is 0-65535 (0 picks a "
                                "free one)")
    if not v["dry_run"]:
        _check_log_dir(v["log_dir"])
        _check_iteration_file(ft.checkpoint_iteration_file)
    rdzv_conf = _rdzv_conf(v["rdzv_conf"])
    endpoint = str(v["rdzv_endpoint"] or "")
    ident: NodeIdentity = v["identity"]
    if multinode and not endpoint and v.get("master_addr_given"):
        # torchrun's static shape (Kubeflow Trainer: PET_MASTER_ADDR/PORT): the store lives at
        # MASTER_ADDR:MASTER_PORT; workers get a fresh port on each round's rank-0 node
        endpoint = f"{v['master_addr']}:{master_port or _DEFAULT_RDZV_PORT}"
    elif multinode and not endpoint and ident.rdzv_host:
        # Slurm: the job's first node hosts the store on torchrun's c10d default port
        endpoint = f"{ident.rdzv_host}:{_DEFAULT_RDZV_PORT}"
    if multinode and not endpoint:
        raise LaunchConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (a TCP store) or "
                                "a shared file path with --rdzv-conf store_type=file")
    if endpoint and not v["standalone"] and not multinode:
        host, _, port = endpoint.rpartition(":")
        master_port = _endpoint(host or endpoint, port, master_port)
    filt = str(v["local_ranks_filter"]).strip()
    try:
        ranks = frozenset(int(r) for r in filt.split(",") if r.strip()) if filt else None
    except ValueError:
        raise LaunchConfigError(f"--local-ranks-filter: {filt!r} must be comma-separated "
                                "integers") from None
    shutdown = v["shutdown_timeout"]
    return LaunchSpec(
        nproc_per_node=nproc, max_restarts=int(v["max_restarts"]),
        monitor_interval_s=float(v["monitor_interval"]), role=str(v["role"]),
        run_id=ident.run_id, module=bool(v["module"]),
        no_python=bool(v["no_python"]), log_dir=v["log_dir"],
        redirects=_streams("--redirects", v["redirects"], nproc),
        tee=_streams("--tee", v["tee"], nproc), local_ranks_filter=ranks,
        node_rank=ident.node_rank or 0, master_addr=ident.rdzv_host or str(v["master_addr"]),
        master_port=master_port, virtual_local_rank=bool(v["virtual_local_rank"]),
        rdzv_timeout_s=rdzv_conf.get("timeout"),
        shutdown_timeout_s=float(shutdown) if shutdown is not None else None,
        signals_to_handle=_signal_names(str(v["signals_to_handle"])),
        script=script, script_args=args, ft=ft, nnodes_min=nmin, nnodes_max=nmax,
        node_rank_given=ident.node_rank is not None, rdzv_backend=backend,
        rdzv_endpoint=endpoint, rdzv_conf=_raw_conf(str(v["rdzv_conf"])),
        local_addr=v["local_addr"], lease_s=lease_s, lease_interval_s=interval_s,
        identity=ident, health_port=v["health_port"], health_check=v["health_check"],
        health_check_timeout_s=v["health_check_timeout"], dry_run=v["dry_run"],
        nnodes_source=str(v.get("nnodes_source", "default")))


def _nnodes(raw: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (MIN, MAX)."""
    lo, _, hi = raw.strip().partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchConfigError(f"--nnodes {raw!r}: use a number of nodes or MIN:MAX") from None
    if nmin < 1 or nmax < nmin:
        raise LaunchConfigError(f"--nnodes {raw!r}: need 1 <= MIN <= MAX")
    return nmin, nmax


def _lease(lease: Any, interval: Any) -> tuple[float, float]:
    try:
        lease_s = float(lease) if lease is not None else 5.0
        interval_s = float(interval) if interval is not None else lease_s / 5
    except ValueError:
        raise LaunchConfigError("--ft-lease-s / --ft-lease-interval-s take seconds") from None
    if not 0 < interval_s < lease_s:
        raise LaunchConfigError(f"--ft-lease-interval-s {interval_s:g} must be > 0 and below "
                                f"--ft-lease-s {lease_s:g}")
    return lease_s, interval_s


def _raw_conf(raw: str) -> tuple[tuple[str, str], ...]:
    """``--rdzv-conf`` as (key, value) pairs, values verbatim (validated where used)."""
    out = []
    for part in raw.split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            out.append((key.strip(), value.strip()))
    return tuple(out)


def _signal_names(raw: str) -> tuple[str, ...]:
    from trainguard.fault_tolerance.config import signal_number

    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    for name in names:
        signal_number(name)  # raises LaunchConfigError for an unknown name
    return names


def _rdzv_conf(raw: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in str(raw or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise LaunchConfigError(f"--rdzv-conf: {part!r} must be key=value")
        if key.strip() in ("timeout", "join_timeout", "last_call_timeout", "close_timeout"):
            try:
                out[key.strip()] = float(value)
            except ValueError:
                raise LaunchConfigError(f"--rdzv-conf {key}: {value!r} is not seconds") from None
    return out


def _check_log_dir(log_dir: str | None) -> None:
    """``--log-dir`` must be a directory this process can create and write (checked up front:
    the launcher makes ``<log-dir>/<run-id>/`` only after the rendezvous)."""
    if log_dir is None:
        return
    path = os.path.abspath(log_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise LaunchConfigError(f"--log-dir {log_dir!r}: cannot create or write it (it is a "
                                "file, not a directory); choose a writable directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".trainguard_probe_{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise LaunchConfigError(f"--log-dir {log_dir!r}: cannot create or write it "
                                f"({exc.strerror or exc}); choose a writable directory") from None


def _check_iteration_file(path: str | None) -> None:
    """``--ft-checkpoint-iteration-file`` is read (after the workers write it): it must not be a
    directory, and its directory must exist or be creatable, and be writable (checked up front:
    a bad path is a bad input, exit 2, not an unhealthy node)."""
    if not path:
        return
    flag = "--ft-checkpoint-iteration-file"
    if os.path.isdir(path):
        raise LaunchConfigError(f"{flag} {path!r} is a directory; name a file in it")
    try:
        _check_log_dir(os.path.dirname(os.path.abspath(path)))
    except LaunchConfigError as exc:
        raise LaunchConfigError(str(exc).replace("--log-dir", f"{flag}: directory", 1)
                                .replace("choose a writable directory",
                                         "name a file in a writable directory")) from None


def _endpoint(host: str, port: str, master_port: int | None) -> int | None:
    """A single-node endpoint must be local: its port becomes MASTER_PORT (0 = pick one)."""
    import socket

    try:
        port_n = int(port) if port else 29400
    except ValueError:
        raise LaunchConfigError(f"--rdzv-endpoint: port {port!r} is not a number") from None
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise LaunchConfigError(f"--rdzv-endpoint: cannot resolve {host!r} ({exc}); check the "
                                "host name") from None
    local = {"127.0.0.1", "::1", "0.0.0.0"}
    try:
        local.update(str(i[4][0]) for i in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    if not any(str(i[4][0]) in local or str(i[4][0]).startswith("127.") for i in infos):
        raise LaunchConfigError(f"--rdzv-endpoint {host}:{port}: not an address of this machine; "
                                "a single-node job hosts its own store (use --standalone)")
    return master_port if port_n == 0 else (master_port or port_n)
