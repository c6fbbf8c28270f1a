"""The `parallel` config group: the process layout Topology.from_config validates and builds.

Defined here, with the layer that reads it; train.config nests it in TrainConfig (and
re-exports it) for Hydra's structured config.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MoonEPConfig:
    transport: str = "collective"  # collective (gloo/NCCL, static sizes) | symm_mem (CUDA)
    alignment: int = 8  # rows per expert slot group are padded to a multiple of this


@dataclass
class ParallelConfig:
    """Process layout, in Megatron's rank order tp-cp-ep-dp-pp (parallel/topology.py owns it).

    world = pipeline * data * context * tensor; experts re-split the same ranks of one pipeline
    stage as expert_data * expert * expert_tensor. Validated by Topology.from_config."""

    data: int = -1  # data-parallel ranks (replicas x shards); -1: what the world size leaves
    data_replicate: int = 1  # HSDP: replica groups of the data ranks (data_shard optimizer|full)
    data_shard: str = "none"  # none (DDP) | optimizer (ZeRO-1) | full (FSDP2)
    # FSDP2 (data_shard full) gathers parameters in: compute, the autocast dtype (bf16 under
    # bf16 autocast, torchtitan's mixed_precision_param; the routers stay fp32) | master, the
    # fp32 master weights (autocast casts at each use)
    fsdp_param_dtype: str = "compute"
    tensor: int = 1
    sequence_parallel: bool = True  # with tensor > 1: norms and AttnRes mixes sharded on T
    context: int = 1
    # zigzag: rows in 2*context pieces, rank f holding pieces f and 2*context-1-f (the causal
    # attention work balanced) | contiguous: piece f of context
    context_layout: str = "zigzag"
    expert: int = 1
    # Each expert's intermediate dimension split over this many ranks (Megatron's ETP); -1: the
    # tensor-parallel size without expert parallelism (the MoE split like the dense MLP), 1 with it
    expert_tensor: int = -1
    expert_dispatch: str = "moonep"  # moonep (static shapes, no host sync) | dynamic (baseline)
    moonep: MoonEPConfig = field(default_factory=MoonEPConfig)
    pipeline: int = 1
    pipeline_schedule: str = "1F1B"  # 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV
    virtual_stages: int = 1  # pipeline stages per rank (interleaved / V schedules)
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 600.0  # a collective that waits longer fails the job
