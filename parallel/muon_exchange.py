"""Distributed Per-Head Muon: the MatrixExchange for DTensor parameters (FSDP2, HSDP, TP).

Newton-Schulz needs whole matrices. For every parameter of a step:
1. gather: the update is all-gathered along the mesh dimensions that cut matrices (FSDP's
   shard dimension, a column- or row-parallel dimension). A head-parallel dimension of a
   per-head group is kept: its shards are whole heads, orthogonalised where they are.
2. orthogonalise once: one owner among the ranks that now hold the same block does it; owners
   are assigned greedily by block size, largest first, so the work is balanced.
3. redistribute: the owner's result (zeros elsewhere) is a partial sum over those ranks;
   redistributing it to the parameter's layout is a reduce-scatter that hands every rank its
   part. Adding zeros is exact, so the update equals the single-process one bit for bit up to
   the order of fp32 operations inside the collectives (none: one non-zero term).
Replicated dimensions (DDP replicas, HSDP's replicate dimension, ZeRO-1) compute redundantly:
they already hold whole matrices and the ranks there do the same work.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from train.optim.muon import MatrixJob, Orthogonalize


class DTensorExchange:
    """`head_dims`: mesh dimension names whose shards are whole heads (the tensor-parallel
    dimension, where Q/K/V and MLA's q_b/kv_b are sharded by head)."""

    def __init__(self, head_dims: tuple[str, ...] = ("tp",)):
        self.head_dims = head_dims

    def _layout(self, job: MatrixJob):
        """(placements to gather to, mesh dims gathered over) for a DTensor job."""
        p = job.param
        names = p.device_mesh.mesh_dim_names or ()
        head_dim = job.head_axis - 2 + p.ndim
        gather, cut = [], []
        for i, pl in enumerate(p.placements):
            keep = (type(pl) is Shard and pl.dim == head_dim and job.num_heads > 1
                    and i < len(names) and names[i] in self.head_dims)
            if isinstance(pl, (Shard, _StridedShard)) and not keep:
                cut.append(i)
                gather.append(Replicate())
            else:
                gather.append(pl)
        return gather, cut

    def orthogonalize(self, jobs: list[MatrixJob], ortho: Orthogonalize) -> list[torch.Tensor]:
        plans = []
        for job in jobs:  # 1. gather
            if not isinstance(job.param, DTensor):
                plans.append((job, job.update, None, None))
                continue
            gather, cut = self._layout(job)
            block = job.update.redistribute(job.param.device_mesh, gather).to_local()
            plans.append((job, block, gather, cut))
        mine = self._owned(plans)
        out = []
        for (job, block, gather, cut), owned in zip(plans, mine):  # 2. orthogonalise, 3. scatter
            if gather is None:
                out.append(ortho(block, job))
                continue
            result = ortho(block, job) if owned else torch.zeros_like(block)
            mesh = job.param.device_mesh
            partial = [Partial() if i in cut else pl for i, pl in enumerate(gather)]
            dt = DTensor.from_local(result, mesh, partial, shape=job.param.shape,
                                    stride=job.param.stride())
            out.append(dt.redistribute(mesh, job.param.placements))
        return out

    @staticmethod
    def _owned(plans) -> list[bool]:
        """Greedy balance per set of cut dimensions: which blocks this rank orthogonalises."""
        load: dict[tuple, list[int]] = {}
        order = sorted(range(len(plans)), key=lambda i: -plans[i][1].numel())
        owned = [True] * len(plans)
        for i in order:
            job, block, gather, cut = plans[i]
            if gather is None or not cut:
                continue
            mesh = job.param.device_mesh
            sizes = [mesh.size(d) for d in cut]
            table = load.setdefault((mesh, tuple(cut)), [0] * math.prod(sizes))
            owner = min(range(len(table)), key=lambda r: (table[r], r))
            table[owner] += block.numel()
            me = 0
            for d, size in zip(cut, sizes):
                me = me * size + mesh.get_local_rank(d)
            owned[i] = owner == me
        return owned
