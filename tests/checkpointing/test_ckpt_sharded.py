"""Sharded state (FSDP2 / DTensor) in the dcp format: async save, reshard 2 -> 4 -> 2, DCP
interop."""

from __future__ import annotations

import os

import pytest
import torch
from _ckpt_dist import run_ranks

from trainguard.checkpointing import AsyncCheckpointer, CheckpointManager, StateDictError


def _model(seed: int, world_size: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _reference(seed: int, shift: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return {k: v.detach() + shift for k, v in plain.state_dict().items()}


def _state(model: torch.nn.Module, world_size: int, fill: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    rep = distribute_tensor(torch.full((3, 4), fill), mesh, [Replicate()])
    return {"model": model.state_dict(), "rep": rep, "meta": {"epoch": int(fill)}}


def _sharded_tensor(rank: int, world_size: int) -> torch.Tensor:
    import warnings

    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor is deprecated in favour of DTensor
        st = empty(spec, 8, 4)
    st.local_shards()[0].tensor.copy_(torch.arange(32.0).reshape(8, 4).chunk(world_size)[rank])
    return st


def _full(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in state["model"].items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_on_2(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model = _model(0, world_size)
    state = _state(model, world_size, 5.0)
    state["st"] = _sharded_tensor(rank, world_size)
    out: dict = {}
    dcp.save(state, checkpoint_id=os.path.join(root, "native"))  # torch's own writer
    with AsyncCheckpointer(os.path.join(root, "ours"), format="dcp", collective_timeout=60) as ck:
        ck.save(state, 1)
        with torch.no_grad():  # after save returned: must not reach the checkpoint
            for p in model.parameters():
                p.add_(100.0)
        assert ck.wait() == [1]
        ck.save(state, 2)  # same plan: no second gather of the plans
        assert ck.wait() == [2]
        out["gathers"] = ck._dcp_planner.gathers
        with pytest.raises(StateDictError, match="format='dcp'"):
            AsyncCheckpointer(os.path.join(root, "torchfmt"), collective_timeout=60).save(state, 1)
    return out


def _load_on_4(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    ref = _reference(0, 0.0)
    out: dict = {}
    with AsyncCheckpointer(os.path.join(root, "ours"), format="dcp", collective_timeout=60) as ck:
        model = _model(1, world_size)
        state = _state(model, world_size, 0.0)
        state["st"] = torch.zeros(8, 4)  # ShardedTensor over 2 ranks -> full tensor on each
        out["step"] = ck.load_dcp(state, step=1)  # ours -> our loader, resharded 2 -> 4
        out["st"] = torch.equal(state["st"], torch.arange(32.0).reshape(8, 4))
        out["ours"] = _same(_full(state), ref)
        out["rep"], out["meta"] = state["rep"].full_tensor()[0, 0].item(), state["meta"]["epoch"]
        other = _state(_model(2, world_size), world_size, 0.0)
        dcp.load(other, checkpoint_id=ck.manager.path_of(1))  # ours -> torch's loader
        out["ours_by_torch"] = _same(_full(other), ref)
        native = _state(_model(3, world_size), world_size, 0.0)
        ck.load_dcp(native, checkpoint_id=os.path.join(root, "native"))  # torch's -> ours
        out["native_by_ours"] = _same(_full(native), ref) and native["meta"]["epoch"] == 5
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ck.save(state, 3)  # 4 ranks write step 3 for the 4 -> 2 load
        assert ck.wait() == [3]
    return out


def _load_on_2(rank: int, world_size: int, root: str) -> bool:
    with AsyncCheckpointer(os.path.join(root, "ours"), format="dcp", collective_timeout=60) as ck:
        state = _state(_model(4, world_size), world_size, 0.0)
        assert ck.load_dcp(state) == 3
        return _same(_full(state), _reference(0, 1.0))


@pytest.mark.timeout(300)
def test_fsdp2_save_reshard_2_to_4_to_2_and_dcp_interop(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    root = str(tmp_path)
    saved = run_ranks(_save_on_2, 2, root, timeout_s=120)
    assert all(out["gathers"] == 1 for _, out in saved), saved  # plan cached on the second save
    md = FileSystemReader(CheckpointManager(os.path.join(root, "ours")).path_of(1)).read_metadata()
    where = {}
    for idx, info in md.storage_data.items():
        where.setdefault(idx.fqn, set()).add(info.relative_path)
    assert where["model.0.weight"] == {"__0_0.distcp", "__1_0.distcp"}  # each rank its shard
    assert sum(i.fqn == "rep" for i in md.storage_data) == 1  # replicated: written once
    loaded = run_ranks(_load_on_4, 4, root, timeout_s=150)
    for rank, (_, out) in enumerate(loaded):
        assert out == {"step": 1, "ours": True, "st": True, "rep": 5.0, "meta": 5,
                       "ours_by_torch": True, "native_by_ours": True}, (rank, out)
    back = run_ranks(_load_on_2, 2, root, timeout_s=120)
    assert [v for _, v in back] == [True, True]
