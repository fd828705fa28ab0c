"""Replication strategies for local checkpoints: which peers hold copies of a rank's shard.

Follows: NVRx ``CliqueReplicationStrategy`` (groups b, b+J, b+2J, ... cut into cliques of F);
differences: shards travel as checksummed bytes over gloo (CPU) so recovery works without CUDA, and
the sender for a lost shard is the lowest-ranked holder (deterministic on every rank).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError

__all__ = ["CliqueReplicationStrategy", "exchange_files", "recv_bytes", "send_bytes"]


class CliqueReplicationStrategy:
    """Place ``replication_factor`` copies of every shard in a clique of ranks ``J`` apart.

    Args:
        replication_jump: stride J between clique members (use ranks per node so copies land on
            other nodes).
        replication_factor: clique size F (copies of each shard, the owner's included).

    Raises:
        ConfigError: J < 1 or F < 1.
    """

    def __init__(self, replication_jump: int = 1, replication_factor: int = 2) -> None:
        for name, v in (("replication_jump", replication_jump),
                        ("replication_factor", replication_factor)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        self.jump, self.factor = replication_jump, replication_factor

    def cliques(self, world_size: int) -> list[list[int]]:
        """All cliques for ``world_size`` ranks (each a sorted list of global ranks).

        Raises:
            ConfigError: world_size is not divisible by J * F.
        """
        if world_size % (self.jump * self.factor):
            raise ConfigError(
                f"world size {world_size} must be divisible by replication_jump x "
                f"replication_factor = {self.jump} x {self.factor}; change J or F")
        out = []
        for base in range(self.jump):
            seq = list(range(base, world_size, self.jump))
            out += [sorted(seq[i : i + self.factor]) for i in range(0, len(seq), self.factor)]
        return sorted(out)

    def clique_of(self, rank: int, world_size: int) -> list[int]:
        return next(c for c in self.cliques(world_size) if rank in c)


def exchange_files(header: bytes, path: str, group: Any, group_size: int
                   ) -> list[tuple[bytes, memoryview]]:
    """All-gather (header, file contents) within ``group``, one pair per member in group order.

    The file is read straight into the send buffer and received shards are returned as views of
    the receive buffers, so a shard is copied once from disk and once off the wire.
    """
    size = os.path.getsize(path)
    mine_sizes = torch.tensor([len(header), size], dtype=torch.int64)
    sizes = [torch.zeros(2, dtype=torch.int64) for _ in range(group_size)]
    dist.all_gather(sizes, mine_sizes, group=group)
    longest = max(int(s.sum().item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    view = memoryview(mine.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
    view[: len(header)] = header
    with open(path, "rb") as f:
        if f.readinto(view[len(header) : len(header) + size]) != size:
            raise OSError(f"{path} changed size while being replicated")
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(group_size)]
    dist.all_gather(bufs, mine, group=group)
    out = []
    for b, s in zip(bufs, sizes):
        h, n = int(s[0].item()), int(s[1].item())
        raw = memoryview(b.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
        out.append((bytes(raw[:h]), raw[h : h + n]))
    return out


def send_bytes(data: bytes, dst: int, group: Any) -> None:
    """Point-to-point send of a byte string to global rank ``dst``."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)


def recv_bytes(src: int, group: Any) -> bytes:
    """Receive a byte string sent by :func:`send_bytes` from global rank ``src``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src=src, group=group)
    return buf.numpy().tobytes()
