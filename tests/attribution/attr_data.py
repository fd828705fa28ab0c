"""Paths of the handed test data (labelled logs, flight-recorder fixtures)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "attribution"
LOGS = DATA / "logs"
FR = DATA / "flight_recorder"
LABELS = json.loads((LOGS / "labels.json").read_text())
LABEL_KEYS = ["primary_category", "failure_domain", "culprit_ranks", "culprit_nodes",
              "cascade_categories", "decision"]


def injected_ranks(scenario: Path) -> list[int]:
    """Faulty ranks listed in a scenario's fault_injection.log (the ground truth)."""
    text = (scenario / "fault_injection.log").read_text()
    return sorted(int(r) for r in re.findall(r"^Rank (\d+), fault_type", text, re.MULTILINE))


class ServerThread:
    """A real uvicorn server for the attribution app on 127.0.0.1, run in a thread."""

    def __init__(self, cfg, port: int) -> None:
        import uvicorn

        from trainguard.attribution import create_app

        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port,
                                log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        import threading

        self.thread = threading.Thread(target=self.server.run, name="attrsvc-test", daemon=True)

    def start(self) -> ServerThread:
        from trainguard._core.clock import wait_until

        self.thread.start()
        if not wait_until(lambda: self.server.started or not self.thread.is_alive(), 20.0):
            self.stop()
            raise RuntimeError("attribution server did not start within 20 s")
        if not self.server.started:
            raise RuntimeError("attribution server failed to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20.0)
        if self.thread.is_alive():
            raise RuntimeError("attribution server did not stop within 20 s")


def verdict_keys(path: Path | str) -> tuple:
    """(category, decision, culprit ranks, culprit nodes) of one analysed log."""
    from trainguard.attribution import analyze_logs

    r = analyze_logs([path])
    return r.primary_category, r.decision, r.culprit_ranks, r.culprit_nodes
