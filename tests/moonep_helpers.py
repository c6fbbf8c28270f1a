"""Spawning a gloo world in-process for the expert-parallel tests (torch.multiprocessing)."""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.train_helpers import free_port


def _worker(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn, *args) -> None:
    """Runs fn(rank, world, *args) on `world` gloo ranks; re-raises the first rank's failure
    with its traceback. fn must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world, free_port(), fn, args, errors), nprocs=world,
                           start_method="spawn")
    except mp.ProcessRaisedException as exc:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        raise AssertionError("\n".join(messages) or str(exc)) from None
