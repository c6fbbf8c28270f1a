"""One rank of an N-rank world on torch's fake process group, for the benchmarks that measure
per-rank bytes and memory at world sizes this machine cannot spawn."""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZES = [2, 4, 8, 16, 32, 64]  # the default --ranks


@contextlib.contextmanager
def fake_process_group(ranks: int, rank: int = 0):
    """The default process group as rank `rank` of `ranks` (the fake backend: collectives
    return buffers of the right shapes and move no data)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
