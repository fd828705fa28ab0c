"""Compose: order, flattening, tuple spreading, None passthrough, errors and raising stages."""

from __future__ import annotations

import pytest

from trainguard.inprocess.compose import Compose
from trainguard.inprocess.exceptions import HealthCheckError, RankDiscarded, RestartAbort
from trainguard.inprocess.health_check import FaultCounter, HealthCheck
from trainguard.inprocess.initialize import RetryController
from trainguard.inprocess.rank_assignment import (
    MaxActiveWorldSize,
    RankAssignmentCtx,
    ShiftRanks,
)
from trainguard.inprocess.state import FrozenState, Mode, State


class Tag:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __call__(self, value):
        self.calls.append(self.name)
        return value + [self.name]

    def __repr__(self) -> str:
        return f"Tag({self.name})"


def test_right_to_left_order():
    calls: list = []
    f, g, h = Tag("f", calls), Tag("g", calls), Tag("h", calls)
    assert Compose(f, g, h)([]) == ["h", "g", "f"]
    assert calls == ["h", "g", "f"]
    assert Compose(f)([]) == ["f"]


def test_flattening():
    calls: list = []
    a, b, c, d = (Tag(x, calls) for x in "abcd")
    nested = Compose(a, Compose(b, Compose(c)), d)
    assert nested.instances == (a, b, c, d)
    assert nested([]) == ["d", "c", "b", "a"]
    assert repr(Compose(a, b)) == "Compose(Tag(a), Tag(b))"


def test_tuple_results_are_spread():
    seen = []
    split = lambda x: (x, x * 10)
    join = lambda a, b: seen.append((a, b)) or a + b
    assert Compose(join, split)(2) == 22
    assert seen == [(2, 20)]
    assert Compose(lambda a, b: a - b)(5, 3) == 2  # several call arguments are spread too


def test_none_result_warns_and_the_chain_returns_none():
    seen = []
    with pytest.warns(UserWarning, match="returned None"):
        assert Compose(lambda x: seen.append(x), lambda x: None)(1) is None
    assert seen == [None]  # the next stage got None, not the dropped input


def test_stages_without_arguments_chain_silently(recwarn):
    calls = []
    assert Compose(lambda: calls.append("a"), lambda: calls.append("b"))() is None
    assert calls == ["b", "a"] and not [w for w in recwarn if "returned None" in str(w.message)]


def test_compose_is_an_instance_of_the_common_base():
    class Base:
        def __call__(self, x):
            return x

    class A(Base):
        pass

    class B(A):
        pass

    both = Compose(A(), B())
    assert isinstance(both, Base) and isinstance(both, A) and not isinstance(both, B)
    assert isinstance(both, Compose) and type(both) is Compose
    assert not isinstance(Compose(A(), lambda x: x), Base)


@pytest.mark.parametrize("args", [(), (1,), ("x", print)])
def test_construction_errors(args):
    with pytest.raises(TypeError):
        Compose(*args)


def test_raising_stage_stops_the_chain():
    calls: list = []

    def boom(value):
        raise ValueError("stage failed")

    with pytest.raises(ValueError, match="stage failed"):
        Compose(Tag("left", calls), boom, Tag("right", calls))([])
    assert calls == ["right"]


def test_base_exception_passes_through():
    calls: list = []
    state = State(rank=0, world_size=1, iteration=3).freeze()
    with pytest.raises(RestartAbort):
        Compose(lambda s: calls.append(s), RetryController(max_iterations=3))(state)
    assert calls == []


def test_compose_of_health_checks_raising():
    class Broken(HealthCheck):
        def __call__(self, state: FrozenState) -> FrozenState:
            raise HealthCheckError(f"disk full on rank {state.rank}")

    state = State(rank=1, world_size=2, fn_exception=RuntimeError("x")).freeze()
    counter = FaultCounter(5)
    with pytest.raises(HealthCheckError, match="disk full on rank 1"):
        Compose(Broken(), counter)(state)
    assert counter.faults == 1  # the right-hand check ran first


def test_compose_of_rank_assignment_steps():
    ra = Compose(MaxActiveWorldSize(2), ShiftRanks())
    ctx = ra(RankAssignmentCtx(State(rank=3, world_size=4), None, {0}))
    assert (ctx.state.rank, ctx.state.world_size, ctx.state.mode) == (2, 3, Mode.INACTIVE)
    with pytest.raises(RankDiscarded):
        ra(RankAssignmentCtx(State(rank=0, world_size=4), None, {0}))
