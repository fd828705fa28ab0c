"""One pipeline: the CLI, the service and the launcher call the same ``analyze()``.

The same log must come back with the same category and decision from every front end, with the
same ``job_ended`` default (issue 12: the service used to assume the job had ended, so a log that
the CLI called ``in_progress`` came back ``unknown`` from the service).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from attr_data import DATA

from trainguard.attribution import JOB_ENDED_DEFAULT, analyze
from trainguard.attribution._pipeline import analysis_part
from trainguard.attribution._svc_core import AnalysisService, ServiceConfig
from trainguard.cli import main

_KEYS = ("primary_category", "culprit_ranks", "culprit_nodes", "fingerprint")


def _service_result(tmp_path, log, **kw) -> dict:
    svc = AnalysisService(ServiceConfig(allowed_roots=[str(tmp_path)], allow_anonymous=True,
                                        db_url=f"sqlite:///{tmp_path / 'svc.db'}", workers=1))
    try:
        rec, _ = svc.submit("job", 0, [str(log)], None, **kw)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row = svc.store.get(rec["id"])
            if row and row["status"] in ("completed", "failed"):
                break
            time.sleep(0.02)
        assert row and row["status"] == "completed", row
        return row["result"]
    finally:
        svc.close()


@pytest.mark.parametrize("text, category, decision", [
    ("step 10 loss 1.0\nstep 11 loss 0.9\n", "in_progress", "CONTINUE"),
    ((DATA / "heldout" / "h25.log").read_text(), "checkpoint_error", "STOP"),
])
def test_cli_service_and_library_agree(tmp_path, capsys, text, category, decision):
    log = tmp_path / "x.log"
    log.write_text(text)
    assert main(["analyze", "--json", str(log)]) == 0
    cli = json.loads(capsys.readouterr().out)
    lib = analyze([log])
    svc = _service_result(tmp_path, log)  # the service's default job_ended, like the CLI's
    print("cli:", cli["primary_category"], "service:", svc["analysis"]["primary_category"])
    assert JOB_ENDED_DEFAULT is False
    for key in _KEYS:
        assert cli[key] == lib[key] == svc["analysis"][key], key
    assert cli["primary_category"] == category
    assert cli["decision"] == lib["decision"] == svc["decision"] == decision
    assert svc["analysis"] == analysis_part(lib)  # what the service keeps as history


def test_job_ended_is_explicit_everywhere(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("step 10 loss 1.0\nstep 11 loss 0.9\n")
    svc = _service_result(tmp_path, log, job_ended=True)
    lib = analyze([log], job_ended=True)
    assert svc["analysis"]["primary_category"] == lib["primary_category"] == "unknown"
    assert svc["decision"] == lib["decision"] == "RESTART"


def test_launcher_helper_calls_the_pipeline(tmp_path, monkeypatch):
    """The launcher's in-process attribution goes through ``analyze`` with job_ended=True."""
    from trainguard import attribution
    from trainguard.fault_tolerance import _report
    from trainguard.fault_tolerance._agent import Launcher

    calls: list[tuple] = []
    real = attribution.analyze

    def spy(logs, **kw):
        calls.append((list(logs), kw))
        return real(logs, **kw)

    monkeypatch.setattr(attribution, "analyze", spy)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "cycle_0.log").write_text((DATA / "heldout" / "h21.log").read_text())

    launcher = SimpleNamespace(spec=SimpleNamespace(ft=SimpleNamespace(attribution=True,
                                                                       attrsvc_url="")),
                               run_dir=str(run_dir))
    launcher.cycle_log = lambda cycle: Launcher.cycle_log(launcher, cycle)  # type: ignore[arg-type]
    assert _report._attribute(launcher, SimpleNamespace(cycle=0)) == "STOP"  # type: ignore[arg-type]
    assert len(calls) == 1 and calls[0][1] == {"job_ended": True}
