"""``trainguard launch`` / ``python -m trainguard.fault_tolerance.launcher``: a torchrun drop-in
with hang detection and fast in-job restart, on one node or several (``--nnodes MIN:MAX``).

Exit codes (for schedulers):

* ``0``   every worker of the final cycle exited 0 (also after a forwarded SIGTERM when every
  worker exited 0);
* ``1``   a cycle failed and ``--max-restarts`` is used up (requeueing may help);
* ``2``   bad input (unknown flag, invalid value, missing script or config, port in use); one
  line on stderr says what and how to fix it;
* ``93``  (``--ft-no-restart-exit-code``) do not requeue: no progress for
  ``--ft-max-no-progress-cycles`` cycles, an attribution STOP verdict with
  ``--ft-attribution-stop-action no-restart``, a rank that never connected to its monitor
  although client timeouts are configured, or a workload-control shutdown request;
* ``75``  several nodes: store lost: this node could not renew its lease on the rendezvous
  store for ``--ft-lease-s`` and stopped its workers (self-fence; requeue ok). With several
  nodes, ``1`` also means too few nodes within the join timeout or this node was excluded, and
  ``2`` a duplicate node identity or ``--nnodes`` different from the job's (see ``_multinode``);
* ``128+N`` the launcher was stopped by signal N (forwarded to every worker, with
  ``--ft-term-timeout`` seconds of grace per rank before SIGKILL).

Follows: ``torchrun`` (torch 2.13 flags, ``PET_*`` variables, worker environment) and NVRx
``ft_launcher`` (``--ft-*`` options, exit code 93); see ``_args`` and ``config`` for differences.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from trainguard.fault_tolerance.errors import LaunchConfigError, LauncherError

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
        check_master_port(spec)
    except LaunchConfigError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
        return Launcher(spec).run()
    except LaunchConfigError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LauncherError as exc:
        print(f"trainguard launch: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
