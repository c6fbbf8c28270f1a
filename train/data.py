"""The training loop's data: prepares the configured dataset if needed (rank 0; the others wait)
and builds this rank's DP-sharded, resumable loader for the configured stage. A prepared dataset
is used as it is, or refused with what to do (data_pipeline.pipeline.check_usable)."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from data_pipeline.loader import K3DataLoader
from data_pipeline.pipeline import ensure_prepared


def build_loader(cfg, dp_rank: int, dp_size: int) -> K3DataLoader:
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = dataclasses.replace(cfg.data, verbose=cfg.data.verbose or cfg.logging.verbose)
    if rank == 0:
        manifest = ensure_prepared(data)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        manifest = ensure_prepared(data)  # complete now: only reads the manifest
    return K3DataLoader.from_stage(manifest, cfg.stage, dp_rank=dp_rank, dp_world_size=dp_size,
                                   vision=cfg.model.vision)
