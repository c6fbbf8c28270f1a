"""The dry run's probes (train/step_probes.py): live bytes and their peak, exact to the
allocator's 512-byte blocks, on real and on fake tensors alike; the bytes of every collective
by kind, torch.distributed's calls and the functional ones DTensor uses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from train.step_probes import CollectiveBytes, StepMemory


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_live_bytes_and_peak_follow_allocations_frees_and_resizes(fake):
    mode = FakeTensorMode() if fake else None
    with mode if fake else torch.no_grad():
        held = torch.empty(1000)  # made before: tracked on request
        memory = StepMemory()
        memory.track([held])
        assert memory.current == 4096  # 4000 bytes in 512-byte blocks
        with memory:
            a = torch.zeros(256, 4)  # 4096 bytes
            b = a * 2  # another 4096
            assert memory.current == 3 * 4096
            del a, b
            c = torch.ones(10)  # 40 bytes: one block
            assert memory.current == 4096 + 512
            c.untyped_storage().resize_(0)  # FSDP2's way of freeing
            assert memory.current == 4096
            c.untyped_storage().resize_(4000)
            assert memory.current == 2 * 4096
        assert memory.peak == 3 * 4096
        del c
        assert memory.current == 4096


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()


def test_collectives_are_counted_by_their_buffers(fake_world):
    counter = CollectiveBytes()
    x = torch.zeros(10)  # 40 bytes
    with counter:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(40), x)  # the 160-byte output
        dist.reduce_scatter_tensor(torch.empty(10), torch.zeros(40))  # the 160-byte input
        dist.all_to_all_single(torch.empty(40), torch.zeros(40))
        dist.broadcast(x, src=0)
        group = dist.group.WORLD
        funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))  # DTensor's collectives
        funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.zeros(40), "sum", 0, group))
        funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
    assert dict(counter.bytes) == {"all_reduce": 80, "all_gather": 320, "reduce_scatter": 320,
                                   "all_to_all": 160, "broadcast": 40}
    assert dict(counter.calls) == {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 2,
                                   "all_to_all": 1, "broadcast": 1}
