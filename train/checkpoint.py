"""Crash-safe checkpoints: sharded model/optimizer state via torch.distributed.checkpoint (so a
later run with another layout can reshard it), per-rank state (loader position, RNG) as small
files, published by an atomic rename and a `latest` pointer.

Layout under <root>:
    step_00000100/           a complete checkpoint (has COMPLETE)
        __0_0.distcp ...     DCP shards of model + optimizer
        rank00000.json       per-rank state (loader, RNG): JSON, never a pickle
        CHECKSUMS.json       size and SHA-256 of every file above (checkpoint_integrity.py)
        COMPLETE             json: step, world size, time
    step_00000200.partial/   being written (or left by a crash: ignored, then removed)
    latest                   name of the newest complete checkpoint
    rejected/                checkpoints that failed verification at resume (kept, not read)
The root must be on a filesystem every rank sees.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .checkpoint_integrity import check, safe_dcp_load, write_checksums
from .rank_state import rank_file, read_rank_state, write_rank_state

COMPLETE = "COMPLETE"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fault_injection(step: int) -> None:
    """K3_FAULT_KILL_DURING_SAVE=<step>: die by SIGKILL after the shards of that step are written
    but before the checkpoint is published (the crash-safety test)."""
    if os.environ.get("K3_FAULT_KILL_DURING_SAVE") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


class Checkpointer:
    def __init__(self, root: str | Path, keep_last: int, rank: int = 0, world_size: int = 1):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size

    @staticmethod
    def step_dir_name(step: int) -> str:
        return f"step_{step:08d}"

    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir()
                 if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".partial")
                 and (p / COMPLETE).is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        """The checkpoint named by `latest` if it is complete, else the newest complete one."""
        pointer = self.root / "latest"
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / COMPLETE).is_file():
                return candidate
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def save(self, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             rank_state: dict) -> Path:
        final = self.root / self.step_dir_name(step)
        partial = self.root / (final.name + ".partial")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizers)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
        write_rank_state(rank_file(partial, self.rank), rank_state)
        _fault_injection(step)
        _barrier()
        write_checksums(partial, self.rank, self.world_size)
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size, "time": time.time()}
            _write_atomic(partial / COMPLETE, json.dumps(meta))
            if final.exists():  # a re-save of the same step (e.g. signal right after a save)
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            _write_atomic(self.root / "latest", final.name)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        for stale in self.root.glob("step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
             restore_rank_state: Callable[[dict], None], verified: bool = False) -> int:
        """Restores model, optimizer, RNG and (via the callback) loader state; returns the step.
        Checks the checksums first unless the caller just did (`verified`)."""
        if not verified:
            check(path, self.rank, self.world_size)
        meta = json.loads((path / COMPLETE).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizers)
        state = {"model": model_sd, "optim": optim_sd}
        safe_dcp_load(state, path)
        set_state_dict(model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if meta["world_size"] == self.world_size:
            restore_rank_state(read_rank_state(rank_file(path, self.rank)))
        else:
            raise RuntimeError(
                f"checkpoint {path} was written by {meta['world_size']} ranks, this run has "
                f"{self.world_size}: resharding the loader state is not supported yet")
        return int(meta["step"])
