"""Pipeline bubble per schedule on 4 gloo ranks: the measured idle fraction of each rank's step
(1 - compute time / step time, compute = the stages' forward, backward and weight-gradient
calls) next to the analytic bubble of the schedule.

    PYTHONPATH=$PWD python benchmarks/pipeline_bubble.py [--microbatches 8] [--steps 3]

Analytic bubbles (p ranks, m micro-batches, v stages per rank, F = B): 1F1B (p-1)/(m+p-1);
Interleaved1F1B (p-1)/(v*m+p-1); ZBVZeroBubble and DualPipeV 0 when forward, input-gradient
and weight-gradient times are equal (they fill the bubble with weight gradients), more when
they are not. On a 2-core CPU the 4 ranks share the cores, so compute times include waiting
for a core: compare the schedules with each other, not with a GPU.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny
from model.k3 import K3Model
from parallel.pipeline import PipelineStep
from train.flops import head_forward_flops_per_token, layer_forward_flops_per_token

PP, SEQ = 4, 256
SCHEDULES = [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)]


def analytic(schedule: str, p: int, m: int, v: int) -> float:
    if schedule == "1F1B":
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    return 0.0


def _timed(stage, name: str, clock: list[float]) -> None:
    inner = getattr(stage, name)

    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start

    setattr(stage, name, run)


def _batches(n: int) -> list[K3Batch]:
    g = torch.Generator().manual_seed(0)
    return [K3Batch(torch.randint(4, 2048, (1, SEQ), generator=g),
                    torch.randint(4, 2048, (1, SEQ), generator=g),
                    cu_seqlens_from_lengths([[SEQ // 2, SEQ // 2]], SEQ)) for _ in range(n)]


def _worker(rank: int, init_file: str, m: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=PP,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    base = K3Model(k3_tiny())
    cfg = base.cfg
    batches = _batches(m)
    tokens = torch.tensor(float(sum(mb.num_loss_tokens for mb in batches)))
    results = {}
    for schedule, v in SCHEDULES:
        runner = PipelineStep(copy.deepcopy(base), layer_forward_flops_per_token(cfg, SEQ),
                              head_forward_flops_per_token(cfg), None, schedule, v, m, (1, SEQ),
                              torch.device("cpu"))
        clock = [0.0]
        for stage in runner.stages:
            for name in ("forward_one_chunk", "backward_one_chunk",
                         "backward_weight_one_chunk"):
                _timed(stage, name, clock)
        runner.step(batches, tokens)  # warm-up
        busy, wall = 0.0, 0.0
        for _ in range(steps):
            dist.barrier()
            clock[0] = 0.0
            start = time.perf_counter()
            runner.step(batches, tokens)
            wall += time.perf_counter() - start
            busy += clock[0]
            for p in runner.model.parameters():
                p.grad = None
        results[schedule] = (1 - busy / wall, wall / steps)
    gathered = [None] * PP
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bubble.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), args.microbatches, args.steps, out),
                 nprocs=PP, join=True)
        ranks = torch.load(out)
    m = args.microbatches
    print(f"k3_tiny, {PP} gloo ranks, {m} micro-batches of 1 x {SEQ} tokens, "
          f"{args.steps} timed steps")
    print(f"{'schedule':<16} {'v':>2} {'step s':>7} {'measured bubble':>16} "
          f"{'(per rank)':<26} {'analytic':>8}")
    for schedule, v in SCHEDULES:
        per_rank = [r[schedule][0] for r in ranks]
        step = max(r[schedule][1] for r in ranks)
        mean = sum(per_rank) / len(per_rank)
        print(f"{schedule:<16} {v:>2} {step:7.2f} {mean:16.3f} "
              f"{' '.join(f'{b:.2f}' for b in per_rank):<26} "
              f"{analytic(schedule, PP, m, v):8.3f}")


if __name__ == "__main__":
    main()
