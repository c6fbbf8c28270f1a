"""Per-Head Muon's exchange: the seam between the optimizer (train.optim.muon) and the layout.

The optimizer hands all of a step's updates (MatrixJob) to a MatrixExchange together with its
orthogonalisation (an Orthogonalize callable: Newton-Schulz on a block of whole matrices); the
exchange returns each job's orthogonalised update, this rank's part. LocalExchange: every
parameter is whole on this rank. DTensorExchange: DTensor parameters (FSDP2, HSDP, TP).

Newton-Schulz needs whole matrices. For every parameter of a step (parameters of one shape,
dtype and layout stacked, so that each such group costs one collective per step and direction):
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from parallel.strides import contiguous_strides


@dataclass(eq=False)
class MatrixJob:
    """One parameter's update for the exchange. `update` is this rank's part, shaped like
    `param`; `param.shape` is the logical shape (DTensors report the full one)."""

    update: torch.Tensor
    param: torch.Tensor
    num_heads: int
    head_axis: int
    ns_steps: int = 5
    ns_dtype: torch.dtype | None = None


# Orthogonalises a block of whole matrices of a job: the full logical update, or a slice of
# whole heads along the job's head axis.
Orthogonalize = Callable[[torch.Tensor, MatrixJob], torch.Tensor]


class MatrixExchange(Protocol):
    """Seam for sharded parameters: whole matrices orthogonalised, local parts returned."""

    def orthogonalize(self, jobs: list[MatrixJob], ortho: Orthogonalize) -> list[torch.Tensor]:
        """Each job's orthogonalised update, this rank's part shaped like its `update`."""
        ...


class LocalExchange:
    """Every parameter is whole on this rank."""

    def orthogonalize(self, jobs: list[MatrixJob], ortho: Orthogonalize) -> list[torch.Tensor]:
        return [ortho(job.update, job) for job in jobs]


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
        groups = self._groups(jobs)
        plans = [None] * len(jobs)
        # 1. gather: jobs of one shape and layout are stacked, so that each such group costs
        # one collective, not one per parameter.
        for members, gather, cut in groups:
            if gather is None:
                for i in members:
                    plans[i] = (jobs[i], jobs[i].update, None, None)
                continue
            updates = [jobs[i].update for i in members]
            blocks = _stacked(updates).redistribute(updates[0].device_mesh,
                                                    _shifted(gather)).to_local()
            for i, block in zip(members, blocks.unbind(0)):
                plans[i] = (jobs[i], block, gather, cut)
        mine = self._owned(plans)
        out = [None] * len(jobs)
        for members, gather, cut in groups:  # 2. orthogonalise, 3. scatter
            if gather is None:
                for i in members:
                    out[i] = ortho(plans[i][1], jobs[i])
                continue
            param = jobs[members[0]].param
            results = torch.stack([ortho(plans[i][1], jobs[i]) if mine[i]
                                   else torch.zeros_like(plans[i][1], dtype=param.dtype)
                                   for i in members])
            mesh = param.device_mesh
            partial = [Partial() if i in cut else pl for i, pl in enumerate(gather)]
            shape = (len(members), *param.shape)
            stacked = DTensor.from_local(results, mesh, _shifted(partial), shape=shape,
                                         stride=contiguous_strides(shape))
            local = stacked.redistribute(mesh, _shifted(param.placements)).to_local()
            for i, part in zip(members, local.unbind(0)):
                out[i] = DTensor.from_local(part, mesh, param.placements, shape=param.shape,
                                            stride=param.stride())
        return out

    def _groups(self, jobs: list[MatrixJob]) -> list[tuple[list[int], list | None, list]]:
        """(job indices, placements to gather to, mesh dims gathered over) per group of jobs
        whose collectives can be one: same mesh, logical shape, dtype, placements of update
        and parameter, and what is gathered (a head-parallel dimension stays sharded for
        per-head groups only). A parameter that is not a DTensor is a group of its own
        (gather None)."""
        groups: dict[tuple, tuple[list[int], list | None, list]] = {}
        for i, job in enumerate(jobs):
            if not isinstance(job.param, DTensor):
                groups[("local", i)] = ([i], None, [])
                continue
            gather, cut = self._layout(job)
            u = job.update
            key = (u.device_mesh, tuple(u.placements), tuple(job.param.placements),
                   tuple(u.shape), u.dtype, tuple(gather), tuple(cut))
            groups.setdefault(key, ([], gather, cut))[0].append(i)
        return list(groups.values())

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


def _shifted(placements):
    """Placements of a tensor stacked on a new leading dimension: shards move one dim up."""
    out = []
    for pl in placements:
        if type(pl) is _StridedShard:
            out.append(_StridedShard(pl.dim + 1, split_factor=pl.split_factor))
        elif type(pl) is Shard:
            out.append(Shard(pl.dim + 1))
        else:
            out.append(pl)
    return out


def _stacked(updates: list[DTensor]) -> DTensor:
    """Updates of one shape and layout as one DTensor [n, ...] (their local parts stacked)."""
    first = updates[0]
    local = torch.stack([u.to_local() for u in updates])
    shape = (len(updates), *first.shape)
    return DTensor.from_local(local, first.device_mesh, _shifted(first.placements), shape=shape,
                              stride=contiguous_strides(shape))
