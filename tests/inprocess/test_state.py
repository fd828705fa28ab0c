"""State / FrozenState / Mode semantics."""

from __future__ import annotations

import dataclasses

import pytest

from trainguard.errors import ConfigError
from trainguard.inprocess.state import FrozenState, Mode, State

FIELDS = [
    "rank",
    "world_size",
    "active_rank",
    "active_world_size",
    "initial_rank",
    "initial_world_size",
    "iteration",
    "mode",
    "fn_exception",
]


def test_fields_and_modes():
    assert [f.name for f in dataclasses.fields(State)] == FIELDS
    assert [f.name for f in dataclasses.fields(FrozenState)] == FIELDS
    assert [m.name for m in Mode] == ["INITIALIZED", "ACTIVE", "INACTIVE", "TERMINATED"]


def test_freeze_is_read_only_copy():
    err = ValueError("boom")
    state = State(
        rank=1,
        world_size=4,
        active_rank=1,
        active_world_size=4,
        initial_rank=1,
        initial_world_size=4,
        iteration=2,
        mode=Mode.ACTIVE,
        fn_exception=err,
    )
    frozen = state.freeze()
    assert isinstance(frozen, FrozenState)
    assert all(getattr(frozen, n) is getattr(state, n) for n in FIELDS)
    assert frozen.fn_exception is err  # shared, not deep-copied (frames are not copyable)
    for name in FIELDS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, name, None)
    state.rank = 3  # the snapshot does not follow later changes
    assert frozen.rank == 1


def test_frozen_mutation_is_an_exception_so_it_restarts():
    """A hook mutating its FrozenState raises an Exception (restart), not a BaseException."""
    frozen = State(rank=0, world_size=1).freeze()
    with pytest.raises(Exception) as info:
        frozen.iteration = 5  # type: ignore[misc]
    assert isinstance(info.value, dataclasses.FrozenInstanceError)


def test_thaw_round_trip_is_independent():
    frozen = State(rank=2, world_size=3, iteration=4, mode=Mode.INACTIVE).freeze()
    thawed = frozen.thaw()
    assert isinstance(thawed, State) and thawed.freeze() == frozen
    thawed.iteration = 9
    assert frozen.iteration == 4


def test_from_env_defaults_and_values(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    state = State.from_env()
    assert (state.rank, state.world_size, state.initial_rank, state.initial_world_size) == (
        0,
        1,
        0,
        1,
    )
    assert (state.iteration, state.mode, state.active_rank, state.fn_exception) == (
        0,
        Mode.INITIALIZED,
        None,
        None,
    )
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    state = State.from_env()
    assert (state.rank, state.world_size, state.initial_rank, state.initial_world_size) == (
        3,
        8,
        3,
        8,
    )
    assert State.from_env({"RANK": "1", "WORLD_SIZE": "2"}).rank == 1


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "must be integers"),
        ({"RANK": "1", "WORLD_SIZE": "two"}, "must be integers"),
        ({"RANK": "None", "WORLD_SIZE": "2"}, "must be integers"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2, WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ],
)
def test_from_env_rejects_bad_values(env, match):
    with pytest.raises(ConfigError, match=match) as info:
        State.from_env(env)
    assert isinstance(info.value, ValueError)


def test_advance_clears_exception():
    state = State(rank=0, world_size=1, fn_exception=RuntimeError("x"))
    state.advance()
    state.advance()
    assert state.iteration == 2 and state.fn_exception is None


def test_set_distributed_vars_never_writes_none():
    env = {"RANK": "5", "WORLD_SIZE": "8"}
    State(
        rank=3, world_size=4, active_rank=None, active_world_size=2, mode=Mode.INACTIVE
    ).set_distributed_vars(env)
    assert env == {"WORLD_SIZE": "2"}  # RANK removed, not "None"
    State(
        rank=1, world_size=4, active_rank=1, active_world_size=2, mode=Mode.ACTIVE
    ).set_distributed_vars(env)
    assert env == {"RANK": "1", "WORLD_SIZE": "2"}
    env = {"WORLD_SIZE": "8"}
    State(rank=0, world_size=1).set_distributed_vars(env)  # nothing assigned yet
    assert env == {"WORLD_SIZE": "8"} and "None" not in env.values()


def test_set_distributed_vars_uses_os_environ(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "9")
    State(rank=0, world_size=2, active_rank=0, active_world_size=2).set_distributed_vars()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "2")
