"""Optional LLM explanation against a local fake endpoint: kept only with verified citations."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from attr_data import LOGS

from trainguard.cli import main

LOG = str(LOGS / "run_03.log")


@pytest.fixture
def fake_llm():
    """OpenAI-compatible /v1/chat/completions answering ``state['answer']``."""
    state = {"answer": {}, "requests": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append((self.path, self.headers.get("Authorization"), body))
            reply = json.dumps({"choices": [{"message": {
                "role": "assistant", "content": json.dumps(state["answer"])}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    server.shutdown()
    server.server_close()
    thread.join(5)


def _run(capsys, url, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_LLM_API_KEY", "llm-key")
    assert main(["analyze", LOG, "--json", "--llm-url", url]) == 0
    return json.loads(capsys.readouterr().out)


def test_verified_citation_keeps_explanation(fake_llm, capsys, monkeypatch):
    fake_llm["answer"] = {
        "explanation": "Rank 2 ran out of GPU memory; peers timed out.",
        "citations": [
            {"file": LOG, "line": 101, "quote": "torch.cuda.OutOfMemoryError: CUDA out of memory"}
        ],
    }
    out = _run(capsys, fake_llm["url"], monkeypatch)
    assert out["llm"]["verified"] and out["llm"]["explanation"].startswith("Rank 2")
    assert out["decision"] == "STOP"  # the model never decides
    path, auth, body = fake_llm["requests"][0]
    assert path == "/v1/chat/completions" and auth == "Bearer llm-key"
    assert "CUDA out of memory" in body["messages"][1]["content"]


@pytest.mark.parametrize(
    "citations",
    [
        [{"file": LOG, "line": 101, "quote": "GPU 7 fell off the bus"}],  # fabricated quote
        [{"file": "/etc/passwd", "line": 1, "quote": "root:x:0:0:root"}],  # not an analysed file
        [],
    ],
)
def test_unverified_citations_drop_explanation(fake_llm, capsys, monkeypatch, citations):
    fake_llm["answer"] = {"explanation": "It was the network.", "citations": citations}
    out = _run(capsys, fake_llm["url"], monkeypatch)
    assert out["llm"]["explanation"] is None and not out["llm"]["verified"]
    assert out["llm"]["problems"]
    assert out["primary_category"] == "cuda_oom"


def test_endpoint_down_is_reported_not_fatal(capsys, monkeypatch):
    from trainguard.testing import free_port

    out = _run(capsys, f"http://127.0.0.1:{free_port()}/v1", monkeypatch)
    assert out["llm"]["explanation"] is None
    assert "endpoint error" in out["llm"]["problems"][0]
