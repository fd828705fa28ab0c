"""The labelled corpus (70 logs from public reports, many launcher formats) and the handed cases.

Every corpus log is a test of category, failure domain, decision, culprit ranks, culprit nodes and
cascades against its reconciled label. The handed cases (``shared/cases/attribution-*``) are kept
verbatim under ``tests/data/attribution/cases`` with the answer their report says is right.
"""

from __future__ import annotations

import json

import pytest
from attr_data import DATA, LABEL_KEYS

from trainguard.attribution import CATEGORIES, analyze_logs

CORPUS = DATA / "corpus"
LABELS = json.loads((CORPUS / "labels.json").read_text())
CASES = DATA / "cases"

# Known misses, kept visible rather than fitted (see BENCHMARKS.md): none at present (c30's
# rank is now tied to the host whose GPU fell off the bus through the rank's native crash).
_KNOWN: dict[str, str] = {}


def _norm(d: dict) -> dict:
    out = {k: d[k] for k in LABEL_KEYS}
    out["culprit_nodes"] = sorted(out["culprit_nodes"]) if out["culprit_nodes"] else None
    return out


@pytest.mark.parametrize("label", LABELS, ids=[lb["file"] for lb in LABELS])
def test_corpus_log(label):
    got = _norm(analyze_logs([CORPUS / label["file"]]).to_dict())
    want = _norm(label)
    assert (got["primary_category"], got["decision"]) == (
        want["primary_category"], want["decision"]), (label["source"], got)
    for key in LABEL_KEYS:
        if _KNOWN.get(label["file"]) == key:
            assert got[key] != want[key], f"{label['file']} {key} now right: drop it from _KNOWN"
            continue
        assert got[key] == want[key], (label["file"], key, got[key], want[key])


def test_corpus_is_what_the_issue_asks():
    assert len(LABELS) >= 60
    splits = {lb["split"] for lb in LABELS}
    assert splits == {"dev", "test"}
    launchers = {lb["launcher"] for lb in LABELS}
    for need in ("torchrun", "torch.distributed.launch", "deepspeed", "deepspeed-pdsh", "srun",
                 "mpirun", "ray", "lightning", "accelerate", "submitit"):
        assert need in launchers, need
    cats = {lb["primary_category"] for lb in LABELS}
    assert cats == set(CATEGORIES), set(CATEGORIES) - cats
    for lb in LABELS:
        assert lb["source"].startswith("https://github.com/"), lb["file"]
    second = {lb["file"] for lb in json.loads((CORPUS / "labels_second.json").read_text())}
    assert second == {lb["file"] for lb in LABELS}


_CASE_ANSWERS = {
    "attribution-01.log": {"primary_category": "framework_crash", "failure_domain": "unknown",
                           "culprit_ranks": None, "culprit_nodes": None,
                           "cascade_categories": [], "decision": "RESTART"},
    "attribution-02.log": {"primary_category": "cuda_oom", "failure_domain": "workload",
                           "culprit_ranks": [2], "culprit_nodes": None,
                           "cascade_categories": [], "decision": "STOP"},
    "attribution-03.log": {"primary_category": "network", "failure_domain": "unknown",
                           "culprit_ranks": None, "culprit_nodes": ["10.0.0.1", "node-02"],
                           "cascade_categories": [], "decision": "RESTART"},
}


@pytest.mark.parametrize("name", sorted(_CASE_ANSWERS))
def test_handed_case(name):
    got = _norm(analyze_logs([CASES / name]).to_dict())
    assert got == _CASE_ANSWERS[name]
