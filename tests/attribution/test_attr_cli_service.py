"""``trainguard attrsvc`` as a real process: starts, serves, stops on SIGTERM, is reaped."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from trainguard._core.clock import wait_until
from trainguard._core.procs import terminate_processes
from trainguard.testing import free_port


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(90)
def test_attrsvc_process(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("cli-key\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.log").write_text("slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT "
                                             "2024-01-01T00:00:00 DUE TO TIME LIMIT ***\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "attrsvc", "--port", str(port), "--allowed-root",
         str(tmp_path / "logs"), "--api-key-file", str(keyfile), "--db",
         f"sqlite:///{tmp_path / 'svc.db'}", "--jsonl", str(tmp_path / "out.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _up(url) or proc.poll() is not None, 45, 0.2), "no startup"
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        from trainguard.attribution import AttributionClient

        with AttributionClient(url, "cli-key") as client:
            rec = client.wait(client.submit("j", [str(tmp_path / "logs" / "a.log")])["id"], 30)
        assert rec["decision"] == "RESTART"
        assert rec["result"]["analysis"]["primary_category"] == "time_limit"
    finally:
        terminate_processes([proc], grace_s=10)
    assert proc.returncode is not None
    assert '"time_limit"' in (tmp_path / "out.jsonl").read_text()


def test_attrsvc_refuses_to_start_without_key(tmp_path, capsys, monkeypatch):
    from trainguard.cli import main

    monkeypatch.delenv("TRAINGUARD_ATTRSVC_API_KEYS", raising=False)
    assert main(["attrsvc", "--allowed-root", str(tmp_path)]) == 2
    assert "API key" in capsys.readouterr().err
