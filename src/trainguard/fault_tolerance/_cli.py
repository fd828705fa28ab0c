"""``trainguard launch`` sub-command (the arguments are parsed by the launcher itself)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> list[str]:
    parser = sub.add_parser("launch", add_help=False,
                            help="torchrun-compatible launcher with hang detection and restart")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    parser.set_defaults(func=_run)
    return ["launch"]


def _run(args: argparse.Namespace) -> int:
    from trainguard.fault_tolerance.launcher import main

    return main(args.rest)
