"""Index tensors that describe a NaViT-packed vision batch, built once per forward from grid_thw.

Every image is one frame; a video is split into chunks of up to `time_table_size` consecutive
frames. The packed patch sequence is the input order (items, frames, row-major patches), and
each chunk is one attention segment. After the encoder, each chunk is mean-pooled over its frames
into one spatial grid of "slots", and every output token gathers its merge x merge neighbouring
slots. Output order: items in order, chunks in order, merged tokens row-major.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from model.config import VisionConfig

Grid = tuple[int, int, int]  # frames, patch rows, patch cols


def grids_from(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[Grid]:
    """Host copy of grid_thw (one small sync; the vision path is not static-shape)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def _check(grid: Grid, index: int, cfg: VisionConfig) -> None:
    t, h, w = grid
    if t < 1 or h < 1 or w < 1 or h % cfg.merge_size or w % cfg.merge_size:
        raise ValueError(f"grid_thw[{index}]={list(grid)}: frames, rows and cols must be >= 1 and "
                         f"rows and cols multiples of merge_size={cfg.merge_size}")


def num_chunks(frames: int, cfg: VisionConfig) -> int:
    return -(-frames // cfg.time_table_size)


def vision_token_count(grid_thw: torch.Tensor | Sequence[Sequence[int]],
                       cfg: VisionConfig) -> list[int]:
    """LM tokens each image/video produces: chunks x (rows / merge) x (cols / merge)."""
    counts = []
    for i, grid in enumerate(grids_from(grid_thw)):
        _check(grid, i, cfg)
        t, h, w = grid
        counts.append(num_chunks(t, cfg) * (h // cfg.merge_size) * (w // cfg.merge_size))
    return counts


@dataclass(frozen=True)
class VisionLayout:
    grids: tuple[Grid, ...]
    seqlens: tuple[int, ...]  # patches of each attention segment (host: the attention's groups)
    cu_seqlens: torch.Tensor  # [chunks + 1] attention segment bounds over the packed patches
    rows: torch.Tensor  # [P] patch row within its frame
    cols: torch.Tensor  # [P] patch column within its frame
    frame_in_chunk: torch.Tensor  # [P] index into the time table
    # The distinct frame sizes (rows, cols), in order of first appearance, and each patch's row
    # in their position tables stacked (the table resized once per size, gathered once).
    frame_sizes: tuple[tuple[int, int], ...]
    position_index: torch.Tensor  # [P]
    pool_index: torch.Tensor  # [slots, time_table_size] packed patch of each frame of a slot
    pool_weight: torch.Tensor  # [slots, time_table_size] 1 / frames in the chunk, 0 = padding
    merge_index: torch.Tensor  # [V, merge * merge] slots of each output token, row-major

    @property
    def num_patches(self) -> int:
        return self.rows.shape[0]


def _item_layout(grid: Grid, patch_offset: int, slot_offset: int, cfg: VisionConfig):
    """One item's index arrays, in numpy: a micro-batch holds tens of small images, and these
    few dozen operations per item on arrays of tens of elements would each pay torch's
    per-operator dispatch."""
    t, h, w = grid
    span, m = cfg.time_table_size, cfg.merge_size
    hw = h * w
    chunks = num_chunks(t, cfg)
    chunk_frames = np.minimum(t - span * np.arange(chunks), span)

    rows = np.tile(np.repeat(np.arange(h), w), t)
    cols = np.tile(np.arange(w), h * t)
    frame_in_chunk = np.repeat(np.arange(t) % span, hw)

    # Slot (chunk c, spatial s) averages frames c*span + j; padding repeats frame c*span, weight 0.
    c = np.arange(chunks).reshape(-1, 1, 1)
    frame = c * span + np.arange(span).reshape(1, 1, -1)
    valid = frame < t
    frame = np.where(valid, frame, c * span)
    pool_index = patch_offset + frame * hw + np.arange(hw).reshape(1, -1, 1)
    pool_weight = (valid / chunk_frames.reshape(-1, 1, 1)).astype(np.float32)
    pool_index = pool_index.reshape(chunks * hw, span)
    pool_weight = np.broadcast_to(pool_weight, (chunks, hw, span)).reshape(chunks * hw, span)

    # Neighbour (di, dj) of merged token (i, j) is slot (i*m + di, j*m + dj) of the same chunk.
    i = np.arange(h // m).reshape(-1, 1, 1, 1)
    j = np.arange(w // m).reshape(1, -1, 1, 1)
    di = np.arange(m).reshape(1, 1, -1, 1)
    dj = np.arange(m).reshape(1, 1, 1, -1)
    spatial = ((i * m + di) * w + j * m + dj).reshape(-1, m * m)
    merge_index = slot_offset + (c.reshape(-1, 1, 1) * hw + spatial).reshape(-1, m * m)

    seqlens = chunk_frames * hw
    return rows, cols, frame_in_chunk, pool_index, pool_weight, merge_index, seqlens


def build_layout(grid_thw: torch.Tensor | Sequence[Sequence[int]], cfg: VisionConfig,
                 device: torch.device | str | None = None) -> VisionLayout:
    """All index tensors for one packed call; built on the host, moved to `device` once."""
    grids = grids_from(grid_thw)
    parts, position_index = [], []
    table_offsets: dict[tuple[int, int], int] = {}  # frame size -> its first stacked row
    patch_offset = slot_offset = table_rows = 0
    for index, grid in enumerate(grids):
        _check(grid, index, cfg)
        t, h, w = grid
        parts.append(_item_layout(grid, patch_offset, slot_offset, cfg))
        if (h, w) not in table_offsets:
            table_offsets[(h, w)] = table_rows
            table_rows += h * w
        position_index.append(np.tile(table_offsets[(h, w)] + np.arange(h * w), t))
        patch_offset += t * h * w
        slot_offset += num_chunks(t, cfg) * h * w
    if not parts:
        raise ValueError("grid_thw is empty: no image or video to encode")
    rows, cols, frame_in_chunk, pool_index, pool_weight, merge_index, seqlens = (
        torch.from_numpy(np.concatenate(column)) for column in zip(*parts))
    tensors = {"cu_seqlens": torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)), "rows": rows,
               "cols": cols, "frame_in_chunk": frame_in_chunk,
               "position_index": torch.from_numpy(np.concatenate(position_index)),
               "pool_index": pool_index, "pool_weight": pool_weight, "merge_index": merge_index}
    return VisionLayout(grids=tuple(grids), seqlens=tuple(seqlens.tolist()),
                        frame_sizes=tuple(table_offsets),
                        **{name: x.to(device) for name, x in tensors.items()})
