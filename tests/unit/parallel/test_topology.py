"""Topology: validation names the fields; groups and meshes equal megatron-core's RankGenerator
(1024 ranks on the fake process group). tests/distributed/test_topology.py runs them on gloo."""

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator
from torch.testing._internal.distributed.fake_pg import FakeStore

from model.config import ConfigError, k3_full, k3_tiny
from parallel.topology import MEGATRON_ORDER, Topology
from tests.helpers.parallel_harness import parallel_config

# ---- validation, before any process group ----

@pytest.mark.parametrize("kw, world, model, message", [
    (dict(data=3), 4, None, "parallel.data=3 is invalid: data*tensor*context*pipeline must equal"),
    (dict(tensor=2, context=2), 6, None, "parallel.tensor*context*pipeline=4 is invalid"),
    (dict(tensor=0), 4, None, "parallel.tensor=0"),
    (dict(tensor=3), 6, k3_tiny(), "model.kda.num_heads=2 is invalid: must be divisible by "
                                   "parallel.tensor=3"),
    (dict(tensor=2), 2, dataclasses.replace(k3_tiny(), vocab_size=2049),
     "model.vocab_size=2049 is invalid: must be divisible by parallel.tensor=2"),
    (dict(tensor=4), 4, dataclasses.replace(k3_tiny(), kda=dataclasses.replace(
        k3_tiny().kda, num_heads=4), mla=dataclasses.replace(k3_tiny().mla, num_heads=4),
        dense_intermediate=130), "model.dense_intermediate=130"),
    (dict(expert=3), 3, k3_tiny(), "model.moe.num_experts=8 is invalid: must be divisible by "
                                   "parallel.expert=3"),
    (dict(expert_tensor=3), 3, k3_tiny(), "model.moe.expert_intermediate=64 is invalid: must be "
                                          "divisible by parallel.expert_tensor=3"),
    (dict(tensor=2, expert_tensor=1), 2, None, "parallel.expert_tensor=1 is invalid: must be > 1 "
                                               "with parallel.tensor=2 and parallel.expert=1"),
    (dict(expert_tensor=0), 2, None, "parallel.expert_tensor=0 is invalid: must be >= 1, or -1"),
    (dict(expert=8), 4, None, "parallel.expert*expert_tensor=8 is invalid: must divide the "
                              "ranks of one pipeline stage"),
    (dict(expert=2, expert_tensor=2, pipeline=2), 4, None, "parallel.expert*expert_tensor=4"),
    (dict(data_replicate=3, data_shard="full"), 4, None, "parallel.data_replicate=3 is invalid: "
                                                        "must divide parallel.data=4"),
    (dict(data_replicate=2), 4, None, "parallel.data_replicate=2 is invalid: must be 1 with "
                                      "parallel.data_shard=none"),
    (dict(data_replicate=2, data_shard="full", expert=4), 4, None,
     "parallel.data_replicate=2 is invalid: must divide expert_data"),
    (dict(data_shard="zero3"), 4, None, "parallel.data_shard='zero3'"),
    (dict(data_shard="full", fsdp_param_dtype="bf16"), 4, None,
     "parallel.fsdp_param_dtype='bf16' is invalid: must be one of ['compute', 'master']"),
    (dict(expert_dispatch="alltoall"), 4, None, "parallel.expert_dispatch='alltoall'"),
    (dict(moonep_transport="nvshmem"), 4, None, "parallel.moonep.transport='nvshmem'"),
    (dict(moonep_alignment=0), 4, None, "parallel.moonep.alignment=0"),
    (dict(pipeline_schedule="GPipe"), 4, None, "parallel.pipeline_schedule='GPipe'"),
    (dict(pipeline=2, virtual_stages=2), 4, None,
     "parallel.virtual_stages=2 is invalid: must be == 1 with parallel.pipeline_schedule=1F1B"),
    (dict(pipeline=2, pipeline_schedule="Interleaved1F1B"), 4, None,
     "parallel.virtual_stages=1 is invalid: must be >= 2"),
    (dict(pipeline=2, pipeline_schedule="DualPipeV", virtual_stages=3), 4, None,
     "parallel.virtual_stages=3 is invalid: must be == 2"),
    (dict(pipeline_schedule="ZBVZeroBubble", virtual_stages=2), 4, None,
     "must be 1 with parallel.pipeline=1"),
    (dict(pipeline=8, pipeline_schedule="DualPipeV", virtual_stages=2), 8, k3_tiny(),
     "model.num_layers=8 is invalid: must be >= parallel.pipeline*virtual_stages = 8*2 = 16"),
    (dict(backend="mpi"), 4, None, "parallel.backend='mpi'"),
    (dict(timeout_s=0.0), 4, None, "parallel.timeout_s=0.0 is invalid: must be > 0"),
])
def test_bad_layouts_are_rejected_naming_the_fields(kw, world, model, message):
    with pytest.raises(ConfigError) as err:
        Topology.from_config(parallel_config(**kw), world, model)
    assert message in str(err.value)


def test_sizes_resolve_from_the_world():
    t = Topology.from_config(parallel_config(tensor=2, data_replicate=2, data_shard="full"), 16,
                             k3_tiny())
    assert (t.pp, t.dp, t.dp_replicate, t.dp_shard, t.cp, t.tp, t.ep, t.etp, t.edp) == \
        (1, 8, 2, 4, 1, 2, 1, 2, 8)  # without expert parallelism the experts split like the MLP
    assert t.sequence_parallel
    t = Topology.from_config(parallel_config(tensor=2, expert=2), 4, k3_tiny())
    assert (t.ep, t.etp, t.edp) == (2, 1, 2)  # with it each tensor-parallel rank has its own
    # Sequence parallelism only exists over tensor-parallel ranks: ignored (off) without them.
    assert not Topology.from_config(parallel_config(), 4).sequence_parallel
    t = Topology.from_config(parallel_config(tensor=8, context=2, pipeline=8, expert=32,
                                             expert_tensor=2), 1024, k3_full())
    assert (t.dp, t.edp) == (8, 2)
    assert not t.initialized
    with pytest.raises(RuntimeError, match="initialize"):
        t.group("tp")


def test_symmetric_memory_transport_needs_cuda_except_in_a_dry_run():
    """Refused on a CPU world; accepted on the fake process group, where a dry run models the
    GPU job (its exchange a stand-in)."""
    t = Topology.from_config(parallel_config(moonep_transport="symm_mem"), 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="parallel.moonep.transport='symm_mem'.*needs CUDA"):
            t.initialize("cpu")
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        t.initialize("cpu")
        t.destroy()
    finally:
        dist.destroy_process_group()


# ---- groups equal megatron-core's RankGenerator ----

def _oracle(t: Topology) -> dict[str, list[list[int]]]:
    """Every group of every dimension from megatron-core's RankGenerator (no process group)."""
    dense = RankGenerator(tp=t.tp, ep=1, dp=t.dp, pp=t.pp, cp=t.cp, order=MEGATRON_ORDER)
    expert = RankGenerator(tp=t.etp, ep=t.ep, dp=t.edp, pp=t.pp, cp=1, order=MEGATRON_ORDER)
    dp = dense.get_ranks("dp")
    dp_cp = dense.get_ranks("dp-cp")
    shard_cp = t.dp_shard * t.cp
    groups = {
        "tp": dense.get_ranks("tp"), "cp": dense.get_ranks("cp"), "pp": dense.get_ranks("pp"),
        "dp": dp, "dp_cp": dp_cp, "dp_cp_tp": dense.get_ranks("tp-cp-dp"),
        # megatron's partial distributed optimizer: contiguous runs of the dp x cp ranks ...
        "dp_shard_cp": [g[i:i + shard_cp] for g in dp_cp for i in range(0, len(g), shard_cp)],
        # ... and of the dp ranks (shards), the replicas strided across them
        "dp_shard": [g[i:i + t.dp_shard] for g in dp for i in range(0, len(g), t.dp_shard)],
        "dp_replicate": [g[i::t.dp_shard] for g in dp for i in range(t.dp_shard)],
        "ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp"),
        "edp": expert.get_ranks("dp"),
        # the expert-data ranks split the same way: shard runs, replicas strided
        "edp_shard": [g[i:i + t.edp // t.dp_replicate] for g in expert.get_ranks("dp")
                      for i in range(0, len(g), t.edp // t.dp_replicate)],
        "edp_replicate": [g[i::t.edp // t.dp_replicate] for g in expert.get_ranks("dp")
                          for i in range(t.edp // t.dp_replicate)],
    }
    return {name: sorted(g) for name, g in groups.items()}


LAYOUTS_1024 = {
    "tp8-ep64-pp16": parallel_config(tensor=8, expert=64, pipeline=16),
    "tp8-cp2-pp8-ep32-etp2": parallel_config(tensor=8, context=2, pipeline=8, expert=32,
                                             expert_tensor=2),
    "hsdp2x4-tp8-cp2-pp8-ep16-etp2": parallel_config(tensor=8, context=2, pipeline=8,
                                                     expert=16, expert_tensor=2,
                                                     data_replicate=2, data_shard="full"),
}


@pytest.mark.parametrize("name", LAYOUTS_1024)
def test_every_group_of_a_1024_rank_layout_equals_the_rank_generator(name):
    t = Topology.from_config(LAYOUTS_1024[name], 1024, k3_full())
    oracle = _oracle(t)
    for dim, groups in oracle.items():
        assert t.all_groups(dim) == groups, dim
        assert all(len(g) == t.size(dim) for g in groups), dim


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LAYOUTS_1024)
def test_a_1024_rank_layout_initialises_on_the_fake_process_group(name):
    t = Topology.from_config(LAYOUTS_1024[name], 1024, k3_full())
    oracle = _oracle(t)
    world = torch.arange(1024, dtype=torch.int)
    ranks = [0, 1, 511, 1023, *random.Random(name).sample(range(2, 1023), 4)]
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=1024)
        try:
            t.initialize("cpu")
            for dim, groups in oracle.items():
                (expected,) = [g for g in groups if rank in g]
                group = t.group(dim)
                assert dist.get_process_group_ranks(group) == expected, (dim, rank)
                assert t.rank_in(dim) == expected.index(rank) == dist.get_rank(group), dim
                assert t.mesh(dim).mesh.tolist() == expected, (dim, rank)
            # megatron-core's own view of this rank agrees
            assert ps.get_tensor_model_parallel_rank() == t.rank_in("tp")
            assert ps.get_pipeline_model_parallel_rank() == t.rank_in("pp")
            assert ps.get_data_parallel_rank() == t.rank_in("dp")
            assert ps.get_context_parallel_rank() == t.rank_in("cp")
            assert ps.get_expert_model_parallel_rank() == t.rank_in("ep")
            assert ps.get_expert_tensor_parallel_rank() == t.rank_in("etp")
            assert ps.get_expert_data_parallel_rank() == t.rank_in("edp")
            # n-D meshes span the world exactly as init_device_mesh would lay it out
            full = t.mesh("pp", "dp_replicate", "dp_shard", "cp", "tp")
            assert torch.equal(full.mesh, world.reshape(t.pp, t.dp_replicate, t.dp_shard,
                                                        t.cp, t.tp))
            experts = t.mesh("pp", "edp", "ep", "etp")
            assert torch.equal(experts.mesh, world.reshape(t.pp, t.edp, t.ep, t.etp))
            for mesh, dims in ((full, ("pp", "dp_replicate", "dp_shard", "cp", "tp")),
                               (experts, ("pp", "edp", "ep", "etp"))):
                assert list(mesh.get_coordinate()) == [t.rank_in(d) for d in dims]
                for i, d in enumerate(dims):
                    assert mesh.get_group(i) is t.group(d)  # the same groups, no new ones
            dp_tp = t.mesh("dp", "tp")
            assert dp_tp.mesh[t.rank_in("dp"), t.rank_in("tp")] == rank
            assert dp_tp.mesh[:, 0].tolist() == t.ranks("dp", int(dp_tp.mesh[0, 0]))
            assert f"rank {rank}:" in t.describe()
        finally:
            t.destroy()
            dist.destroy_process_group()


# ---- a real 4-rank gloo world: groups equal meshes, collectives over each ----




@pytest.mark.parametrize("overrides, world, message", [
    (dict(data_shard="zero3"), 2, "parallel.data_shard='zero3'"),
    (dict(data=3), 2, "parallel.data=3"),
    (dict(expert=2, moonep_transport="symm_mem"), 2,
     "parallel.moonep.transport='symm_mem' is invalid: needs CUDA (torch symmetric memory)"),
    # global batch 8 in micro-batches of 4 rows
    (dict(pipeline=2, data=2), 4, "stage.global_batch_size=8 is invalid: must give at least 2 "
                                  "micro-batches per data-parallel rank"),
    (dict(pipeline=2, pipeline_schedule="ZBVZeroBubble", virtual_stages=2), 2,
     "must give at least 4 micro-batches"),
])
def test_train_config_validation_uses_the_topology(overrides, world, message):
    """What no layout can do, each with the field named."""
    from train.config import TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=parallel_config(**overrides))
    cfg.stage.micro_batch_size = 4
    with pytest.raises(ConfigError) as err:
        validate_train_config(cfg, world)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, world", [
    (dict(pipeline=16, expert=64, tensor=8, data_shard="full"), 2048),
    (dict(pipeline=8, expert=32, expert_tensor=2, tensor=8, context=2, data_replicate=2,
          data_shard="full"), 1024),
    (dict(pipeline=8, expert=32, tensor=8, context=2, data_shard="optimizer"), 1024),
    (dict(pipeline=4, context=64, tensor=8, data_shard="full"), 2048),
])
def test_full_size_combined_layouts_pass_start_up_validation(overrides, world):
    """Pipeline with expert (and expert tensor), context and sharded data parallelism together
    (k3_full at 1024 and 2048 ranks) pass k3-train's start-up checks."""
    from model.config import k3_full
    from train.config import TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=parallel_config(**overrides))
    cfg.model = k3_full()
    cfg.stage.seq_len, cfg.stage.micro_batch_size = 8192, 1
    data = world // (overrides["pipeline"] * overrides.get("context", 1) * overrides["tensor"])
    cfg.stage.global_batch_size = data * 2 * overrides["pipeline"]  # 2 micro-batches a stage
    assert validate_train_config(cfg, world, data=False) is cfg


@pytest.mark.parametrize("overrides, world, message", [
    # the default stage: global batch 8 as one micro-batch of 8 rows
    (dict(data=2), 2, "= 8*2 = 16: set stage.micro_batch_size=4"),
    (dict(pipeline=2), 2, "(global_batch_size / (micro_batch_size*data) = 1): "
                             "set stage.micro_batch_size=4"),
    (dict(pipeline=2, pipeline_schedule="ZBVZeroBubble", virtual_stages=2), 2,
     "must give at least 4 micro-batches per data-parallel rank with parallel.pipeline=2 and "
     "pipeline_schedule=ZBVZeroBubble (global_batch_size / (micro_batch_size*data) = 1): "
     "set stage.micro_batch_size=2"),
    (dict(data=4), 4, "= 8*4 = 32: set stage.micro_batch_size=2"),
    (dict(data=2, pipeline=2), 4, "= 8*2 = 16: set stage.micro_batch_size=2"),
    (dict(data=3), 3, "= 8*3 = 24: raise stage.global_batch_size to a multiple of 24"),
])
def test_a_batch_that_does_not_split_is_refused_with_what_fits(overrides, world, message):
    from train.config import TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=parallel_config(**overrides))
    with pytest.raises(ConfigError) as err:
        validate_train_config(cfg, world)
    assert message in str(err.value)
    if "set stage.micro_batch_size=" in message:  # and what it names fits
        cfg.stage.micro_batch_size = int(message.rsplit("=", 1)[1])
        assert validate_train_config(cfg, world) is cfg


def test_a_pipeline_batch_too_small_for_its_stages_names_the_global_batch_that_fits():
    from train.config import TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=parallel_config(data=2, pipeline=2))
    cfg.stage.micro_batch_size = 1
    cfg.stage.global_batch_size = 2
    with pytest.raises(ConfigError, match=r"= 1\): raise stage.global_batch_size to a "
                                          r"multiple of 4"):
        validate_train_config(cfg, 4)


def test_train_config_accepts_pipeline_layouts():
    from train.config import TrainConfig, validate_train_config

    for parallel, world in ((parallel_config(pipeline=2), 2),
                            (parallel_config(pipeline=2, tensor=2), 4),
                            (parallel_config(pipeline=2, pipeline_schedule="Interleaved1F1B",
                                             virtual_stages=2), 2)):
        cfg = TrainConfig(parallel=parallel)
        cfg.stage.micro_batch_size = 4  # two micro-batches of the 8 rows
        assert validate_train_config(cfg, world) is cfg


def test_sequence_parallel_needs_the_sequence_to_split_over_tensor_ranks():
    from train.config import TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=parallel_config(tensor=2))
    cfg.stage.seq_len = 127
    with pytest.raises(ConfigError, match="stage.seq_len=127 is invalid: must be divisible by 2"):
        validate_train_config(cfg, 2)
    # Without it the MoE still splits the tokens over the tensor ranks (its experts are split
    # over them: expert tensor parallelism by default, or expert parallelism).
    cfg.parallel.sequence_parallel = False
    with pytest.raises(ConfigError, match="stage.seq_len=127 is invalid: must be divisible by 2"):
        validate_train_config(cfg, 2)
    cfg.stage.seq_len = 126
    assert validate_train_config(cfg, 2) is cfg


# Expert parallelism composed with FSDP2 and/or tensor parallelism on 4 ranks, written out by
# hand from the rank layout (dense rank = tp_i + tp*dp_i, expert rank = ep_i + ep*edp_i): every
# group as the list of groups that partition the world, and the mesh each plan builds on.
EP_COMPOSITIONS = [
    {"overrides": dict(expert=2, data_shard="full"),
     "sizes": dict(dp=4, tp=1, ep=2, edp=2),
     "groups": {"tp": [[0], [1], [2], [3]], "dp_cp": [[0, 1, 2, 3]], "ep": [[0, 1], [2, 3]],
                "edp": [[0, 2], [1, 3]], "dp_cp_tp": [[0, 1, 2, 3]]},
     # FSDP2 over the 4 data-parallel ranks; the experts their own unit over the edp mesh
     "data_mesh": (("dp_replicate", "dp_shard", "tp"), [[[0], [1], [2], [3]]]),
     "dense_meshes": {(("dp_shard",), "all")}, "balancer": "dp_cp"},
    {"overrides": dict(expert=2, tensor=2),
     "sizes": dict(dp=2, tp=2, ep=2, edp=2),
     "groups": {"tp": [[0, 1], [2, 3]], "dp_cp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]],
                "edp": [[0, 2], [1, 3]], "dp_cp_tp": [[0, 1, 2, 3]]},
     # DDP (FSDP2's replicate) x TP; the experts replicated over the edp mesh
     "data_mesh": (("dp_cp", "tp"), [[0, 1], [2, 3]]),
     "dense_meshes": {(("dp_cp", "tp"), "all"), (("dp_cp",), "dp_cp")},
     "balancer": "dp_cp_tp"},
    {"overrides": dict(expert=2, tensor=2, data_shard="full"),
     "sizes": dict(dp=2, tp=2, ep=2, edp=2),
     "groups": {"tp": [[0, 1], [2, 3]], "dp_cp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]],
                "edp": [[0, 2], [1, 3]], "dp_cp_tp": [[0, 1, 2, 3]]},
     # FSDP2 x TP on the 2x2 mesh; parameters outside TP (the vision tower) over dp only
     "data_mesh": (("dp_replicate", "dp_shard", "tp"), [[[0, 1], [2, 3]]]),
     "dense_meshes": {(("dp_shard", "tp"), "all"), (("dp_shard",), "dp_cp")},
     "balancer": "dp_cp_tp"},
]


def _group_of(groups: list[list[int]], rank: int) -> list[int]:
    (group,) = [g for g in groups if rank in g]
    return group


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides", [c["overrides"] for c in EP_COMPOSITIONS])
def test_expert_parallelism_composes_with_fsdp_and_tensor_parallelism(overrides, monkeypatch):
    """The layout validates, and on torch's fake process group (4 ranks, each in turn) the
    composition really builds: the topology's groups and the data-parallel mesh are the ones
    written out in EP_COMPOSITIONS, and k3-train's own steps (shard_experts, parallelize) on
    k3_tiny give each rank its 4 home experts of 8 (its ep coordinate's; under FSDP2 sharded
    over the expert-data mesh), the MoonEP dispatcher over the ep group, the dense parameters
    as DTensors on the expected meshes, tensor-parallel shards where tp > 1, and Quantile
    Balancing's reduction over the ranks that route different tokens. A topology that drops or
    folds a dimension (ep, edp, tp, the FSDP dims) fails here."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from model.k3 import K3Model
    from model.ops import fused
    from parallel.apply import parallelize, shard_experts
    from train.config import TrainConfig, validate_train_config

    (spec,) = [c for c in EP_COMPOSITIONS if c["overrides"] == overrides]
    cfg = TrainConfig(parallel=parallel_config(**overrides))
    cfg.stage.micro_batch_size = 1
    assert validate_train_config(cfg, 4) is cfg
    t = Topology.from_config(cfg.parallel, 4, cfg.model)
    assert {d: t.size(d) for d in spec["sizes"]} == spec["sizes"]
    assert (t.ep, t.etp, t.pp, t.cp, t.data_shard) == (2, 1, 1, 1, cfg.parallel.data_shard)
    monkeypatch.setattr(fused, "_enabled", fused.fused_kernels_enabled())  # parallelize sets it
    torch.manual_seed(0)
    reference = K3Model(cfg.model)  # unsharded: where every expert's weights start
    full = cfg.parallel.data_shard == "full"
    per_rank = cfg.model.moe.num_experts // 2
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            t.initialize("cpu")
            groups = {d: _group_of(g, rank) for d, g in spec["groups"].items()}
            for dim, expected in groups.items():
                assert dist.get_process_group_ranks(t.group(dim)) == expected, (dim, rank)
            dims, mesh_ranks = spec["data_mesh"]
            assert t.mesh(*dims).mesh.tolist() == mesh_ranks, rank
            assert t.mesh("edp").mesh.tolist() == groups["edp"], rank

            torch.manual_seed(0)
            model = K3Model(cfg.model)
            shard_experts(model, t, cfg)
            plan = parallelize(model, t, cfg)
            assert plan.expert_parallel and plan.data_parallel
            assert plan.balancer_group == spec["balancer"]
            assert t.ranks(plan.balancer_group) == groups[spec["balancer"]]

            ep_index, edp_index = groups["ep"].index(rank), groups["edp"].index(rank)
            home = slice(ep_index * per_rank, (ep_index + 1) * per_rank)
            for moe, ref in zip(model.moe_layers(), reference.moe_layers(), strict=True):
                assert moe.dispatcher.experts_per_rank == per_rank
                assert dist.get_process_group_ranks(moe.dispatcher.transport.group) == \
                    groups["ep"]
                for name in ("w1", "w2"):
                    weight, start = getattr(moe.experts, name), getattr(ref.experts, name)[home]
                    assert weight.shape == start.shape, (name, rank)
                    # FSDP2 shards the home experts over the expert-data ranks; replicate
                    # holds them whole on each
                    assert isinstance(weight, DTensor)
                    assert weight.placements == ((Shard(0),) if full else (Replicate(),))
                    assert weight.device_mesh.mesh.tolist() == groups["edp"]
                    shard = start.chunk(len(groups["edp"]))[edp_index] if full else start
                    assert torch.equal(weight.to_local(), shard), (name, rank)

            named = {"all": [0, 1, 2, 3], **groups}
            expected_meshes = {(names, tuple(named[which])) for names, which in
                               spec["dense_meshes"]}
            meshes, tp_sharded = set(), 0
            for p in model.parameters():
                if getattr(p, "expert_parallel", False) or not isinstance(p, DTensor):
                    continue
                mesh = p.device_mesh
                meshes.add((mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist())))
                if "tp" in mesh.mesh_dim_names:
                    placement = p.placements[mesh.mesh_dim_names.index("tp")]
                    tp_sharded += isinstance(placement, Shard)
            assert meshes == expected_meshes, rank
            assert (tp_sharded > 0) == (t.tp > 1), tp_sharded
        finally:
            t.destroy()
            dist.destroy_process_group()
