"""``trainguard launch`` / ``python -m trainguard.fault_tolerance.launcher``: a torchrun drop-in
with hang detection and fast in-job restart, on one node or several (``--nnodes MIN:MAX``).

Exit codes (for schedulers; requeue = Slurm ``--requeue`` / a Kubernetes restart may help;
examples/slurm and examples/kubernetes key their policies on exactly these values, and
tests/fault_tolerance/test_ft_deploy_examples.py keeps them in sync):

* ``0``   every worker of the final cycle exited 0 (also after a forwarded SIGTERM when every
  worker exited 0);
* ``1``   a cycle failed and ``--max-restarts`` is used up (requeueing may help);
* ``2``   bad input (unknown flag, invalid value, missing script or config, port in use, a
  loopback endpoint on a multi-node Slurm/Kubernetes job, several launchers on one Slurm node,
  a ``--ft-health-check`` that cannot be loaded); one line on stderr says what and how to fix it;
* ``93``  (``--ft-no-restart-exit-code``) do not requeue: no progress for
  ``--ft-max-no-progress-cycles`` cycles, an attribution STOP verdict with
  ``--ft-attribution-stop-action no-restart``, a rank that never connected to its monitor
  although client timeouts are configured, or a workload-control shutdown request; several
  nodes: more node failures than ``--ft-max-node-failures`` (every launcher exits 93);
* ``75``  (``errors.EXIT_STORE_LOST``, EX_TEMPFAIL) several nodes: store lost: this node could
  not renew its lease on the rendezvous store for ``--ft-lease-s`` and stopped its workers
  (self-fence; requeue ok). With several nodes, ``1`` also means too few nodes within the join
  timeout or this node was excluded, and ``2`` a duplicate node identity or ``--nnodes``
  different from the job's (see ``_multinode``);
* ``95``  (``errors.EXIT_UNHEALTHY``) this node failed its pre-cycle health checks
  (``trainguard.fault_tolerance.health``); requeue OK, preferably on another node;
* ``128+N`` the launcher was stopped by signal N (forwarded to every worker, with
  ``--ft-term-timeout`` seconds of grace per rank before SIGKILL).

Follows: ``torchrun`` (torch 2.13 flags, ``PET_*`` variables, worker environment) and NVRx
``ft_launcher`` (``--ft-*`` options, exit code 93); see ``_args`` and ``config`` for differences.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainguard.fault_tolerance.errors import (
    EXIT_STORE_LOST,
    EXIT_UNHEALTHY,
    LaunchConfigError,
    LauncherError,
)

if TYPE_CHECKING:
    from trainguard.fault_tolerance._args import LaunchSpec

__all__ = ["EXIT_BAD_INPUT", "main"]

EXIT_BAD_INPUT = 2


def _configure_logging() -> None:
    log = logging.getLogger("trainguard.fault_tolerance")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[trainguard launch %(asctime)s] %(levelname)s "
                                               "%(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the job, return the exit code."""
    from trainguard.fault_tolerance._agent import Launcher, check_master_port
    from trainguard.fault_tolerance._args import parse_launch_args
    from trainguard.fault_tolerance.config import check_timeout_chain

    _configure_logging()
    log = logging.getLogger("trainguard.fault_tolerance")
    try:
        spec = parse_launch_args(list(sys.argv[1:] if argv is None else argv))
        if not spec.dry_run:
            check_master_port(spec)
    except LaunchConfigError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if spec.dry_run:
        try:
            print(json.dumps(dry_run_report(spec), indent=1))
        except LaunchConfigError as exc:
            print(f"trainguard launch: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return 0
    for line in check_timeout_chain(spec.ft, spec.rdzv_timeout_s):
        log.warning("timeout chain: %s", line)
    try:
        if spec.multinode:
            if "TORCH_CPP_LOG_LEVEL" not in os.environ:  # before torch loads: no C++ stack
                os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # dumps per store retry
                os.environ["TRAINGUARD_QUIET_CPP"] = "1"  # (workers get the default back)
            from trainguard.fault_tolerance._multinode import MultiNodeLauncher

            code = MultiNodeLauncher(spec).run()
            # Every child is reaped by now; a store client thread blocked on a dead link (or
            # still retrying a refused connection) must not delay the exit by seconds.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        launcher = Launcher(spec)
    except LaunchConfigError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LauncherError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return 1
    try:
        return launcher.run()
    except LauncherError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return 1


def dry_run_report(spec: LaunchSpec) -> dict[str, Any]:
    """What ``--dry-run`` prints: the resolved identity, ranks, endpoint, run id, health options
    and the exit-code contract. Starts nothing; loads ``--ft-health-check`` hooks to validate
    them.

    Raises:
        LaunchConfigError: a ``--ft-health-check`` hook cannot be loaded.
    """
    from trainguard.fault_tolerance.health import launch_checks

    ident = spec.identity
    node_rank = ident.node_rank if ident is not None else spec.node_rank
    nproc = spec.nproc_per_node
    run_dir = os.path.join(spec.log_dir, spec.run_id) if spec.log_dir else tempfile.gettempdir()
    ckpt = spec.ft.checkpoint_iteration_file
    dirs = [run_dir] + ([os.path.dirname(os.path.abspath(ckpt))] if ckpt else [])
    checks = launch_checks(spec.health_check, dirs, nproc)  # listed, not run
    return {
        "node_rank": node_rank,
        "node_rank_source": ident.source if ident else "--node-rank",
        "nproc_per_node": nproc,
        "ranks": None if node_rank is None else list(range(node_rank * nproc,
                                                          (node_rank + 1) * nproc)),
        "local_ranks": list(range(nproc)),
        "nnodes": f"{spec.nnodes_min}:{spec.nnodes_max}",
        "nnodes_source": spec.nnodes_source,
        "rdzv_backend": spec.rdzv_backend,
        "rdzv_endpoint": spec.rdzv_endpoint or None,
        "rdzv_store_type": dict(spec.rdzv_conf).get("store_type", "tcp")
        if spec.multinode else None,
        # multi-node: each round's group-rank-0 node picks MASTER_ADDR/PORT (not known yet)
        "master_addr": None if spec.multinode else spec.master_addr,
        "master_port": None if spec.multinode else spec.master_port,
        "master_addr_note": "decided at rendezvous: group rank 0's node, fresh port each round"
        if spec.multinode else "this node",
        "rdzv_host_source": (ident.rdzv_host_source if ident else "") or "flag/env/default",
        "run_id": spec.run_id,
        "run_id_source": ident.run_id_source if ident else "--rdzv-id",
        "scheduler": ident.scheduler if ident else "none",
        "hosts": list(ident.hosts) if ident else [],
        "env_nnodes": ident.env_nnodes if ident else 0,
        "max_restarts": spec.max_restarts,
        "health_port": spec.health_port,
        "health_checks": [str(getattr(c, "name", c)) for c in checks],
        "exit_codes": {"done": 0, "failed": 1, "bad_input": EXIT_BAD_INPUT,
                       "no_restart": spec.ft.no_restart_exit_code,
                       "store_lost": EXIT_STORE_LOST, "unhealthy": EXIT_UNHEALTHY},
    }


if __name__ == "__main__":
    sys.exit(main())
