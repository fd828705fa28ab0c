"""Result posting: JSON lines, webhook retries (real local HTTP server), Slack on STOP only."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainguard.attribution import JsonlPoster, SlackPoster, WebhookPoster


@pytest.fixture
def hook():
    """Local HTTP endpoint answering with a scripted list of status codes."""
    state = {"codes": [], "bodies": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state["bodies"].append(json.loads(body))
            code = state["codes"].pop(0) if state["codes"] else 200
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield state
    server.shutdown()
    server.server_close()
    thread.join(5)


REC = {"job_id": "j1", "cycle": 2, "decision": "STOP", "reason": "cuda_oom on rank 2",
       "result": {"decision": "STOP", "evidence": [{"file": "a.log", "line": 7, "text": "OOM"}]}}


def test_jsonl(tmp_path):
    path = tmp_path / "out.jsonl"
    poster = JsonlPoster(str(path))
    assert poster.post(REC) and poster.post({**REC, "cycle": 3})
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["cycle"] for r in rows] == [2, 3]
    assert not JsonlPoster(str(tmp_path / "no" / "dir.jsonl")).post(REC)


def test_webhook_retries_then_succeeds(hook):
    hook["codes"] = [503, 429]
    assert WebhookPoster(hook["url"], attempts=3, backoff_s=0.01).post(REC)
    assert len(hook["bodies"]) == 3 and hook["bodies"][-1]["job_id"] == "j1"


def test_webhook_gives_up_and_does_not_retry_4xx(hook):
    hook["codes"] = [500, 500, 500]
    assert not WebhookPoster(hook["url"], attempts=3, backoff_s=0.01).post(REC)
    assert len(hook["bodies"]) == 3
    hook["codes"] = [400]
    assert not WebhookPoster(hook["url"], attempts=3, backoff_s=0.01).post(REC)
    assert len(hook["bodies"]) == 4


def test_webhook_unreachable():
    from trainguard.testing import free_port

    assert not WebhookPoster(f"http://127.0.0.1:{free_port()}/", attempts=2, backoff_s=0.01,
                             timeout_s=1).post(REC)


def test_slack_only_on_stop(hook):
    slack = SlackPoster(hook["url"], backoff_s=0.01)
    assert slack.post({**REC, "decision": "RESTART"})
    assert hook["bodies"] == []
    assert slack.post(REC)
    text = hook["bodies"][0]["text"]
    assert "j1" in text and "a.log:7" in text and "cuda_oom" in text
