"""From encoder features to LM tokens: temporal mean-pooling per video chunk, 2x2 space-to-depth
merge, and the MLP projector into the language model's hidden size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.norms import RMSNorm
from model.vision.layout import VisionLayout


def pool_chunks(x: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
    """[P, C] -> [slots, C]: each (chunk, spatial position) averaged over the chunk's frames.

    One gather per time step keeps the forward deterministic and the memory at two copies of x
    (index_select: its backward is an index_add, not the scatter-add of an indexing).
    """
    weights = layout.pool_weight.to(x.dtype)
    pooled = x.index_select(0, layout.pool_index[:, 0]) * weights[:, :1]
    for step in range(1, layout.pool_index.shape[1]):
        pooled = pooled + x.index_select(0, layout.pool_index[:, step]) * weights[:, step:step + 1]
    return pooled


def merge_tokens(pooled: torch.Tensor, merge_index: torch.Tensor) -> torch.Tensor:
    """Space-to-depth: [slots, C] -> [V, m*m*C], neighbours concatenated in row-major order."""
    return pooled.index_select(0, merge_index.flatten()).view(merge_index.shape[0], -1)


class VisionProjector(nn.Module):
    """Linear(m*m*hidden -> projector_hidden) -> GELU -> Linear(-> lm_hidden) -> RMSNorm."""

    def __init__(self, merged_dim: int, projector_hidden: int, lm_hidden: int, norm_eps: float):
        super().__init__()
        self.fc1 = nn.Linear(merged_dim, projector_hidden, bias=False)
        self.fc2 = nn.Linear(projector_hidden, lm_hidden, bias=False)
        self.norm = RMSNorm(lm_hidden, norm_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(F.gelu(self.fc1(merged))))
