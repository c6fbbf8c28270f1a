"""What a checkpoint may do to the job that reads it: nothing but hand back tensors and numbers.

Integrity. Every file of a checkpoint gets a SHA-256 and its size in CHECKSUMS.json, written at
save before the checkpoint is published; `verify` recomputes them and names each file that is
missing, truncated, unreadable or changed. `resume_checkpoint` picks the newest checkpoint that
verifies and moves the ones that do not into <root>/rejected/ (kept, never deleted), so a
requeued job resumes from the previous good checkpoint instead of dying on one bad file.

Safety. DCP reads its `.metadata` with pickle and non-tensor entries with
torch.load(weights_only=False): `safe_dcp_load` swaps in a reader whose unpickler accepts only
DCP's own metadata classes and a planner that loads entries with weights_only=True, so a
checkpoint directory someone else can write into cannot run code in the jobs that resume from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

CHECKSUMS = "CHECKSUMS.json"
REJECTED = "rejected"
NOT_HASHED = {CHECKSUMS, "COMPLETE"}  # COMPLETE is written after the checksums

log = logging.getLogger("k3.train")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as it is; the message names the file."""


def _all_gather(items: list) -> list:
    """Concatenation of every rank's `items` (single process: `items`)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return items
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.name not in NOT_HASHED)


def write_checksums(ckpt: Path, rank: int = 0, world_size: int = 1) -> None:
    """Hashes every file in `ckpt` (the ranks share the work) and has rank 0 write CHECKSUMS.json.
    Collective: every rank calls it once all of them have written their files."""
    mine = [(name, os.path.getsize(ckpt / name), _sha256(ckpt / name))
            for name in _files(ckpt)[rank::world_size]]
    entries = _all_gather(mine)
    if rank == 0:
        table = {name: {"bytes": size, "sha256": digest} for name, size, digest in sorted(entries)}
        tmp = ckpt / (CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"version": 1, "files": table}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt / CHECKSUMS)


def _problem(path: Path, expected: dict) -> str | None:
    try:
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return f"{path}: {size} bytes, expected {expected['bytes']} (truncated or rewritten)"
        if _sha256(path) != expected["sha256"]:
            return f"{path}: SHA-256 differs from {CHECKSUMS} (the bytes were changed)"
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as e:
        return f"{path}: unreadable ({e.strerror or e})"
    return None


def verify(ckpt: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """One line per file of `ckpt` that does not match CHECKSUMS.json (empty: it verifies).
    Collective; every rank returns the same list."""
    try:
        table = json.loads((ckpt / CHECKSUMS).read_text())["files"]
        mine = [_problem(ckpt / name, table[name]) for name in sorted(table)[rank::world_size]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        mine = [f"{ckpt / CHECKSUMS}: missing or unreadable ({e})"]
    # One gather on every path, so that ranks which read different things still agree.
    return sorted(set(_all_gather([p for p in mine if p is not None])))


def check(ckpt: Path, rank: int = 0, world_size: int = 1) -> None:
    """Raises CheckpointError naming every bad file of `ckpt`."""
    problems = verify(ckpt, rank, world_size)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged:\n  " + "\n  ".join(problems))


def _set_aside(ckpt: Path) -> Path:
    """Moves a checkpoint that failed verification to <root>/rejected/ (kept for inspection)."""
    target_dir = ckpt.parent / REJECTED
    target_dir.mkdir(exist_ok=True)
    target = target_dir / ckpt.name
    n = 0
    while target.exists():
        n += 1
        target = target_dir / f"{ckpt.name}.{n}"
    os.replace(ckpt, target)
    return target


def resume_checkpoint(ckpt) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of the Checkpointer `ckpt` that verifies (None: there is none), and
    one warning line per checkpoint that was set aside on the way. Collective."""
    warnings = []
    while (candidate := ckpt.latest()) is not None:
        problems = verify(candidate, ckpt.rank, ckpt.world_size)
        if not problems:
            return candidate, warnings
        moved = [str(_set_aside(candidate))] if ckpt.rank == 0 else []
        moved = _all_gather(moved)[0]  # also a barrier: no rank looks before the move is done
        line = (f"checkpoint {candidate.name} failed verification and was moved to {moved}; "
                f"falling back to the previous one. " + "; ".join(problems))
        if ckpt.rank == 0:
            log.warning(line)
        warnings.append(line)
    return None, warnings


# Everything DCP's own `.metadata` pickle holds (torch 2.13); anything else is refused.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: refers to {module}.{name}, which a checkpoint's "
                              "metadata never holds; refusing to load it (it could run code)")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allowlist of DCP's classes."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self._get_metadata_path(rank))
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata ({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads DCP's non-tensor entries (optimizer hyper-parameters, Stateful side state) with
    torch.load(weights_only=True): plain containers, numbers, strings and tensors only."""

    def __init__(self, checkpoint: Path):
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"{self.checkpoint}: entry {read_item.dest_index.fqn!r} is not plain data "
                f"({str(e).splitlines()[0]}); refusing to load it (it could run code)") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_dcp_load(state: dict, checkpoint: Path) -> None:
    """dcp.load of `state` from `checkpoint` that never unpickles anything but plain data.
    A refusal is a CheckpointError naming the file or entry (DCP would wrap it in a
    CheckpointException listing every rank's traceback)."""
    checkpoint = Path(checkpoint)
    reader = SafeFileSystemReader(checkpoint)
    reader.read_metadata()  # refuses a bad .metadata here, before DCP's collectives
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(checkpoint))
    except CheckpointException as e:
        for exc, _traceback in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise
