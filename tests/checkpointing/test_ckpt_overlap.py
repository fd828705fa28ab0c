"""Overlapped snapshots: exact under an optimizer that mutates everything, 200 saves, SIGKILL."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _ckpt_dist import run_ranks

from trainguard.checkpointing import (
    AsyncCheckpointer,
    CheckpointManager,
    CheckpointWriteError,
    SaveState,
)
from trainguard.checkpointing.manager import rank_file
from trainguard.errors import ConfigError


class MutateAll(torch.optim.Optimizer):
    """Changes every parameter and every state tensor in place on each step (to ``value``)."""

    def __init__(self, params, numel: int) -> None:
        super().__init__(params, {"lr": 1.0})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"buf": torch.zeros_like(p), "step": torch.tensor(0.0)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"].add_(1.0)
                p.fill_(st["step"].item())
                st["buf"].fill_(st["step"].item())


def _setup(numel: int, n: int, device: str = "cpu") -> tuple[torch.nn.Module, MutateAll]:
    model = torch.nn.Module()
    for i in range(n):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(numel, device=device)))
    model.register_buffer("running", torch.zeros(4, device=device))  # small: staged at save
    return model, MutateAll(model.parameters(), numel)


def _flat(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.clone()}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_overlap_is_an_exact_snapshot_when_the_optimizer_steps_at_once(tmp_path, fmt):
    model, opt = _setup(1 << 20, 4)  # 4 params + 4 buffers of 4 MiB: staged in the background
    opt.step()
    slow = {2: {"phase": "stage", "action": "slow", "seconds": 0.5}}  # copy outlasts the step
    with AsyncCheckpointer(tmp_path, format=fmt, use_dist=False, faults=slow) as ck:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = _flat(state)
        t0 = time.perf_counter()
        ck.save(state, 2, overlap=True)
        block_s = time.perf_counter() - t0
        model.running.add_(7.0)  # outside the optimizer, but small: already staged
        opt.step()  # mutates every tensor: must wait for the copy
        assert ck.fenced_steps == 1
        assert model.p0[0].item() == 2.0 and opt.state[model.p0]["buf"][0].item() == 2.0
        assert ck.wait() == [2]
        if fmt == "torch":
            saved = _flat(ck.manager.load_file(2, rank_file(0)))
        else:

            target = {"model": model.state_dict(), "optim": opt.state_dict()}
            for t in _flat_refs(target):
                t.zero_()
            ck.load_dcp(target)
            saved = _flat(target)
    print(f"overlapped save blocked {block_s * 1e3:.1f} ms (copy took >= 500 ms)")
    assert block_s < 0.4
    assert saved.keys() == expected.keys()
    torn = [k for k in expected if not torch.equal(saved[k], expected[k])]
    assert not torn, torn


def _flat_refs(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flat_refs(v)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("if_busy", ["skip", "wait"])
def test_save_every_step_for_200_steps_never_tears(tmp_path, if_busy):
    model, opt = _setup(20_000, 2)  # 80 kB tensors: above the synchronous-copy threshold
    checked: list[int] = []
    with AsyncCheckpointer(tmp_path, keep_last=2, use_dist=False) as ck:

        def check(step: int) -> None:  # runs right after the commit of ``step``
            obj = ck.manager.load_file(step, rank_file(0))
            values = {t.flatten()[0].item() for t in _flat(obj).values() if t.numel() > 4}
            values |= {t.min().item() for t in _flat(obj).values()} - {0.0}
            assert values == {float(step)}, (step, values)
            checked.append(step)

        for step in range(1, 201):
            opt.step()  # every tensor becomes ``step``
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            req = ck.save(state, step, finalize_fns=[lambda s=step: check(s)], overlap=True,
                          if_busy=if_busy)
            assert req.state is not SaveState.SKIPPED or if_busy == "skip"
            ck.maybe_finalize()
        ck.wait()
        fenced, skipped = ck.fenced_steps, ck.saves_skipped
    print(f"optimizer steps that waited for staging: {fenced} of 199; skipped saves {skipped}")
    if if_busy == "wait":
        assert checked == list(range(1, 201)) and skipped == 0
    else:  # every save either committed exactly (checked) or was skipped, none lost or torn
        assert checked == sorted(checked) and len(checked) + skipped == 200 and checked
    assert CheckpointManager(tmp_path).committed_steps() == checked[-2:]


def _busy_state(model: torch.nn.Module, opt: MutateAll) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.timeout(120)
def test_a_save_while_the_previous_is_writing_is_skipped_without_waiting(tmp_path):
    model, opt = _setup(1 << 16, 2)
    slow = {1: {"phase": "recv", "action": "slow", "seconds": 2.0}}  # the writer falls behind
    with AsyncCheckpointer(tmp_path, use_dist=False, max_in_flight=1, faults=slow) as ck:
        ck.warmup()
        opt.step()
        assert ck.save(_busy_state(model, opt), 1, overlap=True).state is SaveState.WRITING
        opt.step()
        t0 = time.perf_counter()
        req = ck.save(_busy_state(model, opt), 2, overlap=True)  # default: skip if busy
        skip_s = time.perf_counter() - t0
        assert req.state is SaveState.SKIPPED and ck.saves_skipped == 1
        opt.step()
        t0 = time.perf_counter()
        ck.save(_busy_state(model, opt), 3, overlap=True, if_busy="wait")
        wait_s = time.perf_counter() - t0
        opt.step()  # fenced until step 3's copy is done
        assert ck.wait() == [1, 3]
        saved = ck.manager.load_file(3, rank_file(0))
    print(f"skipped save blocked {skip_s * 1e3:.1f} ms; if_busy='wait' blocked {wait_s:.2f} s "
          "behind a 2 s write")
    assert skip_s < 1.0 < wait_s
    assert CheckpointManager(tmp_path).committed_steps() == [1, 3]
    assert all(torch.equal(v, torch.full_like(v, 3.0)) for k, v in saved["model"].items()
               if k != "running")
    with pytest.raises(ConfigError, match="if_busy"):
        ck.save({}, 9, if_busy="later")


def _skip_agreed(rank: int, world_size: int, root: str) -> tuple:
    model, opt = _setup(1 << 16, 2)
    slow = {1: {"phase": "recv", "action": "slow", "seconds": 2.0}} if rank == 1 else {}
    ck = AsyncCheckpointer(root, max_in_flight=1, faults=slow, collective_timeout=30)
    try:
        ck.warmup()
        states = [ck.save(_busy_state(model, opt), step, overlap=True).state.value
                  for step in (1, 2)]
        return states, ck.wait(), ck.saves_skipped
    finally:
        ck.close()


@pytest.mark.timeout(120)
def test_ranks_agree_to_skip_when_one_rank_is_busy(tmp_path):
    results = run_ranks(_skip_agreed, 2, str(tmp_path), timeout_s=90)
    # only rank 1's writer is behind, yet both ranks skip step 2 (else the commit would hang)
    assert [r[1] for r in results] == [(["writing", "skipped"], [1], 1)] * 2, results
    assert CheckpointManager(tmp_path).committed_steps() == [1]


@pytest.mark.timeout(120)
def test_first_overlapped_save_without_warmup_does_not_block_on_page_faults(tmp_path):
    state = {f"w{i}": torch.ones(8 << 20) for i in range(8)}  # 256 MiB, fresh staging memory
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    with AsyncCheckpointer(tmp_path, use_dist=False) as ck:
        t0 = time.perf_counter()
        ck.save(state, 1, overlap=True)  # the arena is new: its first touch is the copy
        first_s = time.perf_counter() - t0
        ck.wait_staged()
        t0 = time.perf_counter()
        for k, v in state.items():  # same work, in this thread, into fresh pages
            dst[k].copy_(v)
        touch_s = time.perf_counter() - t0
        ck.close(finalize=False)  # the write itself is not under test
    print(f"first overlapped save blocked {first_s * 1e3:.1f} ms; copying the state into fresh "
          f"memory here took {touch_s * 1e3:.1f} ms")
    assert first_s < 0.05


@pytest.mark.timeout(60)
def test_staging_error_fails_the_save_and_the_next_save_works(tmp_path):
    model, opt = _setup(1 << 16, 2)
    bad = {1: {"phase": "stage", "action": "errno", "errno": 5}}
    with AsyncCheckpointer(tmp_path, use_dist=False, faults=bad) as ck:
        ck.save({"model": model.state_dict()}, 1, overlap=True)
        opt.step()
        with pytest.raises(CheckpointWriteError, match="staging failed: OSError"):
            ck.wait()
        ck.save({"model": model.state_dict()}, 2, overlap=True)
        assert ck.wait() == [2]


def _killed_while_staging(rank: int, world_size: int, root: str) -> str:
    model, opt = _setup(1 << 20, 4)
    opt.step()
    kill = {2: {"phase": "stage", "action": "sigkill"}}
    ck = AsyncCheckpointer(root, faults=kill, collective_timeout=30)
    ck.save({"model": model.state_dict()}, 1)
    assert ck.wait() == [1]
    opt.step()
    ck.save({"model": model.state_dict()}, 2, overlap=True)  # killed mid-copy in the background
    time.sleep(30)
    return "survived"


@pytest.mark.timeout(120)
def test_sigkill_during_overlapped_staging_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    [(status, code)] = run_ranks(_killed_while_staging, 1, root, timeout_s=60, expect_ok=False)
    assert status == "died", (status, code)
    assert CheckpointManager(root).committed_steps() == [1]
    with AsyncCheckpointer(root, use_dist=False) as ck:
        obj, step = ck.load()
        assert os.listdir(root).count(ck.manager.step_dir(2)) == 0  # leftovers removed at start
    assert step == 1 and all(torch.equal(v, torch.ones(1 << 20)) for v in obj["model"].values()
                             if v.numel() > 4)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_pinned_buffers_reused_and_fenced(tmp_path):
    model, opt = _setup(1 << 22, 2, device="cuda")  # 16 MiB per tensor on the GPU
    with AsyncCheckpointer(tmp_path, use_dist=False) as ck:
        arenas = []
        for step, overlap in ((1, False), (2, True), (3, True)):
            with torch.no_grad():
                for p in model.parameters():  # queued on the current stream, not yet run
                    p.fill_(float(step * 10))
            ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, step,
                    overlap=overlap)
            opt.step()  # overwrites everything on the GPU right away
            assert ck.wait() == [step]
            saved = ck.manager.load_file(step, rank_file(0))
            assert all(torch.equal(v, torch.full_like(v, step * 10.0)) for k, v in
                       saved["model"].items() if k != "running")
            arenas.append({id(a) for a in ck.pool.free})
            assert all(a.pinned for a in ck.pool.free)
        assert arenas[1] & arenas[2]  # the pinned staging buffers are reused across saves


def test_chunked_background_copy_is_byte_exact():
    from trainguard.checkpointing import _staging

    tensors = [("t", torch.randn(1000, 37).t()),  # non-contiguous: copy_ fallback
               ("big", torch.arange(3_000_001, dtype=torch.int64)),  # 24 MB: many 1 MiB chunks
               ("bf16", torch.randn(5).to(torch.bfloat16)), ("empty", torch.empty(0))]
    slots, total = _staging.plan_slots(tensors)
    arena = _staging.Arena(total, prefault=False)
    try:
        _staging.stage(tensors, slots, arena, chunk_bytes=1 << 20)
        for (name, t), slot in zip(tensors, slots):
            assert torch.equal(arena.view(slot), t), name
    finally:
        arena.close()
