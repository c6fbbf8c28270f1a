"""The dry run (train/dry_run.py): on fake tensors it measures what the same step measures on
real ones (peak, the parts of it, parameters, collective bytes), for one process and for a rank
of a sharded layout on the fake process group; with its GPU-kernel stand-ins the same parts and
no higher a peak; it refuses bad ranks by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from model.config import ConfigError
from parallel.topology import Topology
from train.config import TrainConfig, validate_train_config
from train.dry_run import dry_run_config, measure_step, run_dry

# The fake step and the real one make the same allocations of the same sizes in the same order;
# a few small temporaries are freed a few operators apart (fake tensors let go of some
# references at other points), which moves the peak by a few 512-byte blocks (measured: 8 and
# 12 blocks). The parts of the peak and the collectives are equal exactly.
PEAK_BLOCKS = 64


def _tiny(tmp_path, **parallel) -> TrainConfig:
    cfg = TrainConfig()
    cfg.run_dir = str(tmp_path)
    cfg.optim.name = "muon"
    cfg.stage.seq_len, cfg.stage.micro_batch_size, cfg.stage.global_batch_size = 128, 2, 4
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    return cfg


def test_one_rank_dry_run_measures_what_the_real_step_allocates(tmp_path):
    """World 1, bf16 autocast (the GPU's precision=auto), two accumulated micro-batches: the
    fake step (the torch forms) allocates what the real step does, its parts of memory and
    parameter count byte for byte, its peak within PEAK_BLOCKS; the dry run, whose attention
    and KDA stand in for the GPU kernels (outputs and inputs kept, no tiles or chunk
    intermediates), has the same parts and a peak above them and at most the torch forms'."""
    cfg = _tiny(tmp_path)
    cfg.dry_run.world_size = 1
    assert run_dry(cfg) == 0
    got = json.loads((tmp_path / "dry_run.json").read_text())
    real = measure_step(dry_run_config(cfg), None)
    fake = measure_step(dry_run_config(cfg), None, FakeTensorMode(allow_non_fake_inputs=True))
    assert abs(fake.peak_memory_bytes - real.peak_memory_bytes) <= PEAK_BLOCKS * 512
    assert fake.memory_bytes == real.memory_bytes
    assert got["parameters_on_rank"] == real.parameters == 1161292  # all of k3_tiny
    assert got["memory_bytes"] == real.memory_bytes
    assert sum(real.memory_bytes.values()) < got["peak_memory_bytes"] <= real.peak_memory_bytes
    assert got["collective_bytes"] == {}  # one process
    assert set(got) >= {"world_size", "rank", "layout", "parameters_on_rank",
                        "peak_memory_bytes", "collective_bytes", "planned_memory_bytes"}


def test_a_sharded_rank_measures_the_same_on_fake_and_real_tensors(tmp_path):
    """Rank 5 of FSDP2 x TP2 at world 8 on the fake process group (whose collectives move no
    data): real tensors and fake ones allocate and communicate the same."""
    cfg = dry_run_config(_tiny(tmp_path, data_shard="full", tensor=2))
    cfg.stage.global_batch_size = 8
    validate_train_config(cfg, 8, data=False)
    runs = []
    for fake in (None, FakeTensorMode(allow_non_fake_inputs=True)):
        dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        topology = Topology.from_config(cfg.parallel, 8, cfg.model).initialize("cpu")
        try:
            runs.append(measure_step(cfg, topology, fake))
        finally:
            topology.destroy()
            dist.destroy_process_group()
    real, dry = runs
    assert abs(dry.peak_memory_bytes - real.peak_memory_bytes) <= PEAK_BLOCKS * 512
    assert (dry.parameters, dry.memory_bytes, dry.collective_bytes, dry.collective_calls) == (
        real.parameters, real.memory_bytes, real.collective_bytes, real.collective_calls)
    assert real.parameters < 1161292 / 2  # this rank's shards
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(real.collective_bytes)


def test_a_rank_outside_the_world_is_refused_by_name(tmp_path):
    cfg = _tiny(tmp_path)
    cfg.dry_run.world_size, cfg.dry_run.rank = 8, 8
    cfg.stage.global_batch_size = 16
    with pytest.raises(ConfigError, match=r"dry_run.rank=8 .*\[0, dry_run.world_size=8\)"):
        validate_train_config(cfg, data=False)


def _measure_rank_1_of_4(cfg: TrainConfig):
    """(the step's measurement, the layout) of rank 1 of a world of 4 on the fake process group,
    one micro-batch a rank."""
    cfg.stage.micro_batch_size, cfg.stage.global_batch_size = 1, 4
    validate_train_config(cfg, 4, data=False)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    topology = Topology.from_config(cfg.parallel, 4, cfg.model).initialize("cpu")
    try:
        return measure_step(cfg, topology, FakeTensorMode(allow_non_fake_inputs=True)), topology
    finally:
        topology.destroy()
        dist.destroy_process_group()


@pytest.mark.parametrize("fsdp_param_dtype", ["compute", "master"])
def test_fsdp2_gathers_layers_in_bf16_and_the_routers_in_fp32(tmp_path, fsdp_param_dtype):
    """FSDP2 at world 4 under bf16 autocast: the bytes it gathers and reduce-scatters in one
    step equal k3-plan's count, which takes the decoder layers at 2 bytes a parameter with
    parallel.fsdp_param_dtype=compute (the routers, embedding and head at 4), all at 4 with
    master; gradients reduce in fp32 either way."""
    from model.k3 import K3Model
    from train.sizing import data_parallel_bytes, gathered_bytes

    cfg = dry_run_config(_tiny(tmp_path, data_shard="full", fsdp_param_dtype=fsdp_param_dtype))
    got, topology = _measure_rank_1_of_4(cfg)
    gather = gathered_bytes(cfg.precision.name, "full", fsdp_param_dtype)
    assert gather == {"compute": 2, "master": 4}[fsdp_param_dtype]
    with torch.device("meta"):
        meta = K3Model(cfg.model)
    planned = data_parallel_bytes(meta, topology, gather_bytes=gather)
    # FSDP2 pads each parameter's dim 0 to a multiple of the 4 shards, which k3-plan leaves out.
    padding = {"all_gather": 0, "reduce_scatter": 0}
    for name, p in meta.named_parameters():
        rows = -p.shape[0] % 4 * p[0].numel()
        layer = name.startswith("layers.")
        width = gather if layer and ".router." not in name else 4
        padding["all_gather"] += rows * width * (2 if layer else 1)  # layers gather again
        padding["reduce_scatter"] += rows * 4
    assert padding["reduce_scatter"] > 0
    for op in padding:
        assert got.collective_bytes[op] == planned[op] + padding[op], op


@pytest.mark.parametrize("parallel", [
    dict(data_shard="full", expert=2),
    dict(data_shard="full", expert=2, data_replicate=2),
    dict(data_shard="optimizer", expert=2),
    dict(data_shard="optimizer", expert_tensor=2),
], ids=["ep2_fsdp2", "ep2_hsdp2", "ep2_zero1", "etp2_zero1"])
def test_expert_layouts_pass_k3_plans_data_parallel_bytes(tmp_path, parallel):
    """At world 4, the experts reduced over their own expert-data ranks (units of their own under
    FSDP2, owners of their own under ZeRO-1): FSDP2's gathers and reduce-scatters and ZeRO-1's
    broadcasts equal k3-plan's data-parallel count, the dense parameters' and the experts'
    (the all-gathers beside them: MoonEP's tokens-per-expert counts, [ep, E] int32 per MoE layer
    and micro-batch, the symm_mem transport's only all-gather)."""
    from model.k3 import K3Model
    from train.sizing import data_parallel_bytes, gathered_bytes

    cfg = dry_run_config(_tiny(tmp_path, **parallel))
    cfg.parallel.moonep.transport = "symm_mem"  # a dry run's stand-in: no CUDA needed
    cfg.dry_run.world_size = 4
    got, topology = _measure_rank_1_of_4(cfg)
    with torch.device("meta"):
        meta = K3Model(cfg.model)
    planned = data_parallel_bytes(meta, topology,
                                  gather_bytes=gathered_bytes(cfg.precision.name, "full",
                                                              cfg.parallel.fsdp_param_dtype))
    if cfg.parallel.data_shard == "optimizer":
        assert got.collective_bytes["broadcast"] == planned["broadcast"]
        return
    # FSDP2 pads each dense parameter's dim 0 to a multiple of its shards, which k3-plan leaves
    # out (the experts' 4 home experts split evenly over their shards here; under HSDP their
    # 2 expert-data ranks are replicas of one shard, which FSDP2 only all-reduces).
    shards = topology.dp_shard
    padding = {"all_gather": 0, "reduce_scatter": 0}
    for name, p in meta.named_parameters():
        if ".experts." in name:
            continue
        rows = -p.shape[0] % shards * p[0].numel()
        layer = name.startswith("layers.")
        width = 2 if layer and ".router." not in name else 4
        padding["all_gather"] += rows * width * (2 if layer else 1)  # layers gather again
        padding["reduce_scatter"] += rows * 4
    counts = len(meta.moe_layers()) * topology.ep * cfg.model.moe.num_experts * 4
    assert got.collective_bytes["reduce_scatter"] == (planned["reduce_scatter"]
                                                      + padding["reduce_scatter"])
    assert got.collective_bytes["all_gather"] == (planned["all_gather"] + padding["all_gather"]
                                                  + counts)


def test_the_peak_is_a_later_steps_with_the_optimizer_state(tmp_path):
    """The first step makes the optimizer state only in its update; the reported peak is a
    later step's, measured here on a second real step (its probe tracking the parameters,
    buffers and the state the first step left)."""
    from model.ops import dispatch
    from train.dry_run import synthetic_micro_batches
    from train.loop import build_parallel_model, train_step
    from train.step_probes import StepMemory

    cfg = dry_run_config(_tiny(tmp_path))
    reported = measure_step(cfg, None)
    device = torch.device("cpu")
    with dispatch.kernels_enabled(False):
        model, precision, parallel, optimizers = build_parallel_model(cfg, None, device)
        batches = synthetic_micro_batches(cfg, None)
        steps = []
        for _ in range(2):
            memory = StepMemory()
            memory.track([list(model.parameters()), list(model.buffers()),
                          [list(opt.state.values()) for opt in optimizers]])
            with memory, dispatch.only({}):
                train_step(model, optimizers, batches, device, precision, parallel, cfg.optim,
                           check_finite=False)
            steps.append(memory.peak)
    assert steps[1] > steps[0] + reported.memory_bytes["optimizer_state"] // 2
    assert abs(reported.peak_memory_bytes - steps[1]) <= PEAK_BLOCKS * 512
