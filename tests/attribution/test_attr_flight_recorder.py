"""Flight-recorder analysis: handed fixtures, unsafe dumps, mixed jobs, mismatches."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
from attr_data import FR, injected_ranks

from trainguard.attribution import FlightRecorderError, analyze_flight_recorder
from trainguard.cli import main

SCENARIOS = sorted(p for p in FR.iterdir() if (p / "fault_injection.log").exists())


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_names_every_injected_rank(scenario):
    report = analyze_flight_recorder(str(scenario))
    assert report.ranks == list(range(16))
    assert report.faulty_ranks == injected_ranks(scenario)
    assert report.first_stuck is not None and report.first_stuck["pg_desc"]


def test_gpu_error_ranks_joined_but_never_completed():
    report = analyze_flight_recorder(str(FR / "gpu_error_1st"))
    # rank 14 keeps enqueuing (never "missing") but never completes what its peers completed
    assert 14 not in report.missing_ranks and 14 in report.incomplete_ranks
    assert report.first_stuck["pg_desc"] == "TENSOR_MODEL_PARALLEL_GROUP"


def test_cli_fr_dir_without_logs(capsys):
    assert main(["analyze", "--fr-dir", str(FR / "lock_gil_1st"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["flight_recorder"]
    assert out["faulty_ranks"] == [9, 14] and out["missing_ranks"] == [9, 14]
    assert out["process_group"] == "EXPERT_MODEL_PARALLEL_GROUP"
    assert isinstance(out["mismatches"], list)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED_MARKER",))


def test_pickle_that_builds_objects_is_refused(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "_dump_0").write_bytes(pickle.dumps({"entries": [], "pg_config": {}, "x": _Evil()}))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(FlightRecorderError, match="refusing to load posix.system"):
            analyze_flight_recorder(str(d))
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "PWNED_MARKER").exists()


@pytest.mark.parametrize("payload,match", [
    (b"\x80\x04\x95garbage", "not a readable"),
    (pickle.dumps([1, 2, 3]), "expected a dict"),
    (pickle.dumps({"entries": "nope", "pg_config": {}}), "missing 'entries'"),
    (b"", "not a readable"),
])
def test_malformed_dumps(tmp_path, payload, match):
    (tmp_path / "_dump_0").write_bytes(payload)
    with pytest.raises(FlightRecorderError, match=match):
        analyze_flight_recorder(str(tmp_path))


def test_mixed_jobs_directory_is_refused(tmp_path):
    for rank in range(4):
        shutil.copy(FR / "gpu_error_1st" / f"_dump_{rank}", tmp_path / f"_dump_{rank}")
    shutil.copy(FR / "lock_gil_1st" / "_dump_9", tmp_path / "_dump_9")
    with pytest.raises(FlightRecorderError, match="different jobs"):
        analyze_flight_recorder(str(tmp_path))


def test_empty_directory(tmp_path):
    with pytest.raises(FlightRecorderError, match="no flight-recorder dumps"):
        analyze_flight_recorder(str(tmp_path))


def _entry(seq, op="nccl:all_reduce", size=(4, 4), dtype="Float"):
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "profiling_name": op,
            "input_sizes": [list(size)], "output_sizes": [list(size)], "input_dtypes": [dtype],
            "output_dtypes": [dtype], "state": "scheduled", "time_created_ns": seq, "is_p2p": False}


def _dump(entries, enq, comp):
    return {"version": "2.9", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                  "ranks": "[0, 1, 2]"}},
            "pg_status": {"0": {"last_enqueued_collective": enq, "last_completed_collective": comp,
                                "last_started_collective": -1}}, "entries": entries}


def test_mismatch_and_missing_rank_in_synthetic_job(tmp_path):
    dumps = {0: _dump([_entry(5), _entry(6)], 6, 4),
             1: _dump([_entry(5, dtype="BFloat16"), _entry(6)], 6, 4),
             2: _dump([], 4, 4)}  # rank 2 never issued seq 5
    for rank, dump in dumps.items():
        (tmp_path / f"nccl_trace_rank_{rank}.json").write_text(json.dumps(dump))
    report = analyze_flight_recorder(str(tmp_path / "nccl_trace_rank_"))
    assert report.missing_ranks == [2] and report.faulty_ranks == [2]
    assert report.mismatches[0]["kind"] == "input_dtypes"
    assert report.mismatches[0]["collective_seq_id"] == 5
    assert report.first_stuck["collective_seq_id"] == 5


def test_dump_symlink_escaping_root_is_refused(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copy(FR / "lock_gil_1st" / "_dump_0", outside / "_dump_0")
    os.symlink(outside / "_dump_0", root / "_dump_0")
    with pytest.raises(FlightRecorderError, match="outside the allowed roots"):
        analyze_flight_recorder(str(root), within=[os.path.realpath(root)])


def test_log_and_dumps_together_name_the_hung_ranks(capsys):
    from attr_data import LOGS

    assert main(["analyze", str(LOGS / "run_01.log"), "--fr-dir", str(FR / "lock_gil_1st"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["primary_category"] == "collective_timeout" and out["decision"] == "RESTART"
    assert out["culprit_ranks"] == [9, 14]  # the log alone cannot tell; the dumps can
