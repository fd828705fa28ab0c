"""The public surface of trainguard.checkpointing stays small, sorted and importable."""

import importlib

import pytest

from trainguard.checkpointing import errors
from trainguard.errors import ConfigError, TrainguardError, TrainguardTimeout


@pytest.mark.parametrize("name", ["trainguard.checkpointing", "trainguard.checkpointing.async_ckpt",
                                  "trainguard.checkpointing.local"])
def test_all_sorted_and_importable(name):
    mod = importlib.import_module(name)
    assert mod.__all__ == sorted(mod.__all__)
    for attr in mod.__all__:
        assert getattr(mod, attr) is not None, attr


def test_error_tree():
    assert issubclass(errors.CheckpointError, TrainguardError)
    assert issubclass(errors.CheckpointTimeout, TimeoutError)
    assert issubclass(errors.CheckpointTimeout, TrainguardTimeout)
    assert issubclass(errors.CheckpointWorkerError, errors.CheckpointWriteError)
    for cls in (errors.StateDictError, errors.CheckpointMismatchError):
        assert issubclass(cls, ConfigError) and issubclass(cls, ValueError)
    exc = errors.CheckpointWriteError("x", {1: "boom"})
    assert exc.failures == {1: "boom"}
