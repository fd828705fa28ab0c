"""Bad input on every ``trainguard`` command line gives ONE line naming the problem and the
``--help`` to read, and exit status 2 (``_core.cli.ArgumentParser``); never argparse's usage
block, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainguard.cli import main

CASES = [  # argv, the program named in the message, what the message must say
    (["--bogus"], "trainguard", "unrecognized arguments: --bogus"),
    (["nosuch"], "trainguard", "invalid choice: 'nosuch'"),
    (["demo", "--bogus"], "trainguard demo", "unrecognized arguments: --bogus"),
    (["demo", "--steps", "-1"], "trainguard demo", "--steps: must be >= 1 (got '-1')"),
    (["demo", "--duration", "x"], "trainguard demo", "--duration: 'x' is not a number of seconds"),
    (["analyze", "--bogus"], "trainguard analyze", "unrecognized arguments: --bogus"),
    (["attrsvc", "--allowed-root", ".", "--port", "x"], "trainguard attrsvc", "--port"),
    (["attrsvc", "--allowed-root", ".", "--bogus"], "trainguard attrsvc", "--bogus"),
    (["store", "--bogus"], "trainguard store", "--port"),
    (["straggler", "--bogus"], "trainguard straggler", "unrecognized arguments: --bogus"),
    (["straggler", "report", "run", "--bogus"], "trainguard straggler report",
     "unrecognized arguments: --bogus"),
    (["launch", "--bogus", "t.py"], "trainguard launch", "--bogus"),
    (["launch", "--nnodes"], "trainguard launch", "--nnodes: expected one argument"),
]


@pytest.mark.parametrize(("argv", "prog", "says"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flag_or_value_is_one_line_and_exit_2(argv, prog, says, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    print(repr(err))
    assert code == 2, (code, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    assert says in lines[0] and "--help" in lines[0], err
    assert "usage:" not in err and "Traceback" not in err


def test_python_m_demo_is_the_demo_cli_with_one_line_errors():
    r = subprocess.run([sys.executable, "-m", "trainguard._demo", "--duration", "-1"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    want = ("trainguard demo: error: argument --duration: must be >= 20 seconds (got '-1'); "
            "see 'trainguard demo --help'")
    assert r.stderr.splitlines() == [want], r.stderr
