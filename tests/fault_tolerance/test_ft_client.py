"""The shared-memory slot and the client outside a launcher (no processes)."""

import pytest

from trainguard._core.shm import unique_prefix
from trainguard.fault_tolerance import LauncherError, MonitorUnavailableError, RankMonitorClient
from trainguard.fault_tolerance._slot import EXT_BYTES, Slot, W


def test_client_marks_land_in_the_slot_words(monkeypatch):
    owner = Slot(unique_prefix("t") + "s", create=True)
    try:
        c = RankMonitorClient()
        reader = Slot(owner.name)
        c._bind(reader.words, ["step"])
        c.send_heartbeat()
        first = owner.get(W.HB_NS)
        c.send_heartbeat()
        assert owner.get(W.HB_NS) >= first > 0 and c._hb[1] > 0  # a gap between two beats
        assert owner.last_close_ns(1) == 0
        c.start_section("step")
        opened, _ = owner.section_state(0)
        assert opened > 0
        with pytest.raises(LauncherError, match="already open"):
            c.start_section("step")
        c.progress(5)
        assert owner.get(W.PROGRESS) == 5 and owner.section_state(0)[1] >= opened
        c.end_all_sections()
        assert owner.section_state(0)[0] == 0 and owner.last_close_ns(1) >= opened
        assert c._secs["step"][2] > 0  # the section's longest duration, for calculated timeouts
        c.start_section("not-configured")  # no-op, like NVRx
        reader.close()
    finally:
        owner.close()


def test_extension_records_round_trip_and_reject_torn_reads():
    owner = Slot(unique_prefix("t") + "x", create=True)
    try:
        assert owner.read_ext() is None
        owner.write_ext(7, b"straggler summary v1")
        assert owner.read_ext() == (7, b"straggler summary v1")
        with pytest.raises(ValueError, match="does not fit"):
            owner.write_ext(1, b"x" * EXT_BYTES)
    finally:
        owner.close()


def test_client_outside_the_launcher_never_blocks_and_says_why(monkeypatch):
    monkeypatch.delenv("TRAINGUARD_FT_SLOT", raising=False)
    c = RankMonitorClient()
    c.send_heartbeat()
    with c.section("step"):
        c.progress()
    assert c.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False
    with pytest.raises(MonitorUnavailableError, match="not started by 'trainguard launch'"):
        c.init_workload_monitoring()
    c.load_state_dict({"current_timeouts": {"heartbeat": {"initial": 9.0, "subsequent": 3.0,
                                                          "were_calculated": True}}})
    assert c.state_dict()["current_timeouts"]["heartbeat"]["subsequent"] == 3.0
