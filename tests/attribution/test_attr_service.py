"""Attribution service over a real uvicorn server: auth, allow-list, limits, coalescing,
persistence, history-driven decisions, metrics, and the client."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest
from attr_data import FR, LOGS

from trainguard.attribution import AttributionClient, ServiceConfig, ServiceError
from trainguard.errors import ConfigError

KEY = {"X-API-Key": "k-secret-1"}


def _copy(root, name):
    dst = root / name
    shutil.copy(LOGS / name, dst)
    return str(dst)


def test_health_openapi_and_auth(start_server, attr_root):
    srv = start_server()
    log = _copy(attr_root, "run_03.log")
    assert httpx.get(srv.url + "/healthz").json() == {"status": "ok"}
    assert "/v1/analyses" in httpx.get(srv.url + "/openapi.json").json()["paths"]
    body = {"job_id": "j1", "log_paths": [log]}
    r = httpx.post(srv.url + "/v1/analyses", json=body)
    assert r.status_code == 401 and r.json()["error_code"] == "unauthorized"
    r = httpx.post(srv.url + "/v1/analyses", json=body, headers={"X-API-Key": "k-secret-2"})
    assert r.status_code == 401
    r = httpx.post(srv.url + "/v1/analyses", json=body,
                   headers={"Authorization": "Bearer k-secret-1"})
    assert r.status_code == 202, r.text


def test_path_allow_list(start_server, attr_root, tmp_path):
    srv = start_server()
    outside = tmp_path / "secret.log"
    outside.write_text("CUDA out of memory\n")
    os.symlink(outside, attr_root / "link.log")
    (attr_root / "sub").mkdir()
    cases = [
        ("/etc/passwd", 403, "outside_root"),
        (str(attr_root / ".." / "secret.log"), 403, "outside_root"),
        (str(attr_root / "link.log"), 403, "outside_root"),
        ("relative.log", 400, "invalid_path"),
        (str(attr_root / "missing.log"), 404, "not_found"),
        (str(attr_root / "sub"), 400, "not_regular"),
    ]
    for path, status, code in cases:
        r = httpx.post(srv.url + "/v1/analyses", json={"job_id": "j", "log_paths": [path]},
                       headers=KEY)
        assert (r.status_code, r.json()["error_code"]) == (status, code), path
    r = httpx.post(srv.url + "/v1/analyses", json={"job_id": "j", "fr_dir": "/tmp"}, headers=KEY)
    assert r.status_code == 403


def test_size_and_malformed_requests(start_server, attr_root):
    srv = start_server(max_body_bytes=2048)
    big = {"job_id": "j", "log_paths": ["/x" * 2000]}
    r = httpx.post(srv.url + "/v1/analyses", json=big, headers=KEY)
    assert r.status_code == 413 and r.json()["error_code"] == "too_large"
    for content in (b"{not json", b'{"job_id": "j", "cycle": true, "log_paths": []}',
                    b'{"job_id": "../x", "log_paths": []}', b'{"job_id": "j", "evil": 1}'):
        r = httpx.post(srv.url + "/v1/analyses", content=content,
                       headers={**KEY, "content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error_code"] == "invalid_request", content
    r = httpx.post(srv.url + "/v1/analyses", json={"job_id": "j"}, headers=KEY)
    assert r.status_code == 400
    assert httpx.get(srv.url + "/v1/analyses/nope", headers=KEY).status_code == 404


def test_rate_limit_per_client(start_server):
    srv = start_server(rate_per_minute=5)
    codes = [httpx.get(srv.url + "/v1/jobs/j/analyses", headers=KEY).status_code
             for _ in range(7)]
    assert codes[:5] == [200] * 5 and codes[-1] == 429
    r = httpx.get(srv.url + "/v1/jobs/j/analyses", headers=KEY)
    assert int(r.headers["Retry-After"]) >= 1
    other = httpx.get(srv.url + "/v1/jobs/j/analyses", headers={"X-API-Key": "wrong"})
    assert other.status_code == 401  # another client has its own bucket


@pytest.mark.timeout(120)
def test_coalescing_persistence_and_history(start_server, attr_root, tmp_path):
    jsonl = tmp_path / "posted.jsonl"
    from trainguard.attribution import JsonlPoster

    srv = start_server(workers=1, posters=[JsonlPoster(str(jsonl))])
    big = attr_root / "big.log"
    with open(big, "w") as fh:
        line = "[rank0]: iteration 100/ 1000 | lm loss: 2.0 | other noise " + "x" * 100 + "\n"
        fh.write(line * 400_000)  # ~70 MB keeps the single worker busy
    log = _copy(attr_root, "run_01.log")  # collective timeout: RESTART by category
    with AttributionClient(srv.url, "k-secret-1") as client:
        busy = client.submit("big", [str(big)])
        a = client.submit("job7", [log], cycle=0)
        b = client.submit("job7", [log], cycle=0)
        assert b["coalesced"] and b["id"] == a["id"] and not a["coalesced"]
        assert client.wait(busy["id"], timeout_s=90)["status"] == "completed"
        first = client.wait(a["id"], timeout_s=60)
        assert first["decision"] == "RESTART"
        assert first["result"]["analysis"]["primary_category"] == "collective_timeout"
    srv.stop()

    srv2 = start_server(workers=1)  # same database: results survive the restart
    with AttributionClient(srv2.url, "k-secret-1") as client:
        assert client.get(a["id"])["status"] == "completed"
        c1 = client.wait(client.submit("job7", [log], cycle=1)["id"], timeout_s=60)
        c2 = client.wait(client.submit("job7", [log], cycle=2)["id"], timeout_s=60)
        assert c1["decision"] == "RESTART" and c2["decision"] == "STOP"
        assert c2["result"]["agent"]["rule"] == "same_root_no_progress"
        assert [x["cycle"] for x in client.list_job("job7")] == [0, 1, 2]
        with pytest.raises(ServiceError) as err:
            client.submit("job7", ["/etc/passwd"])
        assert err.value.status == 403 and err.value.code == "outside_root"
    posted = jsonl.read_text().splitlines()
    assert len(posted) == 2  # big + job7 cycle 0 were posted by the first server
    metrics = httpx.get(srv2.url + "/metrics").text
    assert 'trainguard_attrsvc_analyses_total{status="completed"}' in metrics
    assert "trainguard_attrsvc_rejected_total" in metrics


def test_flight_recorder_via_service(start_server, attr_root):
    srv = start_server()
    shutil.copytree(FR / "gpu_error_1st", attr_root / "fr")
    with AttributionClient(srv.url, "k-secret-1") as client:
        rec = client.wait(client.submit("fr", [], fr_dir=str(attr_root / "fr"))["id"], 30)
    assert rec["status"] == "completed"
    assert rec["result"]["flight_recorder"]["faulty_ranks"] == [12, 14]


def test_config_requires_key_and_root(tmp_path):
    with pytest.raises(ConfigError, match="API key"):
        ServiceConfig(allowed_roots=[str(tmp_path)])
    with pytest.raises(ConfigError, match="not a directory"):
        ServiceConfig(allowed_roots=[str(tmp_path / "nope")], api_keys=["k"])
    with pytest.raises(ConfigError, match="sqlite"):
        from trainguard.attribution._store import db_path_from_url

        db_path_from_url("postgres://db/x")


def test_bad_logs_fail_cleanly(start_server, attr_root):
    srv = start_server()
    (attr_root / "empty.log").write_bytes(b"")
    (attr_root / "core.bin").write_bytes(b"\x7fELF\x00\x01" * 1000)
    with AttributionClient(srv.url, "k-secret-1") as client:
        empty = client.wait(client.submit("bad", [str(attr_root / "empty.log")])["id"], 30)
        binary = client.wait(client.submit("bad", [str(attr_root / "core.bin")], cycle=1)["id"],
                             30)
    assert empty["status"] == "failed" and "empty" in empty["error"]
    assert binary["status"] == "failed" and "binary" in binary["error"]
    assert httpx.get(srv.url + "/healthz").json() == {"status": "ok"}
