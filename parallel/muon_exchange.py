"""Per-Head Muon's exchange: the seam between the optimizer (train.optim.muon) and the layout.

The optimizer hands all of a step's updates (MatrixJob) to a MatrixExchange together with its
orthogonalisation (an Orthogonalize callable: Newton-Schulz on a block of whole matrices); the
exchange returns each job's orthogonalised update, this rank's part. LocalExchange: every
parameter is whole on this rank. DTensorExchange: DTensor parameters (FSDP2, HSDP, TP).

Newton-Schulz needs whole matrices, and each should be orthogonalised once, by one rank, holding
no more than its share of them (Moonlight's and Dion's distributed Muon):
1. Which mesh dimensions cut a job's matrices: a shard of a matrix dimension does; a shard of a
   stack's expert dimension does not (each expert is whole where it is), nor a head-parallel
   dimension of a per-head job (its shards are whole heads, orthogonalised where they are).
   A job no dimension cuts is orthogonalised locally, with no communication.
2. One cut dimension (the largest: FSDP's) is the exchange's; any other (a column- or
   row-parallel tensor dimension) is all-gathered first, within it.
3. A job's block larger than the ranks' mean share (P/N elements) is cut into pieces of whole
   experts (a stack) or whole heads (a per-head job), each orthogonalised on its own anyway.
   Each piece gets an owner among the ranks of its exchange dimension, greedily by size,
   largest first, so that each rank assembles and orthogonalises about 1/N of them.
4. One all_to_all per mesh, exchange dimension and dtype hands every owner the shards of its
   pieces (each rank sends each local shard once); the owner assembles each piece at the
   global positions DTensor's placements give every shard (parallel/local_parts.py),
   orthogonalises it, and a second all_to_all returns every rank its part.
A rank so sends and receives about what it holds, O(P/N), and holds at most its own pieces: no
rank gathers every matrix, nor one matrix much larger than its share where heads or experts
divide it. The result equals the single-process update bit for bit: the same
whole matrices go through the same Newton-Schulz. Replicated dimensions (DDP replicas, HSDP's
replicate dimension) compute redundantly: each replica exchanges within its own shard ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .local_parts import dim_index


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

    def _cut_dims(self, job: MatrixJob) -> list[int]:
        """The mesh dimensions whose shards cut the job's matrices."""
        p = job.param
        names = p.device_mesh.mesh_dim_names or ()
        head_dim = job.head_axis - 2 + p.ndim
        cut = []
        for i, pl in enumerate(p.placements):
            if not isinstance(pl, (Shard, _StridedShard)):
                continue
            if p.ndim == 3 and pl.dim == 0:  # stacked experts: whole matrices
                continue
            if (type(pl) is Shard and pl.dim == head_dim and job.num_heads > 1
                    and i < len(names) and names[i] in self.head_dims):
                continue
            cut.append(i)
        return cut

    def orthogonalize(self, jobs: list[MatrixJob], ortho: Orthogonalize) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(jobs)
        exchanges: dict[tuple, list[_Block]] = {}
        for i, job in enumerate(jobs):
            if not isinstance(job.param, DTensor):
                out[i] = ortho(job.update, job)
                continue
            cut = self._cut_dims(job)
            if not cut:
                out[i] = _as_param(ortho(job.update.to_local(), job), job.param)
                continue
            mesh = job.param.device_mesh
            dim = max(cut, key=lambda d: (mesh.size(d), -d))
            block = _Block(i, job, dim, [d for d in cut if d != dim])
            exchanges.setdefault((mesh, dim, job.update.dtype), []).append(block)
        for group in exchanges.values():
            for block, part in zip(group, _exchange(group, ortho), strict=True):
                out[block.index] = _as_param(block.to_param_part(part), block.job.param)
        return out


def _gathered_positions(shape: tuple, now: tuple, mesh, coordinate: tuple, mesh_dim: int
                        ) -> tuple[int, int, list[list[int]]]:
    """Gathering along `mesh_dim`: (the tensor dimension it cuts, that dimension's extent once
    gathered, and for each rank r along it the positions its rows take there), from DTensor's
    placements `now` (parallel/local_parts.py)."""
    cut = now[mesh_dim].dim
    after = tuple(Replicate() if d == mesh_dim else pl for d, pl in enumerate(now))
    target = dim_index(shape[cut], cut, after, tuple(mesh.shape), coordinate)
    where = {g: i for i, g in enumerate(target)}
    positions = []
    for r in range(mesh.size(mesh_dim)):
        at = list(coordinate)
        at[mesh_dim] = r
        rows = dim_index(shape[cut], cut, now, tuple(mesh.shape), tuple(at))
        positions.append([where[g] for g in rows])
    return cut, len(target), positions


@dataclass(eq=False)
class _Block:
    """One job's update in the exchange over mesh dimension `dim`: gathered first along the
    `gathered` cut dimensions (all_gather), then assembled on its owner along `dim`."""

    index: int
    job: MatrixJob
    dim: int
    gathered: list[int]

    def __post_init__(self):
        param = self.job.param
        self.mesh, shape = param.device_mesh, tuple(param.shape)
        self.coordinate = tuple(self.mesh.get_coordinate())
        placements = tuple(param.placements)
        self.steps = []  # (mesh dim, tensor dim, gathered extent, positions), in order
        for mesh_dim in [*self.gathered, self.dim]:
            cut, extent, positions = _gathered_positions(shape, placements, self.mesh,
                                                         self.coordinate, mesh_dim)
            self.steps.append((mesh_dim, cut, extent,
                               [torch.tensor(p, dtype=torch.long) for p in positions]))
            placements = tuple(Replicate() if d == mesh_dim else pl
                               for d, pl in enumerate(placements))
        self.host_positions = positions  # the exchange dimension's (the last step's), host ints
        local = list(self.job.update.to_local().shape)
        for _, cut, extent, _ in self.steps[:-1]:
            local[cut] = extent
        _, self.cut, extent, positions = self.steps[-1]
        self.positions = [p.to(self.job.update.device) for p in positions]
        self.shard_shapes = []  # of each rank along `dim`, after the gathers
        for p in positions:
            local[self.cut] = len(p)
            self.shard_shapes.append(tuple(local))
        local[self.cut] = extent
        self.block_shape = tuple(local)

    def gathered_shard(self) -> torch.Tensor:
        """This rank's shard of the block: its update gathered along the other cut dims."""
        x = self.job.update.to_local()
        for mesh_dim, cut, extent, positions in self.steps[:-1]:
            x = _all_gather_rows(x, cut, extent, positions, self.mesh.get_group(mesh_dim))
        return x

    def to_param_part(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's part of the orthogonalised block back in the parameter's layout: the
        gathered dimensions sliced to its own rows again (no communication)."""
        for mesh_dim, cut, _, positions in reversed(self.steps[:-1]):
            mine = positions[self.coordinate[mesh_dim]].to(part.device)
            part = part.index_select(cut, mine)
        return part


def _all_gather_rows(x: torch.Tensor, cut: int, extent: int, positions: list[torch.Tensor],
                     group) -> torch.Tensor:
    """The ranks' `x` (their rows of tensor dim `cut`; uneven) gathered into the rows they take
    in the gathered tensor of `extent` rows: padded to the longest, all-gathered, placed."""
    longest = max(len(p) for p in positions)
    pad = list(x.shape)
    pad[cut] = longest - x.shape[cut]
    padded = torch.cat([x, x.new_zeros(pad)], dim=cut) if pad[cut] else x
    gathered = x.new_empty(len(positions) * padded.numel())
    dist.all_gather_into_tensor(gathered, padded.reshape(-1), group=group)
    gathered = gathered.view(len(positions), *padded.shape)
    shape = list(x.shape)
    shape[cut] = extent
    out = x.new_empty(shape)
    for r, rows in enumerate(positions):
        out.index_copy_(cut, rows.to(x.device), gathered[r].narrow(cut, 0, len(rows)))
    return out


@dataclass(eq=False)
class _Piece:
    """Whole heads or experts [lo, hi) of a block along `axis` (None: the whole block), which
    one owner assembles and orthogonalises. For each rank r along the exchange dimension:
    `take[r]`, the indices of its gathered shard that fall in the piece (along `axis`; None:
    all of it), `place[r]`, where those rows go in the piece along the block's cut dimension,
    and `shapes[r]`, the shape of its part."""

    block: _Block
    axis: int | None
    lo: int
    hi: int

    def __post_init__(self):
        b, self.take, self.place, self.shapes = self.block, [], [], []
        device = b.job.update.device
        for positions, host, shape in zip(b.positions, b.host_positions, b.shard_shapes,
                                          strict=True):
            shape = list(shape)
            if self.axis is None:
                take, place = None, positions
            elif self.axis == b.cut:  # host integers: no sync, nothing data-dependent
                inside = [(i, g - self.lo) for i, g in enumerate(host) if self.lo <= g < self.hi]
                take = torch.tensor([i for i, _ in inside], dtype=torch.long, device=device)
                place = torch.tensor([g for _, g in inside], dtype=torch.long, device=device)
                shape[b.cut] = len(inside)
            else:
                take, place = torch.arange(self.lo, self.hi, device=device), positions
                shape[self.axis] = self.hi - self.lo
            self.take.append(take)
            self.place.append(place)
            self.shapes.append(tuple(shape))
        self.shape = list(b.block_shape)
        if self.axis is not None:
            self.shape[self.axis] = self.hi - self.lo
        self.elements = math.prod(self.shape)

    def part(self, shard: torch.Tensor, r: int) -> torch.Tensor:
        """Rank r's part of the piece from its gathered shard."""
        return shard if self.take[r] is None else shard.index_select(self.axis, self.take[r])


def _split_axis(block: _Block) -> tuple[int | None, int]:
    """The dimension a block may be cut along into independently orthogonalised pieces, and how
    many units (experts of a stack, heads of a per-head job) it holds: (None, 1) for a single
    matrix."""
    job, ndim = block.job, len(block.block_shape)
    if ndim == 3:  # stacked experts: each is its own matrix
        return 0, block.block_shape[0]
    axis = job.head_axis - 2 + ndim
    heads = job.num_heads * block.block_shape[axis] // job.param.shape[axis]
    return (axis, heads) if heads > 1 else (None, 1)


def _cut_into_pieces(block: _Block, target: int) -> list[_Piece]:
    """The block in as few pieces of whole units as keep each near `target` elements."""
    axis, units = _split_axis(block)
    count = min(units, -(-math.prod(block.block_shape) // target))
    if axis is None or count <= 1:
        return [_Piece(block, None, 0, 0)]
    unit = block.block_shape[axis] // units
    bounds = [units * i // count * unit for i in range(count + 1)]
    return [_Piece(block, axis, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _exchange(group: list[_Block], ortho: Orthogonalize) -> list[torch.Tensor]:
    """One exchange dimension's jobs: shards to owners, pieces orthogonalised, parts back.

    A block larger than the ranks' mean share is cut into pieces of whole experts or heads
    (each orthogonalised on its own anyway) held by different owners, so that no owner
    assembles much more than its share: a rank's peak stays O(P/N) at large N too."""
    first = group[0]
    mesh, dim = first.mesh, first.dim
    size, me = mesh.size(dim), mesh.get_local_rank(dim)
    target = max(1, -(-sum(math.prod(b.block_shape) for b in group) // size))
    pieces = [piece for b in group for piece in _cut_into_pieces(b, target)]
    load = [0] * size
    owner = {}
    for piece in sorted(pieces, key=lambda q: (-q.elements, q.block.index, q.lo)):
        owner[id(piece)] = min(range(size), key=lambda r: (load[r], r))
        load[owner[id(piece)]] += piece.elements
    mine = [q for q in pieces if owner[id(q)] == me]
    by_owner = [q for r in range(size) for q in pieces if owner[id(q)] == r]
    shards = {b.index: b.gathered_shard() for b in group}
    # Shards to their owners: per destination, this rank's part of each piece it owns.
    to_owner = [math.prod(q.shapes[me]) for q in by_owner]
    send_splits = [sum(n for q, n in zip(by_owner, to_owner) if owner[id(q)] == r)
                   for r in range(size)]
    recv_sizes = [math.prod(q.shapes[r]) for r in range(size) for q in mine]
    recv_splits = [sum(math.prod(q.shapes[r]) for q in mine) for r in range(size)]
    received = _all_to_all([q.part(shards[q.block.index], me).reshape(-1) for q in by_owner],
                           send_splits, recv_splits, first.job.update.dtype, mesh.get_group(dim))
    del shards
    parts = iter(received.split(recv_sizes))
    assembled = {id(q): received.new_empty(q.shape) for q in mine}
    for r in range(size):
        for q in mine:
            assembled[id(q)].index_copy_(q.block.cut, q.place[r], next(parts).view(q.shapes[r]))
    del received, parts  # each buffer is let go once used: the exchange holds ~2x its share
    results = {}
    for q in mine:
        results[id(q)] = ortho(assembled.pop(id(q)), q.block.job)
    # Parts back: per destination, its part of every piece this rank owns.
    back_parts = [results[id(q)].index_select(q.block.cut, q.place[r]).reshape(-1)
                  for r in range(size) for q in mine]
    dtype = first.job.param.dtype
    del results
    back = _all_to_all(back_parts, recv_splits, send_splits, dtype, mesh.get_group(dim))
    local = {b.index: back.new_empty(b.shard_shapes[me]) for b in group}
    for q, x in zip(by_owner, back.split(to_owner), strict=True):
        out, x = local[q.block.index], x.view(q.shapes[me])
        if q.take[me] is None:
            out.copy_(x)
        else:
            out.index_copy_(q.axis, q.take[me], x)
    return [local[b.index] for b in group]


def _all_to_all(pieces: list[torch.Tensor], send_splits: list[int], recv_splits: list[int],
                dtype: torch.dtype, group) -> torch.Tensor:
    """all_to_all_single of the concatenated pieces; split sizes are host integers from the
    shapes (no sync)."""
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)
    pieces.clear()  # the caller's list: its tensors now live in `send` only
    received = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, send, recv_splits, send_splits, group=group)
    return received


def _as_param(local: torch.Tensor, param: DTensor) -> DTensor:
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())
