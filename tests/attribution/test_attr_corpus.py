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


# The held-apart sets (issue 12, second round: heldout; third round: heldout2; fourth: heldout3;
# fifth: heldout4; sixth: heldout5)
# and the fresh set. Their labels are frozen as scored; the remaining disagreements are label
# conventions or judgement calls, kept visible (each listed key must still differ):
# h06 -- the analyser names the hosts (node-a/node-b: the NCCL prefix maps the pdsh IPs to
#        them), the label the pdsh IPs;
# h08 -- the analyser adds the client that could not connect, as handed case attribution-03
#        does; the label names the endpoint only;
# h20 -- torchrun reports exactly one failed process (rank 0); the label (config error, all
#        ranks alike) names none.
# k21 -- torchrun reports exactly one failed process (rank 4) and the loss-scale exception is
#        printed without a rank; the label (a global fp16 overflow) names none, as for h20.
# k24 -- the only failed srun task is task 0 and nothing says how many tasks ran (plain
#        ``srun python``, no task count): the analyser names rank 0, the label (a one-process
#        job) names none.
# m01 -- as h06: the hosts node-100/node-101 for the pdsh addresses the label names.
# m09 -- the NCCL connect timeout is printed on node-10 only and names no peer; the label adds
#        the other host of the job (node-09).
# m16 -- an unreachable rendezvous endpoint keeps domain ``unknown`` (network, a blocked port or
#        a wrong endpoint: the log cannot tell, the h08 and attribution-03 convention); the
#        label says infrastructure.
# m17 -- the analyser names both ranks whose IB completion failed (4 and 12, one per host) and
#        the hosts by the pdsh addresses; the label names rank 4 and the containers' host names.
# m21 -- the DataLoader errors after the preemption are the ranks' teardown to the analyser
#        (no cascade); the label keeps them as a code_exception cascade.
# m22 -- "CUDA error: unknown error" on one rank, nothing else: framework_crash/RESTART, as the
#        corpus labels the same line (c14); the label follows the reporter, who blames the GPU
#        (gpu_hardware on node-29), which the log text does not show.
# m25 -- "AssertionError: Sequence len must be multiple of mini batch size": a size that must
#        divide another is the config-validation wording (config_error), the label reads it as
#        a code assertion (code_exception; its notes call config_error a possible reading).
#        Both STOP.
# heldout4 (fifth round; category and decision right on all 35 after the kinds of
# ``test_attr_kinds4.py``; the remaining differences are secondary keys):
# p01 -- the illegal memory access on node-05 after the IB errors is that rank's own teardown to
#        the analyser (no cascade); the label keeps it as a framework_crash cascade.
# p10 -- DeepSpeed's single-node launcher reports a one-process job's segfault without a rank:
#        the analyser names none, the label rank 0 (the m08 convention).
# p12 -- the IB peer is named by its address (10.0.13.83), not the pod host it belongs to; the
#        label names worker-node0 (as m17).
# p13 -- the NVLink error line names no rank and rank 11 appears only inside the elastic error
#        JSON's message string: the analyser names no rank (the node from the srun task) and
#        reads the peers' "Transport endpoint is not connected" as their teardown; the label
#        names rank 11 and a network cascade.
# p19, p21 -- the only failed task/process is rank 0 and nothing says the job has one process:
#        the analyser names rank 0, the label (a one-process job) none (the k24 convention).
# p29 -- the "unexpected pos" errors on the other ranks are checkpoint_io roots folded into the
#        storage_full fault (not a cascade row); the label keeps a checkpoint_error cascade.
# p32, p34 -- an unreachable rendezvous store keeps domain ``unknown`` and names the client that
#        could not connect (the h08/m16 convention); the labels say infrastructure and name the
#        endpoint only (p32: the analyser names the client node-02 where the error is printed).
# heldout5 (sixth round; category and decision right on all 38 after the kinds of
# ``test_attr_kinds5.py``; the remaining differences are secondary keys):
# q01, q03, q14, q18, q32 -- a one-process job whose only process shows the error: the label
#        names rank 0 (the m08/p10 convention), the analyser none (nothing in the log prints a
#        rank or a world size).
# q02 -- the IB peer is named by its host (gpu-v100-a) only; the label adds its address too.
# q13 -- the NCCL socket failure is read from the "Last error:" detail line, which names no
#        process: no rank or node (the label: rank 0 and the NCCL prefix's host ``user``); the
#        ``DistBackendError`` wrapper of the same failure counts as a collective_timeout
#        cascade, the label none.
# q19 -- the transport error keeps domain ``unknown`` and names rank 0 (the first to print it);
#        the label names both ends of the link (ranks 2 and 3 on their two hosts, the k35
#        convention) and infrastructure.
# q21 -- torchrun reports rank 3 failed and rank 0 printed the check too: the analyser names
#        both, the label (config error, all ranks alike) none, as for h20.
_HELD_KNOWN: dict[str, set[str]] = {
    "h06.log": {"culprit_nodes"}, "h08.log": {"culprit_nodes"}, "h20.log": {"culprit_ranks"},
    "k21.log": {"culprit_ranks"}, "k24.log": {"culprit_ranks"},
    "m01.log": {"culprit_nodes"}, "m09.log": {"culprit_nodes"}, "m16.log": {"failure_domain"},
    "m17.log": {"culprit_ranks", "culprit_nodes"}, "m21.log": {"cascade_categories"},
    "m22.log": {"primary_category", "failure_domain", "culprit_nodes", "decision"},
    "m25.log": {"primary_category"},
    "p01.log": {"cascade_categories"}, "p10.log": {"culprit_ranks"},
    "p12.log": {"culprit_nodes"}, "p13.log": {"culprit_ranks", "cascade_categories"},
    "p19.log": {"culprit_ranks"}, "p21.log": {"culprit_ranks"},
    "p29.log": {"cascade_categories"},
    "p32.log": {"failure_domain", "culprit_nodes"}, "p34.log": {"failure_domain", "culprit_nodes"},
    "q01.log": {"culprit_ranks"}, "q02.log": {"culprit_nodes"}, "q03.log": {"culprit_ranks"},
    "q13.log": {"culprit_ranks", "culprit_nodes", "cascade_categories"},
    "q14.log": {"culprit_ranks"}, "q18.log": {"culprit_ranks"},
    "q19.log": {"failure_domain", "culprit_ranks", "culprit_nodes"},
    "q21.log": {"culprit_ranks"}, "q32.log": {"culprit_ranks"}}
_HELD = [(d, lb) for d in ("heldout", "heldout2", "heldout3", "heldout4", "heldout5", "fresh")
         for lb in json.loads((DATA / d / "labels.json").read_text())]


@pytest.mark.parametrize("folder, label", _HELD, ids=[lb["file"] for _, lb in _HELD])
def test_held_apart_log(folder, label):
    got = _norm(analyze_logs([DATA / folder / label["file"]]).to_dict())
    want = _norm(label)
    known = _HELD_KNOWN.get(label["file"], set())
    for key in LABEL_KEYS:
        if key in known:
            assert got[key] != want[key], f"{label['file']} {key} now right: drop it"
            continue
        assert got[key] == want[key], (label["file"], key, got[key], want[key], label["source"])


def test_held_apart_set_is_what_the_issue_asks():
    labels = json.loads((DATA / "heldout" / "labels.json").read_text())
    second = json.loads((DATA / "heldout" / "labels_second.json").read_text())
    assert len(labels) >= 30 and {lb["split"] for lb in labels} == {"heldout"}
    assert {lb["primary_category"] for lb in labels} == set(CATEGORIES)
    launchers = {lb["launcher"] for lb in labels}
    for need in ("torchrun", "torch.distributed.launch", "deepspeed", "deepspeed-pdsh", "srun",
                 "mpirun", "ray", "lightning", "accelerate", "submitit"):
        assert need in launchers, need
    assert [s["file"] for s in second] == [lb["file"] for lb in labels]
    assert all(lb["source"].startswith("https://github.com/") for lb in labels)


_COMMON_LAUNCHERS = ("torchrun", "torch.distributed.launch", "deepspeed", "deepspeed-pdsh",
                     "mpirun", "ray", "lightning", "accelerate", "submitit")
# (set, logs, launchers it must cover besides the common ones), in the order they were made
_LATER_SETS = [("heldout2", 36, ("srun",)), ("heldout3", 34, ("srun",)),
               ("heldout4", 35, ("srun",)), ("heldout5", 38, ("srun-l", "sbatch")),
               ("heldout6", 44, ("srun-l",))]


@pytest.mark.parametrize("index", range(len(_LATER_SETS)), ids=[s[0] for s in _LATER_SETS])
def test_later_held_apart_set_is_what_the_issue_asks(index):
    """heldout2..6: their size, two labelling passes, every category and launcher format, and
    no report that an earlier set already used."""
    name, size, extra = _LATER_SETS[index]
    labels = json.loads((DATA / name / "labels.json").read_text())
    second = json.loads((DATA / name / "labels_second.json").read_text())
    assert len(labels) == size and {lb["split"] for lb in labels} == {name}
    assert {lb["primary_category"] for lb in labels} == set(CATEGORIES)
    launchers = {lb["launcher"] for lb in labels}
    for need in _COMMON_LAUNCHERS + extra:
        assert need in launchers, need
    assert sorted(s["file"] for s in second) == sorted(lb["file"] for lb in labels)
    before = ["logs", "corpus", "fresh", "heldout"] + [s[0] for s in _LATER_SETS[:index]]
    earlier = {lb["source"] for d in before
               for lb in json.loads((DATA / d / "labels.json").read_text())}
    assert not earlier & {lb["source"] for lb in labels}


# heldout6 (seventh round): scored once on the rules after the fixes of rounds 2-6 (main at
# 581314b): category 0.955 (42/44), decision 0.932 (41/44) -- issue 12's held-apart figure.
# Its misses are kept as they were scored, so a change that fixes one must move it out of this
# table (and say the set is no longer held apart), and a change that breaks another log fails.
_HELD6_MISSES = {
    "r25.log": "config_error read as code_exception (a DeepSpeed batch-size assert)",
    "r26.log": "in_progress read as unknown/RESTART (torch.distributed.launch, no exit line)",
    "r33.log": "gpu_hardware right, but no node to exclude (RESTART)",
    "r41.log": "node_failure right, but the Ray node not named (RESTART)",
}
_HELD6 = json.loads((DATA / "heldout6" / "labels.json").read_text())


def test_sixth_held_apart_set_scores_as_recorded():
    """Issue 12's target on logs the rules were not written against: >= 90 % category and
    decision on heldout6, and exactly the recorded misses."""
    misses, cat, dec = set(), 0, 0
    for lb in _HELD6:
        got = analyze_logs([DATA / "heldout6" / lb["file"]]).to_dict()
        ok_cat = got["primary_category"] == lb["primary_category"]
        ok_dec = got["decision"] == lb["decision"]
        cat += ok_cat
        dec += ok_dec
        if not (ok_cat and ok_dec):
            misses.add(lb["file"])
    assert misses == set(_HELD6_MISSES), sorted(misses ^ set(_HELD6_MISSES))
    assert cat / len(_HELD6) >= 0.9 and dec / len(_HELD6) >= 0.9, (cat, dec)
