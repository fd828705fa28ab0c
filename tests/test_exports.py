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
