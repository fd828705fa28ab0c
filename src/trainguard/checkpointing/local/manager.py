"""LocalCheckpointManager: per-rank checkpoints on node-local storage, replicated to peers.

Layout: ``{root}/{session_id}/{rank}/iter_{iteration:07d}_{owner}_local.pt`` plus a JSON sidecar
(size, xxh3, world size) written after the shard is durable; a shard without its sidecar does not
exist. With replication a rank's directory also holds its clique peers' shards.

Collectives (every rank calls them together): the constructor, ``find_latest``, ``save``
(``is_async=False``), ``maybe_finalize`` and ``load``.

Follows: NVRx ``LocalCheckpointManager``; differences: fsync + checksums, CPU tensors, async
replication in a background thread (off the training thread), no 7-digit iteration limit,
recovery of a lost shard over gloo (no CUDA needed).
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from trainguard._core.clock import as_seconds
from trainguard._core.logging import get_logger
from trainguard.checkpointing.async_ckpt import AsyncCheckpointer, SaveRequest
from trainguard.checkpointing.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NoReplicasAvailableError,
)
from trainguard.checkpointing.local.replication import (
    CliqueReplicationStrategy,
    exchange_files,
    recv_bytes,
    send_bytes,
)
from trainguard.checkpointing.local.tensor_aware import (
    BasicTensorAwareStateDict,
    TensorAwareStateDict,
)
from trainguard.checkpointing.storage import TMP_MARK, LocalStorage
from trainguard.errors import ConfigError

__all__ = ["LocalCheckpointManager"]

_log = get_logger("trainguard.checkpointing.local")
_FILE_RE = re.compile(r"^iter_(\d+)_(\d+)_local\.pt$")
CkptID = tuple[int, int]  # (iteration, owner rank)


@dataclass
class _Pending:
    """The one unfinalized local save: writing -> replicating -> done."""

    iteration: int
    req: SaveRequest
    phase: str = "writing"
    thread: threading.Thread | None = None
    repl_error: str | None = None


def _name(iteration: int, owner: int) -> str:
    return f"iter_{iteration:07d}_{owner}_local.pt"


class LocalCheckpointManager:
    """Save/load per-rank local checkpoints with optional clique replication.

    Args:
        root_dir: node-local directory (SSD or /dev/shm).
        session_id: subdirectory separating jobs.
        repl_strategy: None (no replication) or a :class:`CliqueReplicationStrategy`.
        keep_last: newest iterations kept after a successful save (>= 1).
        write_timeout / collective_timeout: seconds or timedelta.

    Raises:
        ConfigError: bad arguments, or a world size incompatible with the strategy.
    """

    def __init__(self, root_dir: str | os.PathLike, session_id: str = "",
                 repl_strategy: CliqueReplicationStrategy | None = None, *, keep_last: int = 1,
                 write_timeout: float | timedelta = 600.0,
                 collective_timeout: float | timedelta = 600.0) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.use_dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.use_dist else 0
        self.world_size = dist.get_world_size() if self.use_dist else 1
        self.keep_last, self.strategy = keep_last, repl_strategy
        self.storage = LocalStorage(os.path.join(os.fspath(root_dir), session_id, str(self.rank)))
        self.storage.makedirs("")
        for n in self.storage.listdir(""):
            if TMP_MARK in n:  # dirty leftovers of a crashed save
                self.storage.remove(n)
        timeout = timedelta(seconds=as_seconds(collective_timeout, "collective_timeout"))
        self._group = dist.new_group(backend="gloo", timeout=timeout) if self.use_dist else None
        self._clique: list[int] = [self.rank]
        self._clique_group: Any = None
        if repl_strategy is not None and self.use_dist:
            for clique in repl_strategy.cliques(self.world_size):  # new_group is collective
                g = dist.new_group(clique, backend="gloo", timeout=timeout)
                if self.rank in clique:
                    self._clique, self._clique_group = clique, g
        self._writer = AsyncCheckpointer(None, use_dist=False, write_timeout=write_timeout)
        self._pending: _Pending | None = None
        self._collective_timeout_s = timeout.total_seconds()
        self._latest: int | None = None
        self._last_saved: int | None = None
        self._holdings: list[list[CkptID]] = []

    # -- listing -----------------------------------------------------------------------------
    def _sidecar(self, name: str) -> dict[str, Any] | None:
        try:
            meta = json.loads(self.storage.read_bytes(name[:-3] + ".json"))
            if self.storage.size(name) != meta["size"]:
                return None
            return meta
        except (OSError, ValueError, KeyError):
            return None

    def _my_ids(self) -> list[CkptID]:
        out = []
        for n in self.storage.listdir(""):
            m = _FILE_RE.match(n)
            if not m:
                continue
            meta = self._sidecar(n)
            if meta is None:
                continue
            if meta.get("world_size") != self.world_size:
                _log.warning("ignoring %s: written by %s ranks, this job has %d", n,
                             meta.get("world_size"), self.world_size)
                continue
            out.append((int(m.group(1)), int(m.group(2))))
        return sorted(out)

    def _gather(self, obj: Any) -> list[Any]:
        if not self.use_dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def find_latest(self) -> int:
        """Collective: newest iteration whose shards (own or replicas) cover every rank, or -1."""
        if self._latest is not None:
            return self._latest
        self._holdings = [[tuple(i) for i in ids] for ids in self._gather(self._my_ids())]
        owners: dict[int, set[int]] = {}
        for ids in self._holdings:
            for it, owner in ids:
                owners.setdefault(it, set()).add(owner)
        full = [it for it, own in owners.items() if own == set(range(self.world_size))]
        self._latest = max(full) if full else -1
        return self._latest

    # -- save --------------------------------------------------------------------------------
    def save(self, state_dict: TensorAwareStateDict | Any, iteration: int,
             is_async: bool = False) -> SaveRequest | None:
        """Save this rank's state as ``iteration``; collective when ``is_async`` is False.

        Blocks for staging (a memcpy); with ``is_async`` the write (writer process) and the
        replication (background thread) proceed while training runs; call :meth:`maybe_finalize`
        every step (or ``blocking=True``) to complete them. A previous unfinalized save is
        finalized first.

        Raises:
            ConfigError: iteration not newer than the latest found.
            CheckpointWriteError: (sync, or from finalize) the save failed on some rank.
        """
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ConfigError(f"iteration must be an int >= 0, got {iteration!r}")
        newest = max(x for x in (self._latest, self._last_saved, -1) if x is not None)
        if iteration <= newest:
            raise ConfigError(f"iteration {iteration} is not newer than the latest local "
                              f"checkpoint {newest}")
        if self._pending is not None:
            self.maybe_finalize(blocking=True)
        tasd = state_dict if isinstance(state_dict, TensorAwareStateDict) else \
            BasicTensorAwareStateDict(state_dict)
        devices = [str(t.device) for t in tasd.tensors]
        payload = {"state": tasd.to_state_dict(), "devices": devices}
        req = self._writer.async_save(payload, self.storage.full_path(_name(iteration, self.rank)))
        self._pending, self._latest = _Pending(iteration, req), None
        if not is_async:
            self.maybe_finalize(blocking=True)
            return None
        return req

    def _agree(self, error: str | None, what: str, iteration: int) -> None:
        errors = {r: e for r, e in enumerate(self._gather(error)) if e is not None}
        if errors:
            for n in (_name(iteration, self.rank), _name(iteration, self.rank)[:-3] + ".json"):
                self.storage.remove(n)
            raise CheckpointWriteError(
                f"local checkpoint iteration {iteration} failed ({what}) on rank(s) "
                f"{sorted(errors)}: " + "; ".join(f"rank {r}: {e}" for r, e in errors.items()),
                errors)

    def maybe_finalize(self, blocking: bool = False) -> int | None:
        """Advance the pending save; returns its iteration once complete on every rank, else None.

        Phases: write (writer process) -> sidecar -> replication (a background thread on the
        clique group, off the training thread) -> cleanup of older iterations. Non-blocking
        calls cost one all-reduce each and never wait.

        Raises:
            CheckpointWriteError: the write or the replication failed on some rank (all raise).
        """
        p = self._pending
        if p is None:
            return None
        if p.phase == "writing":
            if not self._everyone(lambda: self._writer.is_written(p.req), blocking):
                return None
            self._pending = None
            self._agree(self._finish_write(p), "write", p.iteration)
            if self._clique_group is None:
                return self._complete(p)
            self._pending, p.phase = p, "replicating"
            p.thread = threading.Thread(target=self._replicate_into, args=(p,), daemon=True,
                                        name=f"tg-ckpt-replicate-{self.rank}")
            p.thread.start()
        if blocking:
            p.thread.join(self._collective_timeout_s)  # type: ignore[union-attr]
        if not self._everyone(lambda: not p.thread.is_alive(), blocking):  # type: ignore[union-attr]
            return None
        self._pending = None
        if p.thread.is_alive():  # type: ignore[union-attr]
            p.repl_error = f"replication still running after {self._collective_timeout_s:.0f} s"
        self._agree(p.repl_error, "replication", p.iteration)
        return self._complete(p)

    def _everyone(self, local_done, blocking: bool) -> bool:
        """Blocking: True. Otherwise whether ``local_done()`` holds on every rank (all-reduce)."""
        if blocking:
            return True
        done = bool(local_done())
        if not self.use_dist:
            return done
        flag = torch.tensor([int(done)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _finish_write(self, p: _Pending) -> str | None:
        try:
            self._writer.wait()
            info = p.req.record["files"][_name(p.iteration, self.rank)]
            meta = {"iteration": p.iteration, "owner": self.rank, "world_size": self.world_size,
                    "size": info["size"], "xxh3": info["xxh3"]}
            self.storage.write_bytes(_name(p.iteration, self.rank)[:-3] + ".json",
                                     json.dumps(meta).encode())
        except (CheckpointWriteError, OSError) as exc:
            return str(exc)
        return None

    def _replicate_into(self, p: _Pending) -> None:
        try:
            p.repl_error = self._replicate(p.iteration)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by maybe_finalize
            p.repl_error = f"{type(exc).__name__}: {exc}"

    def _complete(self, p: _Pending) -> int:
        self._cleanup(p.iteration)
        self._last_saved, self._latest = p.iteration, None  # find_latest re-lists holdings
        return p.iteration

    def _replicate(self, iteration: int) -> str | None:
        name = _name(iteration, self.rank)
        meta = self.storage.read_bytes(name[:-3] + ".json")
        pairs = exchange_files(meta, self.storage.full_path(name), self._clique_group,
                               len(self._clique))
        try:
            for owner, (raw_meta, shard) in zip(self._clique, pairs):
                if owner == self.rank:
                    continue
                if xxhash.xxh3_64_hexdigest(shard) != json.loads(raw_meta)["xxh3"]:
                    return f"replica of rank {owner} arrived corrupted"
                self.storage.write_bytes(_name(iteration, owner), shard)
                self.storage.write_bytes(_name(iteration, owner)[:-3] + ".json", raw_meta)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _cleanup(self, iteration: int) -> None:
        ids = self._my_ids()
        keep = sorted({it for it, _ in ids if it <= iteration})[-self.keep_last :]
        for it, owner in ids:
            if it not in keep:
                self.storage.remove(_name(it, owner))
                self.storage.remove(_name(it, owner)[:-3] + ".json")

    # -- load --------------------------------------------------------------------------------
    def _read_verified(self, iteration: int, owner: int) -> bytes:
        name = _name(iteration, owner)
        meta = self._sidecar(name)
        data = self.storage.read_bytes(name)
        if meta is None or xxhash.xxh3_64_hexdigest(data) != meta["xxh3"]:
            raise CorruptCheckpointError(
                f"local checkpoint {self.storage.full_path(name)} is corrupt (checksum or size "
                "mismatch); delete it so a replica is used, or fall back to a global checkpoint")
        return data

    def load(self, weights_only: bool = True) -> tuple[BasicTensorAwareStateDict, int]:
        """Collective: this rank's state of :meth:`find_latest`, fetched from a peer if lost.

        Raises:
            CheckpointNotFoundError: no iteration covers every rank.
            NoReplicasAvailableError: (defensive) a shard has no holder.
            CorruptCheckpointError: the shard (or replica) fails its checksum.
        """
        it = self.find_latest()
        if it < 0:
            raise CheckpointNotFoundError(
                f"no local checkpoint covers all {self.world_size} ranks under "
                f"{os.path.dirname(self.storage.root)}")
        data = self._fetch(it)
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
        tasd = BasicTensorAwareStateDict(obj["state"], obj["devices"])
        tasd.restore_tensor_device()
        return tasd, it

    def _fetch(self, it: int) -> bytes:
        mine: bytes | None = None
        for owner in range(self.world_size):
            holders = [r for r, ids in enumerate(self._holdings) if (it, owner) in ids]
            if not holders:
                raise NoReplicasAvailableError(f"no rank holds iteration {it} of rank {owner}")
            sender = owner if owner in holders else min(holders)
            if sender == owner:
                if owner == self.rank:
                    mine = self._read_verified(it, owner)
                continue
            if self.rank == sender:
                send_bytes(self._read_verified(it, owner), owner, self._group)
            elif self.rank == owner:
                mine = recv_bytes(sender, self._group)
                _log.info("recovered iteration %d shard from replica on rank %d", it, sender)
        return mine  # type: ignore[return-value]

    def close(self) -> None:
        """Finalize a pending save and stop the writer process."""
        try:
            if self._pending is not None:
                self.maybe_finalize(blocking=True)
        finally:
            self._writer.close(finalize=False)
