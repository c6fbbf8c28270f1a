"""Crash-safe checkpoints: sharded model/optimizer state via torch.distributed.checkpoint, per-rank
state (loader position, RNG) as small files, published by an atomic rename and a `latest` pointer.

Layout-free: model and optimizer state are saved under logical names with full shapes
(`get_model_state_dict` / `get_optimizer_state_dict`, the optimizer flattened to one entry per
parameter, so ZeRO-1 ranks that own different parameters and FSDP/TP shards all map onto the same
keys), and DCP reshards them into whatever layout loads them. The loader's position is global
(optimizer steps), the same on every rank, so a run may resume at another world size, data- or
tensor-parallel size: a rank without a file of its own reads rank 0's.

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .checkpoint_integrity import check, safe_dcp_load, write_checksums
from .rank_state import rank_file, read_rank_state, write_rank_state

COMPLETE = "COMPLETE"
# One optimizer entry per parameter name: layouts that split parameters over optimizers
# differently (ZeRO-1 ownership, Muon + AdamW) load each other's state.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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


def _strided_tp(value) -> bool:
    """A DTensor with a strided shard on the tensor-parallel dimension (the fused gate/up
    projection): DCP's planner cannot describe its chunks, so it is saved whole."""
    if not isinstance(value, DTensor):
        return False
    names = value.device_mesh.mesh_dim_names or ()
    return any(isinstance(pl, _StridedShard) and i < len(names) and names[i] == "tp"
               for i, pl in enumerate(value.placements))


def _whole_for_save(sd: dict) -> dict:
    return {k: v.full_tensor() if _strided_tp(v) else v for k, v in sd.items()}


def _whole_for_load(sd: dict) -> tuple[dict, dict]:
    """(state with whole placeholders for strided tensors, their DTensors to refill)."""
    strided = {k: v for k, v in sd.items() if _strided_tp(v)}
    return {k: torch.empty(v.shape, dtype=v.dtype) if k in strided else v
            for k, v in sd.items()}, strided


def _reshard_loaded(sd: dict, strided: dict) -> dict:
    for k, like in strided.items():
        sd[k] = distribute_tensor(sd[k], like.device_mesh, like.placements, src_data_rank=None)
    return sd


class Checkpointer:
    def __init__(self, root: str | Path, keep_last: int, rank: int = 0, world_size: int = 1,
                 sharded=None):
        """`sharded`: an object whose wrap/unwrap(model_sd, optim_sd) -> (model_sd, optim_sd)
        present parameters split across ranks as DTensors of their logical shape and back
        (parallel.expert_parallel's ExpertShardedState); None when every rank holds whole
        parameters."""
        self.root = Path(root)
        self.sharded = sharded
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
        model_sd, optim_sd = get_state_dict(model, optimizers, options=OPTIONS)
        if self.sharded is not None:
            model_sd, optim_sd = self.sharded.wrap(model_sd, optim_sd)
        dcp.save({"model": _whole_for_save(model_sd), "optim": _whole_for_save(optim_sd)},
                 checkpoint_id=str(partial))
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

    def load_weights(self, path: Path, model: torch.nn.Module) -> None:
        """The model's parameters and buffers only (no optimizer state, step or loader
        position), saved at any layout, into this layout; checksums checked first."""
        check(path, self.rank, self.world_size)
        self._load_states(path, model, [])

    def _load_states(self, path: Path, model: torch.nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> None:
        # get_state_dict creates the optimizer state (a zero step) that DCP loads into.
        model_sd, optim_sd = (get_state_dict(model, optimizers, options=OPTIONS) if optimizers
                              else (get_model_state_dict(model, options=OPTIONS), {}))
        if self.sharded is not None:
            model_sd, optim_sd = self.sharded.wrap(model_sd, optim_sd)
        (model_sd, model_strided), (optim_sd, optim_strided) = (_whole_for_load(model_sd),
                                                                _whole_for_load(optim_sd))
        state = {"model": model_sd, **({"optim": optim_sd} if optimizers else {})}
        safe_dcp_load(state, path)
        model_sd = _reshard_loaded(state["model"], model_strided)
        optim_sd = _reshard_loaded(state.get("optim", {}), optim_strided)
        if self.sharded is not None:
            model_sd, optim_sd = self.sharded.unwrap(model_sd, optim_sd)
        if optimizers:
            set_state_dict(model, optimizers, model_state_dict=model_sd,
                           optim_state_dict=optim_sd, options=OPTIONS)
        else:
            set_model_state_dict(model, model_sd, options=OPTIONS)

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
        self._load_states(path, model, optimizers)
        own = rank_file(path, self.rank)
        # Saved by fewer ranks: the side state (global loader position, RNG) is the same on all.
        restore_rank_state(read_rank_state(own if own.is_file() else rank_file(path, 0)))
        return int(meta["step"])
