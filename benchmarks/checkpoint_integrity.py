"""What checkpoint integrity costs: a Checkpointer save and load of a model + AdamW state of a
given size, next to the time to write and to verify its CHECKSUMS.json (SHA-256 of every file).

    python benchmarks/checkpoint_integrity.py --mb 256 --repeats 3

One process (the ranks share the hashing; with N ranks each hashes about 1/N of the files). The
figures are the median of the repeats; the page cache is warm, so the hashing is CPU-bound here
and I/O-bound on a shared filesystem.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.checkpoint import Checkpointer  # noqa: E402
from train.checkpoint_integrity import verify, write_checksums  # noqa: E402


def _model_and_optimizer(mb: int):
    # AdamW keeps two moments per parameter: the checkpoint is 3x the parameter bytes.
    numel = mb * 2**20 // 4 // 3
    width = 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(max(1, numel // width**2))])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _ignore(rank_state: dict) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer(args.mb)
    times: dict[str, list[float]] = {"save (incl. checksums)": [], "write checksums": [],
                                     "verify": [], "load (verified)": []}
    with tempfile.TemporaryDirectory() as root:
        ckpt = Checkpointer(root, keep_last=1)
        for step in range(1, args.repeats + 1):
            times["save (incl. checksums)"].append(
                _timed(ckpt.save, step, model, [opt], {"loader": {}}))
            path = ckpt.latest()
            times["write checksums"].append(_timed(write_checksums, path))
            times["verify"].append(_timed(verify, path))
            times["load (verified)"].append(_timed(ckpt.load, path, model, [opt], _ignore))
        size = sum(p.stat().st_size for p in path.iterdir()) / 2**20
    median = {k: statistics.median(v) for k, v in times.items()}
    base = median["save (incl. checksums)"]
    print(f"checkpoint of {size:.0f} MiB, median of {args.repeats}\n")
    print(f"{'operation':<24}{'time [s]':>10}{'MiB/s':>10}{'/ save':>9}")
    for name, t in median.items():
        print(f"{name:<24}{t:>10.3f}{size / t:>10.0f}{t / base:>8.2f}x")


if __name__ == "__main__":
    main()
