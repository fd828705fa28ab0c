"""``python -m trainguard._demo [flags]``: the same as ``trainguard demo [flags]``."""

import sys

from trainguard.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
