"""``_core.pg_guard``: destroyed groups are held, freed one whole-world destroy later or by
``release``; installs nest; torch's function comes back with the last uninstall."""

from __future__ import annotations

import datetime
import gc
import weakref

import torch.distributed as dist

from trainguard._core import pg_guard


def _init() -> weakref.ref:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    return weakref.ref(dist.group.WORLD)


def test_destroyed_groups_are_freed_one_teardown_later_and_installs_nest():
    torch_destroy = dist.destroy_process_group
    pg_guard.install()
    pg_guard.install()  # e.g. the launcher's worker guard plus an inprocess.Wrapper
    try:
        assert dist.destroy_process_group is pg_guard.destroy_process_group
        first = _init()
        dist.destroy_process_group()
        gc.collect()
        assert first() is not None and pg_guard.held_count() == 1
        second = _init()
        dist.destroy_process_group()  # frees the first group, holds the second
        gc.collect()
        assert first() is None and second() is not None, pg_guard.held_count()
        pg_guard.uninstall()  # one of two: still installed; frees what it held
        gc.collect()
        assert second() is None and pg_guard.held_count() == 0
        assert dist.destroy_process_group is pg_guard.destroy_process_group
    finally:
        pg_guard.uninstall()
        pg_guard.release()
    assert dist.destroy_process_group is torch_destroy
    assert dist.distributed_c10d.destroy_process_group is torch_destroy
