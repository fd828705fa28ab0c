"""Checkpoint directory layout, commit protocol, verification and retention over a :class:`Storage`.

Layout below the root (local path or fsspec URL)::

    step_000000100/            one directory per step (no width limit: more digits just sort later)
        rank_00000.pt          per-rank torch.save files (kind "torch"), or
        __0_0.distcp .metadata DCP files (kind "dcp")
        manifest.json          written LAST: the commit marker (sizes, xxh3 checksums, ranks, step)
    latest                     text: the newest committed step (advanced only after commit)

A step directory without a valid ``manifest.json`` is uncommitted: readers skip it and garbage
collection removes it. Every file is written under a temporary name, fsync'd and renamed.

Follows: torch DCP (``.metadata`` last) and NVRx (dirty -> clean rename); differences: checksums,
a manifest, directory fsync, retention of the last K committed checkpoints, and GC of leftovers.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import torch
import xxhash

from trainguard._core.logging import get_logger
from trainguard.checkpointing.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from trainguard.checkpointing.storage import TMP_MARK, Storage, storage_for

__all__ = ["FORMAT_VERSION", "MANIFEST", "CheckpointManager", "rank_file"]

_log = get_logger("trainguard.checkpointing")
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


def rank_file(rank: int) -> str:
    """File name of a rank's torch.save shard inside a step directory."""
    return f"rank_{rank:05d}.pt"


def file_checksum(storage: Storage, rel: str, chunk_bytes: int = 8 << 20) -> tuple[int, str]:
    """(size bytes, xxh3-64 hex) of a stored file."""
    h, size = xxhash.xxh3_64(), 0
    with storage.open_read(rel) as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class CheckpointManager:
    """Commit, list, verify, load and prune step checkpoints (local calls, no collectives).

    Args:
        root: local directory or fsspec URL.
        keep_last: committed checkpoints to keep (>= 1); older ones are deleted after a commit.

    Raises:
        ConfigError: ``keep_last`` < 1 or an unknown URL scheme.
    """

    def __init__(self, root: str | os.PathLike | Storage, keep_last: int = 2) -> None:
        from trainguard.errors import ConfigError

        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.storage = storage_for(root)
        self.keep_last = keep_last

    # -- layout ------------------------------------------------------------------------------
    @staticmethod
    def step_dir(step: int) -> str:
        return f"step_{step:09d}"

    def path_of(self, step: int) -> str:
        """Path/URL of a step directory (pass it to ``torch.distributed.checkpoint.load``)."""
        return self.storage.full_path(self.step_dir(step))

    def all_steps(self) -> list[int]:
        """Every step directory present, committed or not, ascending."""
        steps = [int(m.group(1)) for n in self.storage.listdir("") if (m := _STEP_RE.match(n))]
        return sorted(steps)

    def read_manifest(self, step: int) -> dict[str, Any]:
        """The parsed manifest of ``step``.

        Raises:
            CheckpointNotFoundError: the step has no manifest (uncommitted).
            CorruptCheckpointError: the manifest is unreadable or inconsistent.
        """
        rel = f"{self.step_dir(step)}/{MANIFEST}"
        try:
            raw = self.storage.read_bytes(rel)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"step {step} is not committed (no {rel})") from exc
        try:
            man = json.loads(raw)
            ok = man["format_version"] == FORMAT_VERSION and int(man["step"]) == step
            ok = ok and isinstance(man["files"], dict) and int(man["world_size"]) >= 1
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(
                f"manifest {self.storage.full_path(rel)} is unreadable ({exc}); the checkpoint is "
                "skipped; delete the directory if it keeps appearing") from exc
        if not ok:
            raise CorruptCheckpointError(
                f"manifest {self.storage.full_path(rel)} does not describe step {step} in format "
                f"version {FORMAT_VERSION}; the checkpoint is skipped")
        return man

    def committed_steps(self) -> list[int]:
        """Steps with a readable manifest, ascending (checksums not verified)."""
        out = []
        for step in self.all_steps():
            try:
                self.read_manifest(step)
                out.append(step)
            except (CheckpointNotFoundError, CorruptCheckpointError):
                continue
        return out

    def latest_step(self) -> int | None:
        """Newest committed step, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # -- commit ------------------------------------------------------------------------------
    def commit(self, step: int, kind: str, world_size: int, files: dict[str, dict[str, Any]],
               extra: dict[str, Any] | None = None, prune: bool = True) -> None:
        """Write the manifest (commit marker), advance ``latest`` and prune old checkpoints.

        ``files`` maps file name -> {"size", "xxh3", "rank"}; every file must already be durable.

        Raises:
            OSError: the manifest or ``latest`` could not be written (the step stays uncommitted
                if the manifest failed; a stale ``latest`` is harmless as readers scan manifests).
        """
        man = {"format_version": FORMAT_VERSION, "kind": kind, "step": step,
               "world_size": world_size, "created_unix": time.time(), "files": files,
               "extra": extra or {}}
        self.storage.write_bytes(f"{self.step_dir(step)}/{MANIFEST}",
                                 json.dumps(man, indent=1, sort_keys=True).encode())
        self.storage.write_bytes("latest", f"{step}\n".encode())
        if prune:
            self.prune()

    def prune(self, protect: int | None = None) -> list[int]:
        """Keep the newest ``keep_last`` committed steps; drop older ones and stale uncommitted
        steps older than the newest commit. Returns the removed steps.

        ``protect`` (the step just committed) is never removed, even when newer steps exist: a
        save reported committed is never deleted by its own commit.
        """
        committed = self.committed_steps()
        if not committed:
            return []
        keep = set(committed[-self.keep_last :])
        if protect is not None:
            keep.add(protect)
        removed = [s for s in self.all_steps() if s not in keep and s < committed[-1]]
        for step in removed:
            self.storage.remove(self.step_dir(step))
        return removed

    def cleanup_stale(self) -> list[str]:
        """At job start (no save in flight): remove uncommitted step dirs and temporaries."""
        removed = []
        committed = set(self.committed_steps())
        for step in self.all_steps():
            if step not in committed:
                self.storage.remove(self.step_dir(step))
                removed.append(self.step_dir(step))
                continue
            for name in self.storage.listdir(self.step_dir(step)):
                if TMP_MARK in name:
                    self.storage.remove(f"{self.step_dir(step)}/{name}")
                    removed.append(f"{self.step_dir(step)}/{name}")
        for name in self.storage.listdir(""):
            if name.startswith("latest" + TMP_MARK):
                self.storage.remove(name)
                removed.append(name)
        if removed:
            _log.info("removed stale checkpoint leftovers: %s", removed)
        return removed

    # -- verification and loading -----------------------------------------------------------
    def verify(self, step: int, names: list[str] | None = None) -> dict[str, Any]:
        """Check size and xxh3 of ``names`` (default: every file); returns the manifest.

        Raises:
            CheckpointNotFoundError: uncommitted step.
            CorruptCheckpointError: a file is missing, truncated or bit-flipped (named).
        """
        man = self.read_manifest(step)
        for name in names if names is not None else list(man["files"]):
            if name not in man["files"]:
                raise CorruptCheckpointError(f"step {step}: manifest lists no file {name!r}")
            rel, want = f"{self.step_dir(step)}/{name}", man["files"][name]
            try:
                size, digest = file_checksum(self.storage, rel)
            except FileNotFoundError as exc:
                raise CorruptCheckpointError(
                    f"{self.storage.full_path(rel)} is missing but listed in the manifest") from exc
            if size != want["size"] or digest != want["xxh3"]:
                raise CorruptCheckpointError(
                    f"{self.storage.full_path(rel)} is corrupt: {size} bytes xxh3 {digest}, "
                    f"manifest says {want['size']} bytes xxh3 {want['xxh3']} (truncated or "
                    "bit-flipped); an older checkpoint is used when loading the latest")
        return man

    def check_world_size(self, man: dict[str, Any], world_size: int) -> None:
        """Raises CheckpointMismatchError when the manifest's world size differs."""
        if int(man["world_size"]) != world_size:
            raise CheckpointMismatchError(
                f"checkpoint step {man['step']} was written by {man['world_size']} ranks, this job "
                f"has {world_size}; per-rank shards cannot be remapped. Relaunch with "
                f"{man['world_size']} ranks or save with format='dcp' (reshardable)")

    def load_file(self, step: int, name: str, map_location: Any = "cpu",
                  weights_only: bool = True) -> Any:
        """Verify and ``torch.load`` one file of a committed step.

        With ``weights_only`` (the default) NumPy arrays, scalars and RNG states load too (see
        :mod:`trainguard.checkpointing._loadable`).
        """
        from trainguard.checkpointing._loadable import load_context

        self.verify(step, [name])
        with self.storage.open_read(f"{self.step_dir(step)}/{name}") as f, load_context():
            return torch.load(f, map_location=map_location, weights_only=weights_only)

    def load(self, step: int | None = None, rank: int = 0, world_size: int | None = None,
             map_location: Any = "cpu", weights_only: bool = True) -> tuple[Any, int]:
        """Load ``rank``'s torch shard of ``step`` (default: newest valid); returns (obj, step).

        With ``step=None`` corrupt or uncommitted checkpoints are skipped with a warning.

        Raises:
            CheckpointNotFoundError: nothing committed (or the requested step is not).
            CorruptCheckpointError: the requested ``step`` fails verification.
            CheckpointMismatchError: written with another world size or not in torch format.
        """
        candidates = [step] if step is not None else list(reversed(self.committed_steps()))
        for s in candidates:
            try:
                man = self.read_manifest(s)
                if world_size is not None:
                    self.check_world_size(man, world_size)
                if man["kind"] != "torch":
                    raise CheckpointMismatchError(
                        f"step {s} is in {man['kind']!r} format; load it with "
                        f"torch.distributed.checkpoint.load(sd, checkpoint_id={self.path_of(s)!r})")
                return self.load_file(s, rank_file(rank), map_location, weights_only), s
            except CorruptCheckpointError as exc:
                if step is not None:
                    raise
                _log.warning("skipping checkpoint step %d: %s", s, exc)
        raise CheckpointNotFoundError(
            f"no committed checkpoint in {self.storage.url}" if step is None else
            f"step {step} not found in {self.storage.url}")
