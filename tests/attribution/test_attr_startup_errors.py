"""``trainguard attrsvc`` startup errors: validated before "listening" is printed, one line
naming the fix, exit status 2, no traceback."""

from __future__ import annotations

import os

import pytest

from trainguard.cli import main


def _run(capsys, *extra):
    rc = main(["attrsvc", "--allow-anonymous", *extra])
    err = capsys.readouterr().err
    return rc, err


def _one_clean_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "listening" not in err, err
    return lines[0]


def test_port_out_of_range(capsys, tmp_path):
    rc, err = _run(capsys, "--allowed-root", str(tmp_path), "--port", "99999")
    line = _one_clean_line(err)
    assert rc == 2 and "--port 99999" in line and "1-65535" in line


def test_db_not_sqlite(capsys, tmp_path):
    bad = tmp_path / "notes.db"
    bad.write_text("this is a text file, not an SQLite database\n" * 20)
    rc, err = _run(capsys, "--allowed-root", str(tmp_path), "--port", "0",
                   "--db", f"sqlite:///{bad}")
    line = _one_clean_line(err)
    assert rc == 2 and str(bad) in line and "--db" in line and "writable" in line
    assert bad.read_text().startswith("this is a text file")  # left untouched


def test_db_location_cannot_be_created(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, err = _run(capsys, "--allowed-root", str(tmp_path), "--port", "0",
                   "--db", f"sqlite:///{blocker}/sub/attrsvc.db")
    line = _one_clean_line(err)
    assert rc == 2 and "--db" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_db_read_only_directory(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, err = _run(capsys, "--allowed-root", str(tmp_path), "--port", "0",
                       "--db", f"sqlite:///{ro}/attrsvc.db")
    finally:
        ro.chmod(0o755)
    line = _one_clean_line(err)
    assert rc == 2 and "--db" in line
