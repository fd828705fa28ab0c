"""Each capability's public surface: ``__all__`` resolves, is sorted, and has no duplicates."""

import importlib

import pytest

SUBPACKAGES = [
    "trainguard",
    "trainguard.inprocess",
    "trainguard.checkpointing",
    "trainguard.attribution",
    "trainguard.runner",
    "trainguard.straggler",
    "trainguard.testing",
    "trainguard.fault_tolerance",
    "trainguard.integrations",
]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_all_is_complete_and_sorted(name):
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"{name}: duplicate names in __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}: __all__ names missing from module: {missing}"
    assert list(exported) == sorted(exported), f"{name}: __all__ is not sorted"


def test_inprocess_contract_names():
    inprocess = importlib.import_module("trainguard.inprocess")
    for n in ("Wrapper", "CallWrapper", "State", "FrozenState", "Mode", "Compose", "ShiftRanks",
              "FillGaps", "Tree", "Layer", "LayerFlag", "RetryController", "FaultCounter",
              "RestartAbort", "RankShouldRestart"):
        assert n in inprocess.__all__, n
    assert [m.name for m in inprocess.Mode] == ["INITIALIZED", "ACTIVE", "INACTIVE", "TERMINATED"]


def test_fault_tolerance_contract_names():
    ft = importlib.import_module("trainguard.fault_tolerance")
    for n in ("RankMonitorClient", "WorkloadControlRequest", "WorkloadAction",
              "FaultToleranceConfig", "LauncherError"):
        assert n in ft.__all__, n
    client = ft.RankMonitorClient
    for m in ("init_workload_monitoring", "send_heartbeat", "start_section", "end_section",
              "end_all_sections", "section", "progress", "calculate_and_set_hb_timeouts",
              "calculate_and_set_section_timeouts", "state_dict", "load_state_dict",
              "send_workload_control_request", "shutdown_workload_monitoring"):
        assert callable(getattr(client, m)), m
