"""Distributed Muon's exchange (parallel/muon_exchange.py) per rank as the data-parallel world
grows: the bytes each rank hands to collectives and the memory the exchange adds on top of the
updates, for the Muon matrices of one k3_full pipeline stage (6 decoder layers, FSDP2 over N
ranks, fp32 updates), on torch's fake process group and fake tensors, every rank of every N
measured (the worst rank is printed).

    PYTHONPATH=. python -m benchmarks.muon_exchange [--ranks 2 4 8 16 32 64]

O(P/N) per rank means both ratio columns stay flat as N grows (P: the stage's Muon elements).
"""

from __future__ import annotations

import argparse
import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from benchmarks.fake_world import WORLD_SIZES, fake_process_group
from parallel.muon_exchange import DTensorExchange, MatrixJob
from train.optim.muon import orthogonalize
from train.step_probes import CollectiveBytes, StepMemory

LAYERS = 6
# One k3_full KDA layer's Muon matrices: (shape, heads, head axis). Stacked experts (whole
# matrices on each rank) need no exchange and are left out.
LAYER = [((12288, 7168), 96, 0)] * 4 + [((7168, 12288), 96, 1), ((12288, 128), 1, 0),
                                        ((128, 7168), 1, 0), ((3584, 7168), 1, 0),
                                        ((7168, 3584), 1, 0), ((12288, 7168), 1, 0),
                                        ((7168, 6144), 1, 0)]


def measure(ranks: int, rank: int) -> tuple[int, int]:
    """(bytes handed to collectives, peak bytes above the updates) of one rank's step."""
    with fake_process_group(ranks, rank):
        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp",))
        with FakeTensorMode():
            jobs = []
            for shape, heads, axis in LAYER * LAYERS:
                param = distribute_tensor(torch.empty(shape), mesh, [Shard(0)],
                                          src_data_rank=None)
                update = distribute_tensor(torch.empty(shape), mesh, [Shard(0)],
                                           src_data_rank=None)
                jobs.append(MatrixJob(update, param, heads, axis))
            memory, counter = StepMemory(), CollectiveBytes()
            memory.track([[j.update for j in jobs], [j.param for j in jobs]])
            base = memory.current
            with memory, counter:
                out = DTensorExchange().orthogonalize(jobs, orthogonalize)
            del out
        return sum(counter.bytes.values()), memory.peak - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=WORLD_SIZES)
    args = parser.parse_args()
    elements = LAYERS * sum(math.prod(shape) for shape, _, _ in LAYER)
    print(f"{LAYERS} k3_full layers' Muon matrices: {elements / 1e9:.2f}B elements "
          f"({elements * 4 / 2**30:.1f} GiB fp32)")
    print(f"{'N':>4} {'P/N MiB':>9} {'bytes/rank MiB':>15} {'/ (P/N)':>8} "
          f"{'peak/rank MiB':>14} {'/ (P/N)':>8}")
    for ranks in args.ranks:
        share = elements * 4 / ranks
        runs = [measure(ranks, rank) for rank in range(ranks)]
        sent = max(b for b, _ in runs)
        peak = max(p for _, p in runs)
        print(f"{ranks:>4} {share / 2**20:>9.1f} {sent / 2**20:>15.1f} {sent / share:>8.2f} "
              f"{peak / 2**20:>14.1f} {peak / share:>8.2f}")


if __name__ == "__main__":
    main()
