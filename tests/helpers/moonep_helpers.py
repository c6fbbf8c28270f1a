"""Spawning a gloo world in-process for the expert-parallel tests (torch.multiprocessing)."""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.train_helpers import free_port


def _worker(rank: int, world: int, port: int, backend: str, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn, *args, backend: str = "gloo") -> None:
    """Runs fn(rank, world, *args) on `world` ranks (gloo; nccl: one GPU each); re-raises the
    first rank's failure with its traceback. fn must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world, free_port(), backend, fn, args, errors),
                           nprocs=world, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        raise AssertionError("\n".join(messages) or str(exc)) from None


def host_split_exchange(group: dist.ProcessGroup):
    """An `Exchange` (parallel/moonep/transport.py) over all_to_all_single with the split sizes
    read on the host: what NVSHMEM's all_to_all_vdev does on the device, for running the
    symm_mem transport's index arithmetic on gloo."""
    def exchange(x: torch.Tensor, send_splits: torch.Tensor, rows_out: int) -> torch.Tensor:
        recv_splits = torch.empty_like(send_splits)
        dist.all_to_all_single(recv_splits, send_splits, group=group)
        send, recv = send_splits.tolist(), recv_splits.tolist()
        out = x.new_zeros(rows_out, *x.shape[1:])
        dist.all_to_all_single(out[:sum(recv)], x[:sum(send)].contiguous(), recv, send,
                               group=group)
        return out

    return exchange
