"""Every labelled log is a test: category, domain, culprits, cascades and decision must match."""

from __future__ import annotations

import json

import pytest
from attr_data import LABEL_KEYS, LABELS, LOGS

from trainguard.attribution import analyze_logs
from trainguard.cli import main


@pytest.mark.parametrize("label", LABELS, ids=[lab["file"] for lab in LABELS])
def test_labelled_log(label):
    result = analyze_logs([LOGS / label["file"]]).to_dict()
    got = {k: result[k] for k in LABEL_KEYS}
    want = {k: label[k] for k in LABEL_KEYS}
    assert got == want, f"{label['file']}: {result['reason']}"
    # evidence cites real lines of the file
    lines = (LOGS / label["file"]).read_text(errors="replace").splitlines()
    for ev in result["evidence"]:
        assert ev["text"].rstrip() in lines[ev["line"] - 1] or lines[ev["line"] - 1].startswith(
            ev["text"][:200])


def test_cli_json_has_label_keys(capsys):
    label = next(lab for lab in LABELS if lab["culprit_nodes"])
    assert main(["analyze", str(LOGS / label["file"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in LABEL_KEYS + ["reason", "evidence"]:
        assert key in out
    assert out["culprit_nodes"] == label["culprit_nodes"]
    assert {"file", "line", "text"} <= set(out["evidence"][0])


def test_cli_text_report_lists_root_cause_first(capsys):
    assert main(["analyze", str(LOGS / "run_03.log")]) == 0
    text = capsys.readouterr().out
    assert text.index("Root cause: cuda_oom") < text.index("cascade: collective_timeout")
    assert "Decision: STOP" in text


def test_cli_bad_input_exit_code(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing.log")]) == 2
    assert "cannot read log" in capsys.readouterr().err
    assert main(["analyze"]) == 2
