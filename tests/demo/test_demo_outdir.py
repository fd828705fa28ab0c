"""The demo's output directory: only an empty, new or demo-made (marked) directory is cleared;
anything else is refused with exit status 2 and a one-line error, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard._demo._config import MARKER, RUN_FILES, OutputDirError, clear_run_files
from trainguard.cli import main

# a previous run's files and the user's own: names that clash with the demo's run files
_USER_FILES = {"config.json": "{\"mine\": 1}", "summary.json": "precious", "notes.txt": "keep me",
               "logs/train.log": "my log", "checkpoints/model.pt": "weights", "data.npz": "data"}


def _populate(root: Path) -> None:
    for name, text in _USER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _contents(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


def _demo(capsys, *args: str) -> tuple[int, str]:
    """Run ``trainguard demo`` in this process; returns (exit status, stderr)."""
    try:
        code = main(["demo", *args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_a_foreign_non_empty_dir_is_refused_and_left_untouched(tmp_path):
    _populate(tmp_path)
    before = _contents(tmp_path)
    with pytest.raises(OutputDirError, match="choose an empty or new directory") as info:
        clear_run_files(tmp_path)
    assert str(tmp_path) in str(info.value) and MARKER in str(info.value)
    assert _contents(tmp_path) == before
    assert not (tmp_path / MARKER).exists()


@pytest.mark.timeout(60)
def test_the_cli_refuses_a_foreign_dir_with_exit_2(tmp_path, capsys):
    _populate(tmp_path)
    before = _contents(tmp_path)
    code, err = _demo(capsys, "--output-dir", str(tmp_path))
    print(err)
    assert code == 2
    assert err.startswith(f"trainguard demo: error: output dir '{tmp_path}' is not empty")
    assert "--output-dir" in err and "Traceback" not in err
    assert _contents(tmp_path) == before


def test_new_and_empty_dirs_are_marked_and_a_marked_dir_is_cleared(tmp_path):
    new = tmp_path / "a" / "b"
    clear_run_files(new)
    assert (new / MARKER).is_file() and (new / "events").is_dir()
    empty = tmp_path / "empty"
    empty.mkdir()
    clear_run_files(empty)
    assert (empty / MARKER).is_file()
    # a second run into the marked dir: the previous run's files go, others stay
    _populate(new)
    clear_run_files(new)
    left = _contents(new)
    assert left.pop("notes.txt") == "keep me" and MARKER in left
    assert not any(name.split("/")[0] in RUN_FILES for name in left)
    assert sorted(p.name for p in new.iterdir() if p.is_dir()) == [
        "events",
        "logs",
        "markers",
        "pids",
    ]


def _unusable(tmp_path: Path, case: str) -> Path:
    afile = tmp_path / "afile"
    afile.write_text("x")
    return {
        "existing file": afile,
        "under a file": afile / "sub",
        "/proc": Path("/proc/trainguard-demo-test"),
        "/sys": Path("/sys/trainguard-demo-test"),
    }[case]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case, reason",
    [
        ("existing file", "is not a directory"),
        ("under a file", "Not a directory"),
        ("/proc", "No such file or directory"),
        ("/sys", "not permitted" if os.geteuid() == 0 else "Permission denied"),
    ],
)
def test_unusable_output_dirs_exit_2_with_the_reason(tmp_path, capsys, case, reason):
    path = _unusable(tmp_path, case)
    code, err = _demo(capsys, "--output-dir", str(path))
    print(err)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"trainguard demo: error: cannot use output dir '{path}': ")
    assert reason in err


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_dir_exits_2(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, err = _demo(capsys, "--output-dir", str(ro / "out"))
    finally:
        ro.chmod(0o700)
    assert code == 2 and "Permission denied" in err and "Traceback" not in err


@pytest.mark.timeout(60)
def test_a_read_only_filesystem_exits_2(tmp_path):
    """A read-only bind mount where the machine allows one (root in a private mount namespace)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    script = (
        f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && "
        f"exec {sys.executable} -m trainguard demo --output-dir {ro}/out"
    )
    try:
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            check=False,
            capture_output=True,
            text=True,
            timeout=50,
        )
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if "trainguard demo" not in proc.stderr:
        pytest.skip(f"cannot make a read-only mount here: {proc.stderr.strip()[-200:]}")
    print(proc.stderr)
    assert proc.returncode == 2 and "Read-only file system" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "abc"], "argument --steps: 'abc' is not an integer"),
        (["--seed", "1.5"], "argument --seed: '1.5' is not an integer"),
        (["--soft-timeout", "soon"], "argument --soft-timeout: 'soon' is not a number"),
        (["--hard-timeout", "nan"], "--hard-timeout: must be >= 1 seconds (got 'nan')"),
    ],
)
def test_argument_errors_read_well(tmp_path, capsys, args, message):
    code, err = _demo(capsys, *args, "--output-dir", str(tmp_path / "out"))
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()
