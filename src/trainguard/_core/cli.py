"""The one argument parser of every trainguard command line: bad input gives ONE line.

``argparse``'s own ``error()`` prints the whole usage block before the message, which buries the
one thing the user must fix. :class:`ArgumentParser` prints only::

    trainguard demo: error: argument --steps: '-1' must be >= 1; see 'trainguard demo --help'

and exits with status 2 (argparse's, and torchrun's, exit status for bad arguments). Sub-command
parsers made with ``add_subparsers().add_parser`` are of the same class (argparse passes its own
type on), so one parser at the top covers every sub-command.

Follows: ``argparse.ArgumentParser``; difference: no usage block on error, a pointer to
``--help`` instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["EXIT_USAGE", "ArgumentParser", "usage_error"]

EXIT_USAGE = 2  # bad arguments: argparse's exit status


def usage_error(prog: str, message: str) -> NoReturn:
    """Print ``PROG: error: MESSAGE; see 'PROG --help'`` as one line on stderr and exit 2.

    Raises:
        SystemExit: always, with code 2.
    """
    text = " ".join(str(message).split())  # one line, whatever the message held
    sys.stderr.write(f"{prog}: error: {text}; see '{prog} --help'\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_USAGE)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (see the module docstring)."""

    def error(self, message: str) -> NoReturn:
        """Report bad input as one line on stderr and exit 2 (never returns).

        Raises:
            SystemExit: always, with code 2.
        """
        usage_error(self.prog, message)
