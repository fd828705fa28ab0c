"""Suite-wide fixtures: every test must leave no child process and no shared-memory segment."""

from __future__ import annotations

import os

import pytest

from trainguard.testing import LeakChecker, free_port

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.pop("LOCAL_RANK", None)  # tests must not inherit a launcher's environment


@pytest.fixture(autouse=True)
def no_leaks(request):
    checker = LeakChecker()
    yield
    if request.node.get_closest_marker("allow_children"):
        return
    problems = checker.check()
    if problems:
        pytest.fail("resource leak after test:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture
def port() -> int:
    return free_port()
