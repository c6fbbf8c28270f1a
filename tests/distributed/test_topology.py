"""Four gloo ranks run collectives over every group and DeviceMesh of their topology; in the
same world, distributed Muon's exchange orthogonalises pieces of blocks larger than a rank's
share on different owners, equal to one process."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.config import k3_tiny
from parallel.topology import Topology
from tests.helpers.parallel_harness import parallel_config
from tests.helpers.tolerances import assert_close_rms

# Layouts of 4 ranks and the meshes each must build.
LAYOUTS_4 = [
    (parallel_config(tensor=2), [("dp", "tp")]),
    (parallel_config(data_replicate=2, data_shard="full"), [("dp_replicate", "dp_shard")]),
    (parallel_config(context=2, tensor=2), [("cp", "tp")]),
    (parallel_config(expert=2), [("edp", "ep")]),
    (parallel_config(context=2, data_replicate=2, data_shard="full"),
     [("dp_replicate", "dp_shard_cp"), ("dp_replicate", "dp_shard", "cp")]),
    (parallel_config(pipeline=2, tensor=2, expert=2), [("pp", "tp"), ("pp", "edp", "ep", "etp")]),
    (parallel_config(tensor=2, expert=2, expert_tensor=2), [("dp", "tp"), ("ep", "etp")]),
]


def _check_hsdp(t: Topology, rank: int) -> None:
    """FSDP2 takes the HSDP mesh as is: its gradient is the mean of every data rank's."""
    from torch.distributed.fsdp import fully_shard

    def batch(r: int) -> torch.Tensor:
        return torch.arange(8.0).reshape(2, 4) * (r + 1) / 10

    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=t.mesh("dp_replicate", "dp_shard"))
    model(batch(t.rank_in("dp"))).square().sum().backward()
    for r in range(t.dp):  # the same weights, every rank's data, one process
        (reference(batch(r)).square().sum() / t.dp).backward()
    for name, p in model.named_parameters():
        assert_close_rms(getattr(reference, name).grad, p.grad.full_tensor(), 1e-6, name)


# Two sets of Muon jobs over 4 FSDP shards: (shape, heads, head axis, shard dim, pieces). A block
# larger than the mean share (the set's elements / 4) is cut into pieces of whole heads or
# experts held by different owners: 12 heads of 6 rows in 3 pieces (the shards' 18 rows
# straddle heads and pieces), 8 column heads of a row-sharded matrix in 2, and 6 experts of a
# row-sharded stack in 4 (of 1 or 2 experts); the others stay whole blocks.
MUON_JOB_SETS = [
    [((72, 256), 12, 0, 0, 3), ((48, 192), 8, 1, 0, 2), ((20, 24), 1, 0, 0, 1),
     ((6, 40, 24), 1, 0, 1, 1), ((36, 64), 1, 0, 0, 1)],
    [((6, 40, 64), 1, 0, 1, 4), ((36, 64), 1, 0, 0, 1)],
]


def _check_muon_pieces() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallel.muon_exchange import DTensorExchange, LocalExchange, MatrixJob
    from train.optim.muon import orthogonalize

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    generator = torch.Generator().manual_seed(0)
    for jobs in MUON_JOB_SETS:
        local, sharded = [], []
        share = -(-sum(math.prod(shape) for shape, *_ in jobs) // 4)
        for shape, heads, axis, dim, pieces in jobs:
            units = shape[0] if len(shape) == 3 else heads
            assert min(units, -(-math.prod(shape) // share)) == pieces, shape
            update = torch.randn(shape, generator=generator, dtype=torch.float64)
            param = torch.zeros(shape, dtype=torch.float64)
            local.append(MatrixJob(update, param, heads, axis))
            sharded.append(MatrixJob(distribute_tensor(update, mesh, [Shard(dim)]),
                                     distribute_tensor(param, mesh, [Shard(dim)]), heads, axis))
        expected = LocalExchange().orthogonalize(local, orthogonalize)
        got = DTensorExchange().orthogonalize(sharded, orthogonalize)
        for job, want, out in zip(jobs, expected, got, strict=True):
            assert torch.equal(out.full_tensor(), want), job


def _gloo_worker(rank: int, init_file: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    try:
        for parallel, meshes in LAYOUTS_4:
            t = Topology.from_config(parallel, 4, k3_tiny()).initialize("cpu")
            for dim in ("pp", "dp_replicate", "dp_shard", "dp", "cp", "tp", "dp_cp",
                        "dp_shard_cp", "dp_cp_tp", "ep", "etp", "edp"):
                ranks = t.ranks(dim)
                group = t.group(dim)
                assert dist.get_process_group_ranks(group) == ranks, (parallel, dim)
                assert t.mesh(dim).mesh.tolist() == ranks, (parallel, dim)
                total = torch.tensor([float(rank)])
                dist.all_reduce(total, group=group)
                assert total.item() == sum(ranks), (parallel, dim)
                gathered = [torch.zeros(1) for _ in ranks]
                dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
                assert [int(x.item()) for x in gathered] == ranks, (parallel, dim)
                assert t.rank_in(dim) == ranks.index(rank)
            for dims in meshes:
                mesh = t.mesh(*dims)
                assert mesh.mesh.tolist() == t.mesh_ranks(dims, rank).tolist()
                # a DTensor sharded over every mesh dim gathers back whole: the mesh's
                # collectives run on the topology's groups
                full = torch.arange(2.0**mesh.ndim * 3).reshape(*([2] * mesh.ndim), 3)
                shards = [Shard(i) for i in range(mesh.ndim)]
                dt = distribute_tensor(full, mesh, shards)
                assert torch.equal(dt.full_tensor(), full), dims
            if t.dp_replicate > 1:
                _check_hsdp(t, rank)
            # every rank answers the roll call (the failing-rank test sees one that does not:
            # tests/distributed/test_parallel_train.py)
            assert t.unresponsive_ranks(timeout_s=120) == [], parallel
            t.destroy()
        _check_muon_pieces()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_four_gloo_ranks_run_collectives_over_every_group_and_mesh(tmp_path):
    mp.spawn(_gloo_worker, args=(str(tmp_path / "init"),), nprocs=4, join=True)


# ---- k3-train's start-up validation goes through the Topology ----
