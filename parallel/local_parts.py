"""Which part of each logical parameter a rank holds, for initialising it in place.

A layout builds the model on the meta device, applies its plans (pipeline stages, home experts,
tensor-parallel and FSDP2 shards), materialises what is left with `to_empty` and lets
`K3Model.init_weights(seed, locate)` write each local part's values: `locate(name, param)`
answers with the tensor to write, the parameter's logical shape in the single-process model and
the global index of the local elements along each dimension (model/init.py computes every value
from its global position, so the part equals that of the whole model built in one process).

The index along each dimension follows DTensor's rules for the placements that act on it
(torch.chunk's pieces for Shard, FSDP2's uneven chunks among them, and the strided shards of
tensor parallelism's fused gate/up rows); tests/unit/parallel/test_local_parts.py holds it to
the elements DTensor itself gives each rank.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from model.init import LocalPart


def _chunk(index: list[int], parts: int, which: int) -> list[int]:
    """torch.chunk's `which`-th of `parts` pieces (ceil-sized, the last ones short or empty)."""
    size = -(-len(index) // parts)
    return index[which * size:(which + 1) * size]


def _split(index: list[int], placement, parts: int, which: int) -> list[int]:
    """What one mesh dimension's placement leaves of one tensor dimension's `index` on the rank
    at coordinate `which` of its `parts`: a Shard takes its chunk; a _StridedShard splits the
    index into `split_factor` pieces first and takes its chunk of each (tensor parallelism's
    fused gate/up rows: its slice of the gate rows, then of the up rows)."""
    if type(placement) is _StridedShard:
        pieces = [_chunk(index, placement.split_factor, i)
                  for i in range(placement.split_factor)]
        return [i for piece in pieces for i in _chunk(piece, parts, which)]
    return _chunk(index, parts, which)


def dtensor_index(param: DTensor) -> list[torch.Tensor]:
    """The global index (within `param`'s logical shape) of its local elements, per dimension:
    the placements applied in mesh-dimension order, as DTensor nests them."""
    mesh, device = param.device_mesh, param.to_local().device
    return [torch.tensor(dim_index(size, dim, tuple(param.placements),
                                    tuple(mesh.shape), tuple(mesh.get_coordinate())),
                         dtype=torch.long, device=device)
            for dim, size in enumerate(param.shape)]


@functools.lru_cache(maxsize=4096)
def dim_index(size: int, dim: int, placements: tuple, mesh_shape: tuple,
               coordinate: tuple) -> tuple[int, ...]:
    """Dimension `dim`'s index on the rank at `coordinate` (host integers; many parameters
    share their sizes and layouts, so each is worked out once)."""
    index = list(range(size))
    for placement, parts, which in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
            index = _split(index, placement, parts, which)
    return tuple(index)


def local_part(param: torch.Tensor, leading_offset: int = 0,
               leading_size: int | None = None) -> LocalPart:
    """(tensor to write, logical shape, index per dimension) of `param`. `leading_offset` and
    `leading_size`: the parameter is itself a slice of a larger logical tensor along dim 0,
    starting there and that long (a rank's home experts of all the experts)."""
    if isinstance(param, DTensor):
        local, shape, index = param.to_local(), list(param.shape), dtensor_index(param)
    else:
        local, shape, index = param.data, list(param.shape), None
    if leading_size is None:
        return local, shape, index
    if index is None:
        index = [torch.arange(n, device=local.device) for n in shape]
    index[0] = index[0] + leading_offset
    shape[0] = leading_size
    return local, shape, index
