"""The training loader: packed rows from the shards of a manifest as model.batch.K3Batch.

Order. One epoch holds as many samples as there are rows over all sources; a source's share is
its mixture weight, the weights normalised to sum 1 with a null weight standing for the
source's share of all rows; shares become counts by largest remainder. A source
with more samples than rows repeats its rows, fewer samples take a prefix of a fresh
permutation (seeded by seed, source, cycle), so over epochs every row is used equally often.
The epoch's samples are shuffled (seeded by seed, epoch) and cut into global batches of
micro_batch_size * dp_world_size * grad_accum rows, one per optimizer step (the tail that does
not fill one is dropped); micro-batch m of DP rank r takes rows [(m*W + r)*B, (m*W + r + 1)*B)
of it, so ranks see disjoint samples and every split of a step into ranks and micro-batches
covers the same rows. Iteration is endless.

State. state_dict() is the number of optimizer steps taken plus what the rows depend on (the
same on every rank); load_state_dict() continues with exactly the batches an uninterrupted run
would have produced, in any data-parallel layout with the same global batch.

Batch layout (model/batch.py). tokens/labels [B, T]; labels are the next token inside a
document piece and -100 on the last position of each piece, on padding and where the target is
an image placeholder; in a conversation (chat shards) the next token only where it is the
assistant's (its loss mask), so only the assistant's tokens are targets. A conversation longer
than the row is truncated or dropped as the manifest's chat_overflow says (packing.py); the
loader logs how many, per source, for its seq_len. cu_seqlens has exactly
B * max_docs_per_row + 1 entries: row r's documents, then its padding document (if any), then
zero-length documents (the boundary (r+1)*T repeated) up to max_docs_per_row per row. Vision:
patches [P, 3*p*p] in [-1, 1], grid_thw [I, 3], token_positions [V] = the flattened positions
of the <image> tokens, in order; `vision` is None for a batch without pictures.
"""

from __future__ import annotations

import json
import logging
from itertools import count
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from model.batch import K3Batch, VisionInput
from model.config import VisionConfig
from model.errors import ConfigError
from model.vision.layout import vision_token_count
from model.vision.patches import patchify_video

from .config import StageConfig
from .packing import row_offsets
from .shards import ShardReader
from .tokenizer import IMAGE_ID, PAD_ID

IGNORE = -100
log = logging.getLogger(__name__)
STATE_VERSION = 2  # 2: the position is global (optimizer steps), independent of the DP layout
SPLITS = {"train": "sources", "validation": "validation"}  # split -> its manifest key


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (largest remainder)."""
    share = weights / weights.sum() * total
    counts = np.floor(share).astype(np.int64)
    rest = np.argsort(-(share - counts), kind="stable")[:total - counts.sum()]
    counts[rest] += 1
    return counts


def frame_patches(frames: np.ndarray, patch_size: int) -> torch.Tensor:
    """uint8 frames [T, H, W, 3] -> float32 patch vectors [T*h*w, 3*p*p] scaled to [-1, 1], in
    the encoder's patch layout. Patchified as bytes (one copy at a quarter of the size), then
    converted and scaled in place: the same values as scaling the frames first."""
    patches = patchify_video(torch.from_numpy(frames).permute(0, 3, 1, 2), patch_size)
    return patches.float().div_(127.5).sub_(1.0)


class BatchSource(Dataset):
    """Map-style dataset: step index -> this rank's K3Batch (picklable for worker processes)."""

    def __init__(self, manifest_path: str | Path, seq_len: int, micro_batch_size: int,
                 dp_rank: int, dp_world_size: int, seed: int, max_docs_per_row: int,
                 patch_size: int, merge_size: int, frames_per_chunk: int, grad_accum: int = 1,
                 split: str = "train", loss_normalization: str = "token"):
        root = Path(manifest_path).parent
        # "sequence": each document piece's loss tokens weigh 1 / their count (loss_weights)
        self.per_document = loss_normalization == "sequence"
        manifest = json.loads(Path(manifest_path).read_text())
        if not manifest.get("complete"):
            raise ValueError(f"{manifest_path} is not a complete manifest")
        vision = manifest["vision"]
        for name, value in (("patch_size", patch_size), ("merge_size", merge_size),
                            ("frames_per_chunk", frames_per_chunk)):
            if vision[name] != value:
                raise ConfigError(f"vision {name}={value} does not match the data, whose "
                                  f"placeholders were sized with {name}={vision[name]} "
                                  f"({manifest_path})")
        self.fingerprint = manifest["fingerprint"]
        self.seq_len, self.batch, self.slots = seq_len, micro_batch_size, max_docs_per_row
        self.rank, self.world, self.seed = dp_rank, dp_world_size, seed
        self.grad_accum = grad_accum
        self.vision = VisionConfig(patch_size=patch_size, merge_size=merge_size,
                                   time_table_size=frames_per_chunk)
        self.readers: list[ShardReader] = []
        self.plans: list[np.ndarray] = []
        row_shard, row_start, row_end, source_rows, weights = [], [], [], [], []
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: must be one of {sorted(SPLITS)}")
        chat_overflow = manifest.get("chat_overflow", "truncate")
        for source in manifest.get(SPLITS[split], []):
            first = len(row_shard)
            readers = [ShardReader(root / shard["prefix"], chat_overflow)
                       for shard in source["shards"]]
            for reader in readers:
                plan = reader.plan(seq_len, max_docs_per_row)
                offsets = row_offsets(plan)
                row_shard += [len(self.readers)] * (len(offsets) - 1)
                row_start += offsets[:-1].tolist()
                row_end += offsets[1:].tolist()
                self.readers.append(reader)
                self.plans.append(plan)
            source_rows.append((first, len(row_shard)))
            weights.append(source["weight"])
            _log_overflow(source["name"], readers, seq_len)
        self.row_shard = np.array(row_shard, dtype=np.int64)
        self.row_start = np.array(row_start, dtype=np.int64)
        self.row_end = np.array(row_end, dtype=np.int64)
        self.source_rows = source_rows
        sizes = np.array([e - b for b, e in source_rows], dtype=np.float64)
        total = sizes.sum()
        w = np.array([size / total if wt is None else wt for wt, size in zip(weights, sizes)])
        w[sizes == 0] = 0.0
        self.samples_per_source = apportion(w, int(total))
        # One optimizer step's rows over all ranks and micro-batches: the same set of rows for
        # any split into ranks x micro-batches, so every data-parallel layout sees the data of the
        # single-process run step by step.
        self.global_batch = micro_batch_size * dp_world_size * grad_accum
        self.steps_per_epoch = int(total) // self.global_batch * grad_accum  # this rank's batches
        if self.steps_per_epoch == 0:
            raise ValueError(f"{int(total)} rows of {seq_len} tokens cannot fill one global "
                             f"batch of {self.global_batch} rows")
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """The global row of every sample of an epoch, in order."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        parts = []
        for s, ((begin, end), n) in enumerate(zip(self.source_rows, self.samples_per_source)):
            size = end - begin
            if n == 0:
                continue
            used = epoch * int(n) + np.arange(n)  # samples taken from this source so far
            cycles, within = np.divmod(used, size)
            rows = np.empty(n, dtype=np.int64)
            for c in np.unique(cycles):
                perm = np.random.default_rng([self.seed, s, int(c)]).permutation(size)
                rows[cycles == c] = begin + perm[within[cycles == c]]
            parts.append(rows)
        rows = np.concatenate(parts)
        rows = rows[np.random.default_rng([self.seed, 1 << 20, epoch]).permutation(len(rows))]
        self._epoch_cache = (epoch, rows)
        return rows

    def rows_for_step(self, step: int) -> np.ndarray:
        """Rows of this rank's `step`-th micro-batch: micro-batch m of optimizer step s takes
        slice (m * world + rank) of the step's global batch."""
        optimizer_step, micro = divmod(step, self.grad_accum)
        epoch, within = divmod(optimizer_step, self.steps_per_epoch // self.grad_accum)
        start = within * self.global_batch + (micro * self.world + self.rank) * self.batch
        return self.epoch_rows(epoch)[start:start + self.batch]

    def pieces(self, row: int) -> np.ndarray:
        return self.plans[self.row_shard[row]][self.row_start[row]:self.row_end[row]]

    def __len__(self) -> int:  # one epoch; the loader's sampler runs past it
        return self.steps_per_epoch

    def __getitem__(self, step: int) -> K3Batch:
        T, S = self.seq_len, self.slots
        tokens = np.full((self.batch, T), PAD_ID, dtype=np.int64)
        labels = np.full((self.batch, T), IGNORE, dtype=np.int64)
        weights = np.zeros((self.batch, T), dtype=np.float32) if self.per_document else None
        bounds = [0]
        items = []
        for b, row in enumerate(self.rows_for_step(step)):
            reader = self.readers[self.row_shard[row]]
            pos = 0
            for _, seq, offset, length in self.pieces(row):
                piece = reader.tokens(seq, offset, length)
                tokens[b, pos:pos + length] = piece
                target = piece[1:].copy()
                if reader.is_chat:  # the assistant's tokens only (never a placeholder)
                    target[~reader.mask(seq, offset + 1, length - 1)] = IGNORE
                else:
                    target[target == IMAGE_ID] = IGNORE
                labels[b, pos:pos + length - 1] = target
                if weights is not None:
                    weights[b, pos:pos + length - 1] = 1.0 / max(int((target != IGNORE).sum()), 1)
                # the pictures whose placeholders are in the piece (a truncated conversation
                # may end before some)
                pictures = reader.vision_items(seq)
                inside = (pictures[:, 1] >= offset) & (pictures[:, 1] < offset + length)
                items += [(reader, item) for item in pictures[inside]]
                pos += length
                bounds.append(b * T + pos)
            bounds += [(b + 1) * T] * ((b + 1) * S + 1 - len(bounds))
        return K3Batch(torch.from_numpy(tokens), torch.from_numpy(labels),
                       torch.tensor(bounds, dtype=torch.long), self._vision(tokens, items),
                       None if weights is None else torch.from_numpy(weights))

    def _vision(self, tokens: np.ndarray, items: list) -> VisionInput | None:
        positions = np.flatnonzero(tokens.reshape(-1) == IMAGE_ID)
        if not items:
            return None
        patches = [frame_patches(reader.frame_pixels(item), self.vision.patch_size)
                   for reader, item in items]
        grids = [tuple(int(v) for v in item[2:5]) for _, item in items]
        expected = sum(vision_token_count(grids, self.vision))
        if expected != len(positions):
            raise ValueError(f"{len(positions)} <image> tokens in the batch, but its pictures "
                             f"need {expected}")
        return VisionInput(torch.cat(patches), torch.tensor(grids, dtype=torch.long),
                           torch.from_numpy(positions.astype(np.int64)))


def _log_overflow(source: str, readers: list[ShardReader], seq_len: int) -> None:
    """Says how many of a chat source's conversations are longer than the row (once, as the
    plans are made: a stage's seq_len may differ from the one k3-data counted for)."""
    fits = [reader.fit(seq_len) for reader in readers if reader.is_chat]
    truncated, dropped = sum(f[1] for f in fits), sum(f[2] for f in fits)
    if truncated or dropped:
        log.warning("chat source %s: %d conversations longer than seq_len=%d: %d truncated, "
                    "%d dropped (data.chat_overflow=%s)", source, truncated + dropped, seq_len,
                    truncated, dropped, readers[0].chat_overflow)


class _Steps(torch.utils.data.Sampler):
    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        return count(self.start)


def _as_is(batch):
    return batch


class K3DataLoader:
    """Endless, DP-sharded, resumable iterator of K3Batch over a manifest's shards."""

    def __init__(self, manifest_path: str | Path, seq_len: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, seed: int = 0, num_workers: int = 0,
                 patch_size: int = 14, merge_size: int = 2, frames_per_chunk: int = 4,
                 max_docs_per_row: int = 64, grad_accum: int = 1, split: str = "train",
                 loss_normalization: str = "token"):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world_size={dp_world_size})")
        self.source = BatchSource(manifest_path, seq_len, micro_batch_size, dp_rank,
                                  dp_world_size, seed, max_docs_per_row, patch_size, merge_size,
                                  frames_per_chunk, grad_accum, split, loss_normalization)
        self.num_workers = num_workers
        self.step = 0
        self._it = None

    @classmethod
    def from_stage(cls, manifest_path: str | Path, stage: StageConfig, dp_rank: int = 0,
                   dp_world_size: int = 1, vision=None, split: str = "train") -> K3DataLoader:
        """`vision`: the model's VisionConfig (patch_size, merge_size, time_table_size);
        `split`: "train" or "validation" (the held-out documents)."""
        kwargs = {} if vision is None else {"patch_size": vision.patch_size,
                                            "merge_size": vision.merge_size,
                                            "frames_per_chunk": vision.time_table_size}
        grad_accum = stage.global_batch_size // (stage.micro_batch_size * dp_world_size)
        return cls(manifest_path, stage.seq_len, stage.micro_batch_size, dp_rank, dp_world_size,
                   stage.seed, stage.num_workers, max_docs_per_row=stage.max_docs_per_row,
                   grad_accum=grad_accum, split=split,
                   loss_normalization=stage.loss_normalization, **kwargs)

    @property
    def steps_per_epoch(self) -> int:
        return self.source.steps_per_epoch

    def __iter__(self):
        """Batches from the current state on; each one handed out advances the state."""
        if self.num_workers == 0:
            batches = (self.source[s] for s in count(self.step))
        else:
            batches = iter(DataLoader(self.source, batch_size=None, sampler=_Steps(self.step),
                                      num_workers=self.num_workers, collate_fn=_as_is))
        for batch in batches:
            self.step += 1
            yield batch

    def __next__(self) -> K3Batch:
        if self._it is None:
            self._it = iter(self)
        return next(self._it)

    def state_dict(self) -> dict:
        """The position in optimizer steps and what the rows depend on: the same on every rank
        and for every split of the global batch into ranks and micro-batches."""
        s = self.source
        if self.step % s.grad_accum:
            raise RuntimeError(f"loader state asked for in the middle of an optimizer step "
                               f"({self.step} micro-batches of {s.grad_accum} per step)")
        return {"version": STATE_VERSION, "optimizer_step": self.step // s.grad_accum,
                "seed": s.seed, "seq_len": s.seq_len, "global_batch": s.global_batch,
                "max_docs_per_row": s.slots, "fingerprint": s.fingerprint}

    def continue_from(self, state: dict) -> str | None:
        """Resumes from a checkpointed state: exactly (load_state_dict) when it was written for
        the same stage (any layout: the position is global); after a context-curriculum switch
        (another seq_len, global batch or seed on the same dataset) at the same position in
        the token stream: the new stage starts at the first optimizer step past the tokens the
        earlier stages consumed, which is the same fraction of an epoch (every packing of the
        dataset holds its tokens once per epoch). Returns None, or what changed (for the log)."""
        mine = self.state_dict()
        changed = {k for k in mine if k != "optimizer_step" and state.get(k) != mine[k]}
        if not changed:
            self.load_state_dict(state)
            return None
        for key in ("version", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader "
                                 f"{mine[key]!r}: a stage switch continues on the same dataset")
        tokens = int(state["optimizer_step"]) * state["global_batch"] * state["seq_len"]
        s = self.source
        per_step = s.global_batch * s.seq_len
        self.step = -(-tokens // per_step) * s.grad_accum
        self._it = None
        return ", ".join(f"{k} {state.get(k)} -> {mine[k]}" for k in sorted(changed))

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in mine:
            if key != "optimizer_step" and state.get(key) != mine[key]:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader "
                                 f"{mine[key]!r}: the batches would not continue exactly")
        self.step = int(state["optimizer_step"]) * self.source.grad_accum
        self._it = None
