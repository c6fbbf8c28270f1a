"""Process-group start-up from the torchrun / Slurm environment."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.config import K3Config
from parallel.config import ParallelConfig
from parallel.topology import Topology


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA device is visible; use device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_choice: str, backend: str = "auto",
                     timeout_s: float = 600.0) -> DistEnv:
    """Reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun) and joins the default process group when
    there is more than one rank: gloo on CPU, NCCL on CUDA unless `backend` says otherwise."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_choice, local_rank)
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(rank, world, local_rank, device)


def init_topology(parallel: ParallelConfig, env: DistEnv,
                  model: K3Config | None = None) -> Topology:
    """The validated layout for this world; with more than one rank megatron-core creates its
    process groups now (call after init_distributed). One process needs no groups, and skipping
    them spares it megatron-core's import."""
    topology = Topology.from_config(parallel, env.world_size, model)
    if env.world_size > 1:
        topology.initialize(env.device.type)
    return topology


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In place over `group` (default: the world; a pipeline run passes one stage's group)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def shutdown(barrier: bool = True) -> None:
    """Leaves the default process group; `barrier`: first wait for every rank (a rank leaving
    early can abort the others' last collectives; a failed run skips it)."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_max(t: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
