"""Restart policies: RetryController and FaultCounter, alone and across simulated restarts."""

from __future__ import annotations

import pytest

from trainguard.errors import ConfigError
from trainguard.inprocess.exceptions import FaultCounterExceeded, RestartAbort, RestartError
from trainguard.inprocess.health_check import FaultCounter
from trainguard.inprocess.initialize import Initialize, RetryController
from trainguard.inprocess.rank_assignment import RankAssignmentCtx, default_rank_assignment
from trainguard.inprocess.state import Mode, State


def frozen(iteration=0, world=4, active=4, exc=None):
    return State(
        rank=0,
        world_size=world,
        active_rank=0,
        active_world_size=active,
        initial_rank=0,
        initial_world_size=world,
        iteration=iteration,
        mode=Mode.ACTIVE,
        fn_exception=exc,
    ).freeze()


def test_retry_controller_max_iterations_means_attempts():
    ctl = RetryController(max_iterations=4)
    assert isinstance(ctl, Initialize)
    for it in range(4):
        assert ctl(frozen(it)) is not None
    with pytest.raises(RestartAbort, match=r"iteration=4 >= max_iterations=4") as info:
        ctl(frozen(4))
    assert not isinstance(info.value, Exception)  # terminal: the rank leaves, no restart


@pytest.mark.parametrize(
    "kwargs, state, match",
    [
        ({"min_world_size": 3}, frozen(world=2, active=2), r"world_size 2 < min_world_size=3"),
        ({"min_active_world_size": 2}, frozen(active=1), r"active_world_size 1 < min_active"),
        ({"min_active_world_size": 1}, frozen(active=0), r"active_world_size 0"),
    ],
)
def test_retry_controller_world_size_limits(kwargs, state, match):
    with pytest.raises(RestartAbort, match=match):
        RetryController(**kwargs)(state)


def test_retry_controller_lists_every_violation():
    with pytest.raises(RestartAbort) as info:
        RetryController(max_iterations=1, min_world_size=5, min_active_world_size=5)(frozen(1))
    text = str(info.value)
    assert "max_iterations=1" in text and "min_world_size=5" in text and "min_active" in text


def test_retry_controller_is_none_safe():
    """Megatron-Bridge #4944: None limits or an unassigned active world size must not TypeError."""
    state = State(rank=0, world_size=1, iteration=100).freeze()  # active_world_size is None
    assert RetryController()(state) is state
    assert RetryController(None, None, None)(frozen(10**6, world=1, active=0)) is not None
    assert RetryController(min_active_world_size=None)(frozen(active=0)) is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_iterations": 0},
        {"max_iterations": -1},
        {"max_iterations": True},
        {"max_iterations": 2.5},
        {"max_iterations": "3"},
        {"min_world_size": -1},
        {"min_active_world_size": 1.0},
    ],
)
def test_retry_controller_validation(kwargs):
    with pytest.raises(ConfigError, match="RetryController"):
        RetryController(**kwargs)


def test_five_restarts_then_abort():
    """Repeated faults: the loop restarts 5 times and the 6th attempt is refused."""
    ctl, counter = RetryController(max_iterations=6), FaultCounter(max_rank_faults=10)
    state = State(rank=0, world_size=2, initial_rank=0, initial_world_size=2)
    ra = default_rank_assignment()
    state = ra(RankAssignmentCtx(state, None, set())).state
    attempts = 0
    with pytest.raises(RestartAbort, match="iteration=6"):
        while True:
            ctl(state.freeze())
            attempts += 1
            state.fn_exception = RuntimeError(f"fault {attempts}")
            counter(state.freeze())
            state = ra(RankAssignmentCtx(state, None, set())).state
            state.advance()
    assert attempts == 6 and counter.faults == 6


def test_retry_controller_after_rank_loss():
    state = State(rank=0, world_size=4, initial_rank=0, initial_world_size=4)
    ra = default_rank_assignment()
    state = ra(RankAssignmentCtx(state, None, set())).state
    ctl = RetryController(min_world_size=3)
    ctl(state.freeze())
    state = ra(RankAssignmentCtx(state, None, {2, 3})).state
    with pytest.raises(RestartAbort, match="world_size 2 < min_world_size=3"):
        ctl(state.freeze())


def test_fault_counter_counts_each_fault_once():
    counter = FaultCounter(max_rank_faults=2)
    assert counter(frozen(0)) is not None and counter.faults == 0  # no own fault
    err = ValueError("a")
    for _ in range(3):  # the same fault seen by several checks in one iteration
        counter(frozen(0, exc=err))
    assert counter.faults == 1
    counter(frozen(1, exc=ValueError("b")))
    with pytest.raises(FaultCounterExceeded, match=r"faulted 3 times, more than max_rank_faults=2"):
        counter(frozen(2, exc=ValueError("c")))
    assert issubclass(FaultCounterExceeded, RestartError)


def test_fault_counter_zero_unlimited_and_reset():
    with pytest.raises(FaultCounterExceeded, match="ValueError"):
        FaultCounter(0)(frozen(0, exc=ValueError("first")))
    unlimited = FaultCounter()
    for it in range(50):
        unlimited(frozen(it, exc=RuntimeError(str(it))))
    assert unlimited.faults == 50
    unlimited.reset()
    assert unlimited.faults == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_fault_counter_validation(bad):
    with pytest.raises(ConfigError):
        FaultCounter(bad)
