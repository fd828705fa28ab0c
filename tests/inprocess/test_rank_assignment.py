"""Rank assignment: spec worked examples, invariants on every simulated rank, multi-process."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard._core.net import free_port
from trainguard._core.procs import terminate_processes
from trainguard.errors import ConfigError
from trainguard.inprocess.compose import Compose
from trainguard.inprocess.exceptions import BarrierTimeout, InternalError, RankDiscarded
from trainguard.inprocess.rank_assignment import (
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignmentCtx,
    ShiftRanks,
    Tree,
    default_rank_assignment,
)
from trainguard.inprocess.rank_assignment._tree import announce
from trainguard.inprocess.state import Mode, State

R, B = LayerFlag.RESERVE, LayerFlag.BACKFILL


def fresh(rank: int, world: int) -> State:
    return State(rank=rank, world_size=world, initial_rank=rank, initial_world_size=world)


class Job:
    """W simulated ranks, each with its own rank-assignment instance and State, one store.

    Killed ranks take no part (their processes are gone); ranks discarded by the assignment
    raise RankDiscarded. After every round the cross-rank invariants are checked.
    """

    def __init__(self, make, world: int, store=None, preserve_order=True, ras=None) -> None:
        self.world = world
        self.ras = ras if ras is not None else {r: make() for r in range(world)}
        self.states = {r: fresh(r, world) for r in range(world)}
        self.store = store if store is not None else dist.HashStore()
        self.preserve_order = preserve_order
        self.discarded: set[int] = set()
        self._round(set(), threaded=True)

    def _round(self, terminated: set[int], threaded: bool) -> None:
        callers = [i for i, s in self.states.items() if s.rank not in terminated]
        before = {i: self.states[i].rank for i in callers}
        prev_a = {s.active_world_size for s in self.states.values()}

        def one(i):
            ctx = RankAssignmentCtx(self.states[i], self.store, set(terminated))
            try:
                return i, self.ras[i](ctx).state
            except RankDiscarded:
                return i, None

        if threaded:
            with ThreadPoolExecutor(max_workers=max(1, len(callers))) as pool:
                results = list(pool.map(one, callers))
        else:
            results = [one(i) for i in callers]
        self.states = {i: s for i, s in results if s is not None}
        self.discarded |= {i for i, s in results if s is None}
        self.check(before, prev_a)

    def check(self, before: dict[int, int], prev_a: set) -> None:
        states = list(self.states.values())
        if not states:
            return
        world = len(states)
        assert {s.world_size for s in states} == {world}
        assert sorted(s.rank for s in states) == list(range(world))
        (active_ws,) = {s.active_world_size for s in states}
        actives = sorted(s.active_rank for s in states if s.mode is Mode.ACTIVE)
        assert actives == list(range(active_ws))
        for s in states:
            assert s.mode in (Mode.ACTIVE, Mode.INACTIVE)
            assert (s.active_rank is None) == (s.mode is Mode.INACTIVE)
            env: dict = {}
            s.set_distributed_vars(env)
            assert env.get("RANK") != "None" and env["WORLD_SIZE"] == str(active_ws)
        if None not in prev_a:
            assert active_ws <= min(prev_a), "A must never grow"
        if self.preserve_order:
            survivors = sorted(self.states, key=before.__getitem__)
            assert [self.states[i].rank for i in survivors] == list(range(world))
        tables = {
            json.dumps([tuple(map(str, e)) for e in ra.table()])
            for i, ra in self.ras.items()
            if i in self.states and hasattr(ra, "table")
        }
        assert len(tables) <= 1, "ranks disagree on the tree"

    def kill(self, *initial: int, threaded: bool = False) -> None:
        self._round({self.states[i].rank for i in initial}, threaded)

    def kill_rank(self, *ranks: int, threaded: bool = False) -> None:
        self._round(set(ranks), threaded)

    def active(self) -> list:
        return [self.states[i].active_rank if i in self.states else None for i in range(self.world)]

    def ranks(self) -> dict[int, int]:
        return {i: s.rank for i, s in self.states.items()}


# -- ShiftRanks / FillGaps ----------------------------------------------------------------------
def test_shift_ranks_spec_example():
    job = Job(ShiftRanks, 8)
    job.kill(1, 4, 5)
    assert job.ranks() == {0: 0, 2: 1, 3: 2, 6: 3, 7: 4}
    assert all(s.world_size == 5 and s.mode is Mode.ACTIVE for s in job.states.values())


def test_fill_gaps_correct_semantics():
    """Spec §14 defect 1: W=8, T={1,4,5} -> 6->1, 7->4 (NVRx asserted 6->4, 7->5)."""
    job = Job(FillGaps, 8, preserve_order=False)
    job.kill(1, 4, 5)
    assert job.ranks() == {0: 0, 2: 2, 3: 3, 6: 1, 7: 4}
    assert {s.world_size for s in job.states.values()} == {5}


@pytest.mark.parametrize("step", [ShiftRanks, FillGaps])
def test_terminated_rank_is_discarded(step):
    ctx = RankAssignmentCtx(fresh(3, 6), None, {3})
    with pytest.raises(RankDiscarded, match="rank 3"):
        step()(ctx)


@pytest.mark.parametrize("step", [ShiftRanks, FillGaps])
def test_fill_and_shift_random(step):
    rng = random.Random(7)
    for _ in range(50):
        world = rng.randint(1, 20)
        job = Job(step, world, preserve_order=step is ShiftRanks)
        while len(job.states) > 1:
            victims = rng.sample(sorted(job.states), rng.randint(1, len(job.states) - 1))
            before = job.ranks()
            job.kill(*victims)
            if step is FillGaps:  # ranks below W' keep their index
                for i, r in job.ranks().items():
                    if before[i] < len(job.states):
                        assert r == before[i]


def test_step_does_not_mutate_its_input():
    state = fresh(2, 4)
    ctx = RankAssignmentCtx(state, None, {0})
    out = ShiftRanks()(ctx)
    assert (state.rank, state.world_size, ctx.terminated_ranks) == (2, 4, {0})
    assert (out.state.rank, out.state.world_size, out.terminated_ranks) == (1, 3, set())


@pytest.mark.parametrize(
    "ctx, match",
    [
        (RankAssignmentCtx(fresh(0, 4), None, {4}), "outside"),
        (RankAssignmentCtx(State(rank=None, world_size=4), None, set()), "rank=None"),
        (RankAssignmentCtx(State(rank=5, world_size=4), None, set()), "rank=5"),
    ],
)
def test_invalid_context(ctx, match):
    with pytest.raises(InternalError, match=match):
        ShiftRanks()(ctx)
    with pytest.raises(TypeError):
        ShiftRanks()(fresh(0, 1))


# -- filters ------------------------------------------------------------------------------------
def test_divisible_max_shift_spec_example():
    """Compose(DivBy(3), MaxAWS(8), Shift()) with 10 survivors: 6 active, 4 in reserve."""
    job = Job(
        lambda: Compose(ActiveWorldSizeDivisibleBy(3), MaxActiveWorldSize(8), ShiftRanks()), 12
    )
    job.kill(3, 9)
    modes = [job.states[i].mode for i in sorted(job.states)]
    assert modes.count(Mode.ACTIVE) == 6 and modes.count(Mode.INACTIVE) == 4
    assert [job.states[i].active_rank for i in sorted(job.states)][6:] == [None] * 4


def test_reserve_rank_takes_over_and_active_never_grows():
    job = Job(lambda: Compose(MaxActiveWorldSize(4), ShiftRanks()), 6)
    assert job.active() == [0, 1, 2, 3, None, None]
    job.kill(1)
    assert job.active() == [0, None, 1, 2, 3, None]
    job.kill(0, 2)
    assert job.active() == [None, None, None, 0, 1, 2]


def test_activate_all_and_default():
    job = Job(default_rank_assignment, 4)
    assert job.active() == [0, 1, 2, 3]
    job.kill(2)
    assert job.active() == [0, 1, None, 2]
    assert default_rank_assignment() is not default_rank_assignment()


def test_divisible_by_can_reach_zero():
    job = Job(lambda: Compose(ActiveWorldSizeDivisibleBy(4), ShiftRanks()), 5)
    assert job.active() == [0, 1, 2, 3, None]
    job.kill(0, 1)
    assert job.active() == [None] * 5 and {s.active_world_size for s in job.states.values()} == {0}


def test_filter_rejects_unindexed_terminated_set():
    with pytest.raises(InternalError, match="ShiftRanks"):
        MaxActiveWorldSize(2)(RankAssignmentCtx(fresh(0, 4), None, {1}))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_filter_arguments_validated(bad):
    with pytest.raises(ConfigError):
        MaxActiveWorldSize(bad)
    with pytest.raises(ConfigError):
        ActiveWorldSizeDivisibleBy(bad)
    with pytest.raises(ConfigError):
        ActiveWorldSizeDivisibleBy(None)  # type: ignore[arg-type]
    assert MaxActiveWorldSize(None).max_active_world_size is None  # NVRx's default: no cap


# -- FilterCountGroupedByKey --------------------------------------------------------------------
def pairs_filter():
    return Compose(ShiftRanks(), FilterCountGroupedByKey(lambda s: s.rank // 2, lambda n: n == 2))


def test_filter_count_spec_example_threads():
    job = Job(pairs_filter, 8)
    assert job.active() == list(range(8))
    job.kill(1, 4, 5, 6, threaded=True)
    assert job.ranks() == {2: 0, 3: 1} and job.discarded == {0, 7}
    job.kill(threaded=True)  # another iteration on the same store: keys are namespaced
    assert job.ranks() == {2: 0, 3: 1}


def test_filter_count_timeout_names_the_step():
    step = FilterCountGroupedByKey("all", lambda n: True, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(BarrierTimeout, match="FilterCountGroupedByKey"):
        step(RankAssignmentCtx(fresh(0, 2), dist.HashStore(), set()))
    took = time.monotonic() - start
    print(f"FilterCountGroupedByKey timeout after {took:.3f} s (limit 0.3 s)")
    assert took < 3.0


def test_filter_count_needs_store_and_json_key():
    with pytest.raises(InternalError, match="store"):
        FilterCountGroupedByKey("k", bool)(RankAssignmentCtx(fresh(0, 1), None, set()))
    with pytest.raises(TypeError, match="JSON"):
        FilterCountGroupedByKey(lambda s: object(), bool)(
            RankAssignmentCtx(fresh(0, 1), dist.HashStore(), set())
        )
    with pytest.raises(ConfigError):
        FilterCountGroupedByKey("k", "not callable")  # type: ignore[arg-type]


def _filter_count_worker(port: int, rank: int, world: int, dead: list) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    ra = pairs_filter()
    try:
        state = ra(RankAssignmentCtx(fresh(rank, world), store, set(dead))).state
        # second iteration over the same store with no new loss: the survivors stay
        state = ra(RankAssignmentCtx(state, store, set())).state
        out = {"rank": state.rank, "world": state.world_size, "active": state.active_rank}
    except RankDiscarded as exc:
        out = {"discarded": str(exc)}
    store.set(f"result/{rank}", json.dumps(out))


@pytest.mark.timeout(90)
def test_filter_count_multiprocess_tcpstore():
    """Real processes on a TCPStore: survivors of W=8, T={1,4,5,6} with pairs that must be whole."""
    world, dead = 8, [1, 4, 5, 6]
    # Forked, not spawned: the workers use a store client and pure-Python rank assignment only,
    # so they need no fresh interpreter (no torch import per process). They fork before the store
    # server starts (no server thread to copy) and connect to its port, retrying, once it is up.
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_filter_count_worker, args=(port, r, world, dead))
        for r in range(world)
        if r not in dead
    ]
    try:
        start = time.monotonic()
        for p in procs:
            p.start()
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30),
            wait_for_workers=False
        )
        for p in procs:
            p.join(75)
        print(f"4 processes ran FilterCountGroupedByKey in {time.monotonic() - start:.2f} s")
        assert [p.exitcode for p in procs] == [0] * len(procs)
        results = {r: json.loads(store.get(f"result/{r}")) for r in (0, 2, 3, 7)}
    finally:
        terminate_processes(procs, grace_s=2)
    assert "discarded" in results[0] and "discarded" in results[7]
    assert results[2] == {"rank": 0, "world": 2, "active": 0}
    assert results[3] == {"rank": 1, "world": 2, "active": 1}


# -- Tree ---------------------------------------------------------------------------------------
def two_by_four(max_ranks=None, root_flag=None, group_flag=None, min_ranks=1):
    return lambda: Tree(
        [
            Layer(flag=root_flag),
            Layer(
                min_ranks=min_ranks,
                max_ranks=max_ranks,
                key_or_fn=lambda s: s.initial_rank // 4,
                flag=group_flag,
            ),
        ]
    )


def test_tree_reserve_spec_table():
    job = Job(two_by_four(max_ranks=3, root_flag=R, group_flag=R), 8)
    assert job.active() == [0, 1, 2, None, 3, 4, 5, None]
    job.kill_rank(1)
    assert job.active() == [0, None, 2, 1, 3, 4, 5, None]
    job.kill_rank(3)  # "new rank 3" = initial rank 4
    assert job.active() == [0, None, 2, 1, None, 4, 5, 3]
    job.kill_rank(1)  # "new rank 1" = initial rank 2; no spare is left
    assert job.active() == [0, None, None, 1, None, 3, 4, 2]
    assert {s.mode for i, s in job.states.items() if i in (0, 3, 5, 6, 7)} == {Mode.ACTIVE}


@pytest.mark.parametrize(
    "root_flag, group_flag, expected",
    [
        (B, B, [0, None, 2, 3, 4, 5, 6, 1]),  # full BACKFILL: the highest rank overall moves
        (None, B, [0, None, 2, 1, 3, 4, 5, 6]),  # group-only: the group's highest moves, then shift
        (None, None, [0, None, 1, 2, 3, 4, 5, 6]),  # none: shift
        (B, None, [0, None, 1, 2, 3, 4, 5, 6]),  # BACKFILL chain must start at the leaves' layer
    ],
)
def test_tree_backfill_spec_table(root_flag, group_flag, expected):
    job = Job(two_by_four(root_flag=root_flag, group_flag=group_flag), 8)
    assert job.active() == list(range(8))
    job.kill(1)
    assert job.active() == expected


def test_tree_min_ranks_terminates_branch():
    job = Job(two_by_four(min_ranks=3), 8)
    job.kill(0, 2)
    assert job.active() == [None, None, None, None, 0, 1, 2, 3]
    assert job.discarded == {1, 3}


def test_tree_spare_respects_max_of_its_own_group():
    """A spare in another group is only taken if that group stays within max_ranks."""
    job = Job(two_by_four(max_ranks=3, root_flag=R, group_flag=R), 8)
    job.kill(1, 3)  # group 0 has no spare left; group 1's spare 7 would make it 4 > max 3
    assert job.active() == [0, None, 1, None, 2, 3, 4, None]


def test_tree_spare_from_root_when_group_has_none():
    job = Job(
        lambda: Tree(
            [
                Layer(flag=R),
                Layer(max_ranks=3, key_or_fn=lambda s: s.initial_rank // 4),
                Layer(key_or_fn=lambda s: s.initial_rank),
            ]
        ),
        8,
    )
    assert job.active() == [0, 1, 2, None, 3, 4, 5, None]
    job.kill(1)  # no RESERVE below the root: the root's first spare (rank 3, same group) fits
    assert job.active() == [0, None, 2, 1, 3, 4, 5, None]


def test_tree_world_size_filter_and_reserves():
    job = Job(lambda: Tree([Layer(flag=R)], world_size_filter=lambda a: a - a % 4), 7)
    assert job.active() == [0, 1, 2, 3, None, None, None]
    job.kill(2)
    assert job.active() == [0, 1, None, 3, 2, None, None]
    job.kill(0, 1, 3)  # 3 left: the filter rounds A down to 0
    assert job.active() == [None] * 7 and len(job.states) == 3


def test_tree_bad_filter_and_root_keys():
    with pytest.raises(ConfigError, match="world_size_filter"):
        Job(lambda: Tree([Layer()], world_size_filter=lambda a: a + 1), 2)
    with pytest.raises(ConfigError, match="root layer"):
        Job(lambda: Tree([Layer(key_or_fn=lambda s: s.initial_rank)]), 2)
    for bad in ([], [object()], None):
        with pytest.raises((ConfigError, TypeError)):
            Tree(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Layer(min_ranks=-1)
    with pytest.raises(ConfigError):
        Layer(max_ranks=0)
    with pytest.raises(ConfigError):
        Layer(flag="RESERVE")  # type: ignore[arg-type]


def test_tree_rebuilds_per_call_and_never_exports_none():
    """Spec §14 defect 4: the same Tree instances used by a second Wrapper call start over."""
    job = Job(two_by_four(max_ranks=3, root_flag=R, group_flag=R), 8)
    job.kill(1)
    # second call: fresh States (Mode.INITIALIZED), the same Tree objects, a new store
    job2 = Job(None, 8, ras=job.ras)
    assert job2.active() == [0, 1, 2, None, 3, 4, 5, None]
    for s in job2.states.values():
        env = {"RANK": "stale"}
        s.set_distributed_vars(env)
        assert env.get("RANK") == (None if s.active_rank is None else str(s.active_rank))


def test_tree_reset_and_mismatch():
    job = Job(two_by_four(), 4)
    tree = job.ras[0]
    state = State(rank=0, world_size=3, initial_rank=0, initial_world_size=4, mode=Mode.ACTIVE)
    with pytest.raises(InternalError, match="reset"):
        tree(RankAssignmentCtx(state, job.store, set()))
    tree.reset()
    assert tree.table() == []


def test_tree_reuses_a_persistent_store_across_calls():
    store = dist.HashStore()
    first = Job(two_by_four(max_ranks=3, root_flag=R, group_flag=R), 8, store=store)
    second = Job(two_by_four(max_ranks=2, root_flag=R, group_flag=R), 8, store=store)
    assert first.active() == [0, 1, 2, None, 3, 4, 5, None]
    assert second.active() == [0, 1, None, None, 2, 3, None, None]


def test_tree_megatron_style_root_reserve():
    """Root min=max=A with RESERVE: spares replace lost ranks until fewer than A are healthy,
    then every rank is discarded (the job cannot run at its fixed size)."""
    job = Job(lambda: Tree([Layer(min_ranks=4, max_ranks=4, flag=R)]), 6)
    assert job.active() == [0, 1, 2, 3, None, None]
    job.kill(2)
    assert job.active() == [0, 1, None, 3, 2, None]
    job.kill(0)
    assert job.active() == [None, 1, None, 3, 2, 0]
    job.kill(5)
    assert job.states == {} and job.discarded == {1, 3, 4}


def test_tree_reset_mid_run_rebuilds_among_survivors():
    job = Job(two_by_four(max_ranks=3, root_flag=R, group_flag=R), 8)
    for tree in job.ras.values():
        tree.reset()
    job.kill(2, threaded=True)  # rebuilt through the store by the 7 survivors
    assert job.active() == [0, 1, None, 2, 3, 4, 5, None]  # fresh activation
    assert {s.world_size for s in job.states.values()} == {7}


def test_tree_raising_filter_drops_the_half_updated_tree():
    calls = []

    def wsf(active: int) -> int:
        calls.append(active)
        if len(calls) > 1:
            raise ValueError("filter broke")
        return active

    store = dist.HashStore()
    tree = Tree([Layer()], world_size_filter=wsf)
    state = tree(RankAssignmentCtx(fresh(0, 1), store, set())).state
    assert tree.table() != []
    with pytest.raises(ValueError, match="filter broke"):
        tree(RankAssignmentCtx(state, store, set()))
    assert tree.table() == []  # never reused


def test_key_function_gets_a_frozen_state():
    def key(s):
        s.rank = 5  # a key function must not change the state
        return 0

    with pytest.raises(dataclasses.FrozenInstanceError):
        Tree([Layer(key_or_fn=key)])(RankAssignmentCtx(fresh(0, 1), dist.HashStore(), set()))


def test_tree_active_ranks_follow_tree_order(caplog):
    """Interleaved hosts (rank % 2): active ranks are contiguous per host, ranks keep order."""
    job = Job(lambda: Tree([Layer(), Layer(key_or_fn=lambda s: f"host{s.initial_rank % 2}")]), 4)
    assert job.active() == [0, 2, 1, 3]
    assert job.ranks() == {0: 0, 1: 1, 2: 2, 3: 3}
    assert "depth-first leaf order differs from rank order" in caplog.text


def test_tree_exchange_timeout():
    tree = Tree([Layer()], timeout=0.3)
    with pytest.raises(BarrierTimeout, match=r"ranks \[1\]"):
        tree(RankAssignmentCtx(fresh(0, 2), dist.HashStore(), set()))


def _random_layers(rng: random.Random, world: int):
    layers = [
        Layer(
            min_ranks=rng.choice([0, 1, 1, 2]),
            max_ranks=rng.choice([None, None, world - 1 or 1]),
            flag=rng.choice([None, R, B, R | B]),
        )
    ]
    for _ in range(rng.randint(0, 2)):
        groups = [rng.randint(0, 3) for _ in range(world)]
        if rng.random() < 0.5:
            groups.sort()  # contiguous groups (rank order == tree order)
        layers.append(
            Layer(
                min_ranks=rng.choice([0, 1, 2]),
                max_ranks=rng.choice([None, 1, 2, 3]),
                key_or_fn=lambda s, g=groups: g[s.initial_rank],
                flag=rng.choice([None, R, B, R | B]),
            )
        )
    return layers


def test_tree_128_random_trees_keep_invariants():
    rng = random.Random(1234)
    rounds = 0
    for _ in range(128):
        world = rng.randint(1, 24)
        layers = _random_layers(rng, world)
        wsf = rng.choice([None, lambda a: a, lambda a: a - a % 2])
        job = Job(lambda ls=layers, f=wsf: Tree(ls, world_size_filter=f), world)
        for _ in range(4):
            if len(job.states) <= 1:
                break
            job.kill(*rng.sample(sorted(job.states), rng.randint(1, min(3, len(job.states) - 1))))
            rounds += 1
    assert rounds > 128


def test_tree_16k_ranks_1k_killed_under_one_second():
    world = 16_384
    layers = [
        Layer(flag=R | B),
        Layer(max_ranks=7, key_or_fn=lambda s: s.initial_rank // 8, flag=R | B),
    ]
    store = dist.HashStore()
    for r in range(1, world):
        announce(store, fresh(r, world), layers, r, world)
    tree = Tree(layers)
    start = time.perf_counter()
    state = tree(RankAssignmentCtx(fresh(0, world), store, set())).state
    build_s = time.perf_counter() - start
    assert (state.active_rank, state.active_world_size) == (0, world // 8 * 7)
    killed = set(random.Random(5).sample(range(1, world), 1024))
    start = time.perf_counter()
    state = tree(RankAssignmentCtx(state, store, killed)).state
    reassign_s = time.perf_counter() - start
    print(
        f"Tree 16,384 ranks: build {build_s:.3f} s, reassign after 1,024 killed {reassign_s:.3f} s"
    )
    table = tree.table()
    actives = sorted(e.active_rank for e in table if e.active_rank is not None)
    assert actives == list(range(state.active_world_size))
    assert sum(e.mode is Mode.TERMINATED for e in table) == 1024
    assert state.world_size == world - 1024 and state.rank == 0
    assert reassign_s < 1.0
