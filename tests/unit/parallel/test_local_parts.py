"""Which elements of a logical parameter a rank holds (parallel/local_parts.py): for each
placement the layouts use, on every rank of a 4-rank fake world, the per-dimension index equals
the elements DTensor itself gives that rank of the whole tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from model.init import Normal, fill_, parameter_key
from parallel.local_parts import local_part

SHAPE = (10, 12, 3)  # 10 rows over 4 ranks: FSDP2's uneven chunks (3, 3, 3, 1)
CASES = {
    "fsdp_rows": ((4,), [Shard(0)]),
    "columns": ((4,), [Shard(1)]),
    "tp_strided_gate_up": ((4,), [_StridedShard(1, split_factor=2)]),
    "hsdp": ((2, 2), [Replicate(), Shard(0)]),
    "fsdp_x_tp_strided": ((2, 2), [Shard(0), _StridedShard(1, split_factor=2)]),
    "two_dims_on_rows": ((2, 2), [Shard(0), Shard(0)]),
    # FSDP2 over tensor parallelism's head shards: the tp shard first, then FSDP's chunk of it
    "fsdp_over_tp_heads": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
}


@pytest.fixture(params=range(4), ids=lambda r: f"rank{r}")
def fake_rank(request):
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=4)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES)
def test_local_index_equals_the_elements_dtensor_gives_the_rank(fake_rank, case):
    mesh_shape, placements = CASES[case]
    mesh = init_device_mesh("cpu", mesh_shape)
    whole = torch.arange(torch.Size(SHAPE).numel()).view(SHAPE)
    expected = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
    param = distribute_tensor(torch.zeros(SHAPE), mesh, placements, src_data_rank=None)
    local, shape, index = local_part(param)
    assert local.shape == expected.shape and list(shape) == list(SHAPE)
    flat = (index[0].view(-1, 1, 1) * 36 + index[1].view(1, -1, 1) * 3 + index[2].view(1, 1, -1))
    assert torch.equal(flat, expected)
    # and so the values init writes there are the whole tensor's
    key = parameter_key(3, "w")
    full_values = fill_(torch.empty(SHAPE), Normal(1.0), key, SHAPE)
    part = fill_(local, Normal(1.0), key, shape, index)
    assert torch.equal(part, distribute_tensor(full_values, mesh, placements,
                                               src_data_rank=None).to_local())


def test_a_slice_of_a_larger_tensor_is_offset_along_dim_0():
    """A rank's home experts [2, ...] of 8: its rows are experts 4 and 5 when it is EP rank 2."""
    local, shape, index = local_part(torch.nn.Parameter(torch.zeros(2, 5)), 4, 8)
    assert list(shape) == [8, 5]
    assert index[0].tolist() == [4, 5] and index[1].tolist() == list(range(5))
