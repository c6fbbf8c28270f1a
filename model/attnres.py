"""Block Attention Residuals (SPEC 4): a learned softmax over earlier blocks replaces the plain
residual sum.

Each mix has a pseudo-query w (a d -> 1 linear, no bias, zero-initialised) and its own RMSNorm.
Keys are the normalised sources, values the raw ones, no temperature, all in fp32. With
zero-initialised queries every source gets the same weight at the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from .dtypes import widen
from .norms import rms_norm


class DepthMix(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.norm_weight)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack([widen(s) for s in sources])  # [n, ..., d]
        keys = rms_norm(values, self.norm_weight, self.eps)
        weights = torch.softmax(keys @ widen(self.query), dim=0)  # [n, ...]
        mixed = (weights.unsqueeze(-1) * values).sum(0)
        return mixed.to(sources[-1].dtype)


class BlockState:
    """The AttnRes bookkeeping of one forward pass: completed blocks and the running partial sum.

    Block size counts decoder layers (K3: 12), not sublayers. Layer 0 pushes the embedding as
    block 0; every `block_size` layers the partial sum becomes a completed block. A layer takes
    `blocks` (a snapshot tuple) and `partial` and returns the new partial, so that a whole
    layer, its depth mixes included, is one function of tensors (activation checkpointing,
    pipeline stages).
    """

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding
        self.block_size = block_size

    def start_layer(self, layer: int) -> None:
        """Completes a block before every block_size-th layer (layer 0: the embedding)."""
        if layer % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None

    def sources(self) -> list[torch.Tensor]:
        """Completed blocks, then the partial sum if the current block has one."""
        return self.blocks + ([] if self.partial is None else [self.partial])
