"""``trainguard`` command line: one sub-command per capability.

Each capability contributes its sub-commands through a ``_cli.register(subparsers)`` function in
its own package, imported lazily so ``trainguard --help`` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from trainguard._core.cli import ArgumentParser

# sub-command name -> module holding ``register(subparsers)``; registering imports only
# argparse code.
_COMMANDS: dict[str, str] = {
    "demo": "trainguard._demo.cli",
    "launch": "trainguard.fault_tolerance._cli",
    "store": "trainguard.fault_tolerance._store_cli",
    "analyze": "trainguard.attribution._cli",
    "attrsvc": "trainguard.attribution._cli",
    "straggler": "trainguard.straggler._cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(  # one-line errors, sub-commands included (_core.cli)
        prog="trainguard",
        description="Fault tolerance for PyTorch distributed training and inference.",
    )
    from trainguard import __version__

    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for module_name in dict.fromkeys(_COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # capability not built yet
            raise
        for name in module.register(sub):
            seen.add(name)
    return parser


def _innermost(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)sub-command parser ``args`` was parsed by."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if not subs or chosen not in subs[0].choices:
            return parser
        parser = subs[0].choices[chosen]


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["launch"]:  # parsed by the launcher itself: script flags stay verbatim
        from trainguard.fault_tolerance.launcher import main as launch_main

        return launch_main(args_in[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(args_in)
    if extra:  # named by the sub-command that got them, with its --help
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
