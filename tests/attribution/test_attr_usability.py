"""What a new user of ``trainguard analyze`` / ``trainguard attrsvc`` runs into: unreadable input,
dumps without logs, site registries, service startup and anonymous use."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
from attr_data import FR

from trainguard._core.procs import terminate_processes
from trainguard.attribution import AttributionClient, analyze_logs
from trainguard.cli import main

OOM = "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
TIME_LIMIT = ("slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT 2024-01-01T00:00:00 DUE TO TIME "
              "LIMIT ***\n")


def _flat(text: str) -> str:
    """Rich wraps at 80 columns; compare with whitespace collapsed."""
    return " ".join(text.split())


def _junk(n: int = 100_000, seed: int = 7) -> bytes:
    rnd = random.Random(seed)
    return bytes(rnd.randrange(1, 256) for _ in range(n))  # no NUL: not caught as binary


# ---------------------------------------------------------------- 1. unreadable input

def test_random_bytes_are_not_attributed(write_log, capsys):
    log = write_log(_junk(), "x.log")
    assert main(["analyze", log, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    print("warnings:", out["warnings"])
    assert out["primary_category"] == "unknown" and out["confidence"] == 0
    assert out["decision"] == "STOP", "no restart may rest on unreadable input"
    assert "no input file looks like a text log" in out["reason"]
    assert len(out["warnings"]) == 1 and "does not look like a text log" in out["warnings"][0]
    assert log in out["warnings"][0]

    assert main(["analyze", log]) == 0
    text = _flat(capsys.readouterr().out)
    assert "Warning:" in text and "does not look like a text log" in text
    assert "Decision: STOP" in text


def test_real_text_with_ansi_progress_and_latin1_is_not_flagged(write_log):
    lines = [f"\x1b[32mINFO\x1b[0m step {i} loss 1.{i}\r" for i in range(2000)]
    lines += ["caf\xe9 au lait", "\tindented", OOM.strip()]
    data = "\n".join(lines[:-1]).encode("latin-1") + b"\n" + OOM.encode()
    res = analyze_logs([write_log(data)])
    assert not any("does not look like" in w for w in res.warnings), res.warnings
    assert (res.primary_category, res.decision) == ("cuda_oom", "STOP")


def test_binary_file_next_to_a_text_log_only_warns(write_log):
    res = analyze_logs([write_log(_junk(), "core.bin"), write_log(OOM, "rank3.log")])
    assert res.primary_category == "cuda_oom" and res.confidence > 0
    assert any("core.bin: does not look like a text log" in w for w in res.warnings)


# ---------------------------------------------------------------- 2. --fr-dir without logs

def test_fr_dir_alone_gives_a_decision(tmp_path, capsys):
    fr = str(FR / "lock_gil_1st")
    assert main(["analyze", "--fr-dir", fr]) == 0
    text = _flat(capsys.readouterr().out)
    assert "Decision: RESTART" in text and "ranks [9, 14]" in text, text

    assert main(["analyze", "--fr-dir", fr, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["decision"], out["primary_category"]) == ("RESTART", "collective_timeout")
    assert out["culprit_ranks"] == [9, 14] and out["agent"]["rule"] == "category_policy"
    # the same hang twice before, no progress: the agent stops instead of looping
    (tmp_path / "hist.jsonl").write_text(json.dumps(out) + "\n" + json.dumps(out) + "\n")
    assert main(["analyze", "--fr-dir", fr, "--json", "--history",
                 str(tmp_path / "hist.jsonl")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["decision"] == "STOP" and again["agent"]["rule"] == "same_root_no_progress"


def _healthy_dump(rank: int) -> dict:
    entry = {"record_id": 5, "pg_id": 0, "process_group": ("0", "default_pg"),
             "collective_seq_id": 5, "p2p_seq_id": 0, "profiling_name": "nccl:all_reduce",
             "input_sizes": [[4]], "output_sizes": [[4]], "input_dtypes": ["Float"],
             "output_dtypes": ["Float"], "state": "completed", "time_created_ns": 5,
             "is_p2p": False}
    return {"version": "2.9", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                  "ranks": "[0, 1]"}},
            "pg_status": {"0": {"last_enqueued_collective": 5, "last_completed_collective": 5,
                                "last_started_collective": 5}}, "entries": [entry]}


def test_fr_dir_alone_without_fault_says_no_decision(tmp_path, capsys):
    for rank in (0, 1):
        (tmp_path / f"nccl_trace_rank_{rank}.json").write_text(json.dumps(_healthy_dump(rank)))
    prefix = str(tmp_path / "nccl_trace_rank_")
    assert main(["analyze", "--fr-dir", prefix, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flight_recorder"]["faulty_ranks"] == []
    assert out["decision"] is None and out["reason"].startswith("no decision")
    assert main(["analyze", "--fr-dir", prefix]) == 0
    text = _flat(capsys.readouterr().out)
    assert "Decision: none - no decision" in text and "pass the job's logs" in text


@pytest.mark.timeout(60)
def test_service_decides_from_dumps_alone(start_server, attr_root):
    srv = start_server()
    shutil.copytree(FR / "gpu_error_1st", attr_root / "fr")
    with AttributionClient(srv.url, "k-secret-1") as client:
        rec = client.wait(client.submit("fr", [], fr_dir=str(attr_root / "fr"))["id"], 30)
    assert rec["status"] == "completed"
    assert rec["decision"] == "RESTART" and "[12, 14]" in rec["reason"]


# ---------------------------------------------------------------- 3. --registry extends

def _site_registry(tmp_path) -> str:
    path = tmp_path / "site.yaml"
    path.write_text(
        "patterns:\n"
        "  - {id: site_fs_evicted, category: storage_full, role: root, tier: 30,\n"
        "     any: [lustreerror], regex: 'LustreError: .* evicted'}\n"
        "categories:\n"
        "  time_limit: {decision: STOP}\n")
    return str(path)


def test_registry_extends_the_shipped_one(tmp_path, write_log, capsys):
    reg = _site_registry(tmp_path)
    lustre = write_log("LustreError: 11-0: client evicted by MDS\n", "lustre.log")
    assert main(["analyze", lustre, "--json", "--registry", reg]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["primary_category"] == "storage_full"
    assert out["evidence"][0]["pattern"] == "site_fs_evicted"
    # shipped rows still work, and a partial category override changes only the decision
    assert analyze_logs([write_log(OOM, "oom.log")], registry_path=reg).primary_category \
        == "cuda_oom"
    limit = analyze_logs([write_log(TIME_LIMIT, "tl.log")], registry_path=reg)
    assert (limit.primary_category, limit.decision, limit.failure_domain) == \
        ("time_limit", "STOP", "infrastructure")
    assert analyze_logs([limit.files[0]]).decision == "RESTART"  # shipped policy untouched


def test_registry_row_with_a_shipped_id_overrides_it(tmp_path, write_log):
    path = tmp_path / "override.yaml"
    path.write_text("patterns:\n  - {id: slurm_time_limit, category: preemption, role: root, "
                    "tier: 30, any: ['due to time limit'], regex: 'DUE TO TIME LIMIT'}\n")
    from trainguard.attribution import load_registry

    ids = [p.id for p in load_registry(str(path)).patterns]
    shipped = [p.id for p in load_registry().patterns]
    if "slurm_time_limit" not in shipped:
        pytest.skip(f"shipped ids changed: {shipped[:10]}")
    assert sorted(ids) == sorted(shipped), "an override must not duplicate the row"
    res = analyze_logs([write_log(TIME_LIMIT)], registry_path=str(path))
    assert res.primary_category == "preemption"


def test_registry_replace_is_explicit(tmp_path, write_log, capsys):
    reg = tmp_path / "one_row.yaml"
    reg.write_text("patterns:\n  - {id: x, category: storage_full, role: root, any: [xyz], "
                   "regex: xyz}\n")
    log = write_log(OOM)
    assert main(["analyze", log, "--registry", str(reg)]) == 0  # extends: fine
    capsys.readouterr()
    assert main(["analyze", log, "--registry-replace", str(reg)]) == 2
    err = _flat(capsys.readouterr().err)
    assert "categories missing" in err and "--registry instead" in err
    bad = tmp_path / "typo.yaml"
    bad.write_text("pattern: []\n")
    assert main(["analyze", log, "--registry", str(bad)]) == 2
    assert "unknown top-level key(s) ['pattern']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    help_text = _flat(capsys.readouterr().out)
    assert "merged on top of the shipped one" in help_text and "--registry-replace" in help_text


# ---------------------------------------------------------------- 4./5. attrsvc startup

def _start_lines(proc, n: int = 4) -> list[str]:
    lines = []
    while len(lines) < n:
        line = proc.stderr.readline().decode()
        if not line:
            raise AssertionError(f"attrsvc exited early: {lines}")
        lines.append(line.strip())
    return lines


@pytest.mark.timeout(90)
def test_attrsvc_prints_where_it_listens_and_stores(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.log").write_text(TIME_LIMIT)
    (tmp_path / "cwd").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_ATTRSVC_API_KEYS"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "attrsvc", "--port", "0", "--allow-anonymous",
         "--allowed-root", str(tmp_path / "logs")],
        cwd=tmp_path / "cwd", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        lines = _start_lines(proc)
        print("\n".join(lines))
        port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", lines[0]).group(1))
        db = tmp_path / "state" / "trainguard" / "attrsvc.db"
        assert f"database: {db}" in lines[1]
        assert f"allowed roots: {os.path.realpath(tmp_path / 'logs')}" in lines[2]
        assert "ANONYMOUS" in lines[3]
        with AttributionClient(f"http://127.0.0.1:{port}", None) as client:
            rec = client.wait(client.submit("j", [str(tmp_path / "logs" / "a.log")])["id"], 30)
        assert rec["decision"] == "RESTART"
        assert db.exists() and not (tmp_path / "cwd" / "attrsvc.db").exists()
    finally:
        terminate_processes([proc], grace_s=10)
        proc.stderr.close()


def test_attrsvc_help_and_anonymous_rules(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRAINGUARD_ATTRSVC_API_KEYS", raising=False)
    with pytest.raises(SystemExit):
        main(["attrsvc", "--help"])
    help_text = _flat(capsys.readouterr().out)
    assert "default 8000" in help_text and "--allow-anonymous" in help_text
    assert "XDG_STATE_HOME/trainguard/attrsvc.db" in help_text
    assert main(["attrsvc", "--allowed-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--allow-anonymous" in err, "the message must name a flag that exists"
    assert main(["attrsvc", "--allowed-root", str(tmp_path), "--allow-anonymous",
                 "--host", "0.0.0.0"]) == 2
    assert "loopback" in capsys.readouterr().err
