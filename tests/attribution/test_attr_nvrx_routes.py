"""NVRx's launcher client against ``trainguard attrsvc``: ``POST/GET /logs`` over the same
pipeline, NVRx's names and actions, authentication by URL key or trusted loopback."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from attr_data import LOGS

from trainguard.attribution._nvrx_routes import nvrx_action

KEY = "k-secret-1"


def _copy(root, name):
    dst = root / name
    shutil.copy(LOGS / name, dst)
    return str(dst)


def test_terminal_post_then_get_matches_native_verdict(start_server, attr_root):
    srv = start_server()
    log = _copy(attr_root, "run_01.log")
    base = f"{srv.url}/k/{KEY}"
    r = httpx.post(base + "/logs", json={"log_path": log, "user": "alice", "job_id": "4711",
                                         "cycle_id": 0, "analysis_intent": "terminal"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["submitted"] is True and body["normalized_path"] == os.path.realpath(log)
    assert body["mode"] == "single"
    r = httpx.get(base + "/logs", params={"log_path": log, "wait": "true"}, timeout=90)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["status"] == "completed"
    assert got["result"]["primary_category"] == "collective_timeout"
    native = httpx.get(f"{srv.url}/v1/jobs/4711/analyses", headers={"X-API-Key": KEY}).json()
    decision = native["analyses"][0]["decision"]
    assert got["recommendation"]["action"] == nvrx_action(decision, None)[0] == "RESTART"
    assert got["recommendation"]["source"] == "trainguard"


def test_progressive_is_acknowledged_without_analysis(start_server, attr_root):
    srv = start_server()
    log = _copy(attr_root, "run_03.log")
    base = f"{srv.url}/k/{KEY}"
    r = httpx.post(base + "/logs", json={"log_path": log, "analysis_intent": "progressive"})
    assert r.status_code == 200 and r.json()["submitted"] is True
    r = httpx.get(base + "/logs", params={"log_path": log, "wait": "false"})
    assert r.status_code == 404 and r.json()["error_code"] == "not_found"
    jobs = httpx.get(f"{srv.url}/metrics").text
    assert "submitted_total" not in jobs  # nothing reached the pipeline


def test_auth_url_key_or_trusted_loopback(start_server, attr_root):
    srv = start_server()
    log = _copy(attr_root, "run_03.log")
    body = {"log_path": log, "analysis_intent": "terminal"}
    r = httpx.post(srv.url + "/logs", json=body)
    assert r.status_code == 401 and "/k/" in r.json()["message"]
    r = httpx.post(srv.url + "/k/wrong-key/logs", json=body)
    assert r.status_code == 401
    r = httpx.get(srv.url + "/logs", params={"log_path": log})
    assert r.status_code == 401
    trusted = start_server(nvrx_trust_loopback=True, db_url="sqlite:///:memory:")
    r = httpx.post(trusted.url + "/logs", json=body)
    assert r.status_code == 200, r.text
    r = httpx.get(trusted.url + "/logs", params={"log_path": log, "wait": "true"}, timeout=90)
    assert r.json()["status"] == "completed"
    assert r.json()["recommendation"]["action"] in ("RESTART", "STOP")


def test_bad_requests_use_the_error_body(start_server, attr_root):
    srv = start_server()
    log = _copy(attr_root, "run_03.log")
    base = f"{srv.url}/k/{KEY}"
    r = httpx.post(base + "/logs", json={"log_path": log, "cycle_id": True})
    assert r.status_code == 422 and r.json()["error_code"] == "invalid_request"
    r = httpx.post(base + "/logs", json={"log_path": log, "analysis_intent": "sometimes"})
    assert r.status_code == 422
    r = httpx.post(base + "/logs", json={"log_path": "/etc/passwd"})
    assert (r.status_code, r.json()["error_code"]) == (403, "outside_root")


@pytest.mark.parametrize(("decision", "action"), [
    ("STOP", "STOP"), ("RESTART", "RESTART"), ("RESTART_EXCLUDE_NODES", "RESTART"),
    ("CONTINUE", "RESTART"), (None, "UNKNOWN")])
def test_action_mapping(decision, action):
    got, reason = nvrx_action(decision, "node n7 ECC")
    assert got == action
    if decision == "RESTART_EXCLUDE_NODES":
        assert "RESTART_EXCLUDE_NODES" in reason and "n7" in reason


NVRX_PYTHON = os.environ.get("NVRX_PYTHON", "/work/nvrx-venv/bin/python")


def _nvrx_client_available() -> bool:
    if not os.path.exists(NVRX_PYTHON):
        return False
    probe = ("import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("
             "'nvidia_resiliency_ext.fault_tolerance.attribution_manager') else 1)")
    return subprocess.run([NVRX_PYTHON, "-c", probe], check=False, timeout=60).returncode == 0


@pytest.mark.skipif(not _nvrx_client_available(),
                    reason="NVRx with its launcher attribution client is not installed "
                    "(set NVRX_PYTHON to a python with nvidia-resiliency-ext >= the release "
                    "that ships fault_tolerance/attribution_manager.py)")
def test_nvrx_client_module_reaches_our_routes(start_server, attr_root):
    srv = start_server(nvrx_trust_loopback=True)
    log = _copy(attr_root, "run_01.log")
    script = ("import json, sys, urllib.request\n"
              "url = sys.argv[1]\n"
              "req = urllib.request.Request(url + '/logs', method='POST', data=json.dumps("
              "{'log_path': sys.argv[2], 'analysis_intent': 'terminal'}).encode(), "
              "headers={'Content-Type': 'application/json'})\n"
              "print(urllib.request.urlopen(req, timeout=30).status)\n")
    out = subprocess.run([NVRX_PYTHON, "-c", script, srv.url, log], check=False,
                         capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "200", out.stderr
