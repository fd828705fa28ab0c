import subprocess
import sys

import trainguard
from trainguard.errors import ConfigError, TrainguardError, TrainguardTimeout


def test_error_tree():
    assert issubclass(TrainguardTimeout, TimeoutError)
    assert issubclass(TrainguardTimeout, TrainguardError)
    assert issubclass(ConfigError, ValueError)
    assert sorted(trainguard.__all__) == trainguard.__all__


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "trainguard" in out.stdout
