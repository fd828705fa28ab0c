"""``trainguard store --port P [--host H]``: a standalone rendezvous store (a c10d ``TCPStore``
server) for multi-node jobs, run outside the training nodes (a Slurm login or service node, a
Kubernetes Deployment behind a Service) so losing a training node never loses the store.

Prints ``trainguard store: listening on HOST:PORT`` once it accepts connections, then serves
until SIGTERM or SIGINT (exit 0). A port that cannot be bound: one line on stderr, exit 2.

Follows: NVRx ``nvrx-control`` (a separate store process); differences: plain ``TCPStore``, no
other state, so any ``trainguard launch --rdzv-endpoint HOST:PORT`` can use it.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
from typing import Any

__all__ = ["register", "serve"]


def register(sub: Any) -> list[str]:
    parser = sub.add_parser("store", help="standalone rendezvous store for multi-node launches",
                            description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True,
                        help="TCP port to listen on (0: a free port, printed)")
    parser.add_argument("--host", default="0.0.0.0",
                        help="address clients use to reach it; it listens on all (default "
                             "0.0.0.0)")
    parser.set_defaults(func=_run)
    return ["store"]


def serve(host: str, port: int) -> int:
    """Serve a ``TCPStore`` on ``port`` until SIGTERM/SIGINT; returns the exit code (blocks
    until a signal arrives)."""
    if not 0 <= port < 65536:
        print(f"trainguard store: error: --port {port} must be 0-65535", file=sys.stderr)
        return 2
    import torch.distributed as dist

    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=30))
    except (RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0][:200]
        print(f"trainguard store: error: cannot listen on port {port} ({first}); pick a free "
              "port", file=sys.stderr)
        return 2
    print(f"trainguard store: listening on {host}:{server.port}", flush=True)
    got = signal.sigwait(signals)
    print(f"trainguard store: {signal.Signals(got).name}, stopping", flush=True)
    del server
    return 0


def _run(args: argparse.Namespace) -> int:
    return serve(args.host, args.port)
