"""Restart agent rules and history loading."""

from __future__ import annotations

import json

import pytest
from attr_data import LOGS

from trainguard.attribution import (
    AttributionError,
    RestartPolicy,
    analyze_logs,
    decide,
    load_history,
)
from trainguard.cli import main
from trainguard.errors import ConfigError


def _res(cat="network", decision="RESTART", step=100, ckpt=50):
    return {"primary_category": cat, "decision": decision, "fingerprint": f"{cat}:x",
            "reason": f"{cat} happened", "progress": {"last_step": step,
                                                      "last_checkpoint_step": ckpt}}


def test_stop_and_continue_verdicts_stand():
    assert decide(_res("cuda_oom", "STOP")).decision == "STOP"
    assert decide(_res("in_progress", "CONTINUE"), [_res()] * 5).decision == "CONTINUE"


def test_same_root_without_progress_stops_at_limit():
    hist = [_res(step=100)]
    first = decide(_res(step=100), hist, RestartPolicy(same_root_limit=3))
    assert first.decision == "RESTART" and first.repeats == 2 and first.progressed is False
    stop = decide(_res(step=100), [_res(step=100)] * 2, RestartPolicy(same_root_limit=3))
    assert (stop.decision, stop.rule, stop.repeats) == ("STOP", "same_root_no_progress", 3)


def test_progress_resets_the_count():
    hist = [_res(step=10, ckpt=5), _res(step=20, ckpt=10)]
    d = decide(_res(step=30, ckpt=20), hist, RestartPolicy(same_root_limit=2))
    assert d.decision == "RESTART" and d.repeats == 1 and d.progressed is True


def test_different_root_is_not_a_repeat():
    hist = [_res("collective_timeout", step=100)] * 5
    assert decide(_res("network", step=100), hist).decision == "RESTART"


def test_retry_budget():
    d = decide(_res(step=500), [_res(step=s) for s in (100, 200)], RestartPolicy(max_restarts=2))
    assert (d.decision, d.rule) == ("STOP", "retry_budget")


def test_exclude_nodes_kept():
    assert decide(_res("gpu_hardware", "RESTART_EXCLUDE_NODES")).decision == \
        "RESTART_EXCLUDE_NODES"


def test_policy_validation():
    with pytest.raises(ConfigError):
        RestartPolicy(same_root_limit=0)


def test_history_file_and_cli(tmp_path, capsys):
    log = LOGS / "run_01.log"  # collective timeout, RESTART by category
    one = analyze_logs([log]).to_dict()
    hist = tmp_path / "hist.jsonl"
    hist.write_text("\n".join(json.dumps(one) for _ in range(2)) + "\n")
    assert len(load_history(str(hist))) == 2
    assert main(["analyze", str(log), "--json", "--history", str(hist)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["category_decision"] == "RESTART" and out["decision"] == "STOP"
    assert out["agent"]["rule"] == "same_root_no_progress"


def test_bad_history(tmp_path):
    bad = tmp_path / "h.json"
    bad.write_text("[{\"x\": 1}]")
    with pytest.raises(AttributionError, match="lacks primary_category"):
        load_history(str(bad))
    bad.write_text("{nope")
    with pytest.raises(AttributionError, match="not JSON"):
        load_history(str(bad))
