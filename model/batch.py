"""The batch the model consumes: packed text rows plus NaViT-packed vision inputs.

Layout conventions (shared by the data pipeline, the training loop and the parallel plans):
- `tokens`, `labels`: [B, T]. Each row holds whole documents back to back; a document never
  crosses a row boundary. `labels[b, t]` is the target for position t (already shifted), -100
  where no loss is taken (image placeholders, padding, the last token of a document).
- `cu_seqlens`: [N + 1] int64, document boundaries over the row-major flattened B*T tokens
  (0, ..., B*T); every multiple of T is a boundary. Padding at the end of a row is its own
  document. N is fixed per batch layout, so shapes never depend on where documents end.
- Vision: every image is one frame, every video a list of frames; all patches of all frames are
  concatenated (`patches` [P, C*p*p], row-major per frame), `grid_thw` [I, 3] gives frames, patch
  rows and patch columns per image/video. `token_positions` [V] are the flattened B*T positions of
  the image placeholder tokens, in the order the encoder emits its output tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class VisionInput:
    patches: torch.Tensor  # [P, in_channels * patch * patch]
    grid_thw: torch.Tensor  # [I, 3] int64: frames, patch rows, patch cols
    token_positions: torch.Tensor  # [V] int64 positions in the flattened B*T token sequence
    # Which encoder output tokens land in this batch, [V] int64 (None: all of them, in order).
    # A context-parallel fragment holds some of its images' placeholders only.
    output_rows: torch.Tensor | None = None

    def to(self, device) -> VisionInput:
        return VisionInput(*(None if getattr(self, f.name) is None
                             else getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class K3Batch:
    tokens: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64, -100 = no loss
    # [N + 1] int64 over the flattened B*T tokens; None: one document per row
    cu_seqlens: torch.Tensor | None
    vision: VisionInput | None = None
    # [B, T] float32 weight of each position's loss (per-conversation averaging: 1 / the
    # conversation's loss tokens); None: every loss token weighs 1.
    loss_weights: torch.Tensor | None = None

    def to(self, device) -> K3Batch:
        return K3Batch(self.tokens.to(device), self.labels.to(device),
                       None if self.cu_seqlens is None else self.cu_seqlens.to(device),
                       None if self.vision is None else self.vision.to(device),
                       None if self.loss_weights is None else self.loss_weights.to(device))

    def loss_units(self) -> torch.Tensor:
        """What the loss is averaged over, summed over this batch (a device tensor: no sync):
        its loss tokens, or with loss_weights their weights (the conversations)."""
        valid = self.labels != -100
        if self.loss_weights is None:
            return valid.sum()
        return torch.where(valid, self.loss_weights.double(), 0.0).sum()

    @property
    def num_loss_tokens(self) -> float:
        return float(self.loss_units())


def cu_seqlens_from_lengths(rows: list[list[int]], seq_len: int) -> torch.Tensor:
    """Document boundaries for rows of document lengths; pads each row to seq_len with one
    padding document when the documents do not fill it."""
    bounds = [0]
    for r, lengths in enumerate(rows):
        start = r * seq_len
        pos = start
        for n in lengths:
            pos += n
            bounds.append(pos)
        if pos > start + seq_len:
            raise ValueError(f"row {r}: documents of total length {pos - start} exceed {seq_len}")
        if pos < start + seq_len:
            bounds.append(start + seq_len)
    return torch.tensor(bounds, dtype=torch.long)


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of each of `total` flattened positions, with static shapes (no sync)."""
    marks = torch.zeros(total + 1, dtype=torch.long, device=cu_seqlens.device)
    marks.index_add_(0, cu_seqlens[1:], torch.ones_like(cu_seqlens[1:]))
    return marks[:total].cumsum(0)
